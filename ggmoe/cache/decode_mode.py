"""Which decode mode runs: ``sync`` (the route op answers every MoE layer from Python) or ``async``.

``async`` keeps the decode graph whole: the device reads each selected expert through the expert table
(its cache slot, or its host copy over the link), the routing leaves the device once per token, and the
cache is managed between tokens (``ggmoe.control.TokenController``). ``sync`` stays for what needs the
CPU's answer inside a layer: the host path (a slow link, where the CPU computes a miss sooner than a copy
brings it), stride prefetching from a predictor, observers that read router probabilities or hidden
states (tracing), benchmarks' routing overrides, and backends without ``mul_mat_id_table``. ``auto``
takes ``async`` unless one of those holds, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggmoe.errors import UsageError
from ggmoe.registry import check_choice

DECODE_MODES = ("auto", "async", "sync")
# The largest micro-batch (tokens) that reads its experts through the tables. ggml-cuda runs
# mul_mat_id_table on MMVQ, whose MoE micro-batch limit is 4 to 8 tokens by type and GPU
# (get_mmvq_mmid_max_batch): 4 fits every type; decode is 1 token. Larger micro-batches take the route op.
TABLE_MAX_TOKENS = 4


def check_decode_mode(name: str) -> str:
    return check_choice(name, DECODE_MODES, "decode mode")


@dataclass(frozen=True)
class DecodeMode:
    """The mode that runs and why (one line for the user, the stats and /metrics)."""

    asked: str  # auto | async | sync
    mode: str  # async | sync
    reason: str  # why this mode


def sync_reasons(miss_policy: str, prefetch: bool, backend_note: str | None) -> list[str]:
    """What needs the sync mode, from the configuration (miss policy as it runs, after ``auto``)."""
    out = []
    if miss_policy != "wait":
        out.append(f"the host path (miss policy {miss_policy}) computes misses on the CPU inside a layer")
    if prefetch:
        out.append("stride prefetching from a predictor runs inside the layers")
    if backend_note:
        out.append(backend_note)
    return out


def choose_decode_mode(asked: str, reasons: list[str]) -> DecodeMode:
    """``asked`` against what needs sync: ``auto`` picks, ``async`` with a conflict is a usage error."""
    asked = check_decode_mode(asked)
    if asked == "sync":
        return DecodeMode(asked, "sync", "asked for (--decode-mode sync)")
    if reasons:
        if asked == "async":
            raise UsageError(f"--decode-mode async cannot run here: {reasons[0]}; use --decode-mode sync or auto")
        return DecodeMode(asked, "sync", reasons[0])
    why = "asked for (--decode-mode async)" if asked == "async" else (
        "no layer needs the CPU's answer: experts read through the device-side table, no sync per layer")
    return DecodeMode(asked, "async", why)
