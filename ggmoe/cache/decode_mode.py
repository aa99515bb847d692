"""Which decode mode runs: ``sync`` (the route op answers every MoE layer from Python) or ``async``.

``async`` keeps the decode graph whole: the device reads each selected expert through the expert table
(its cache slot, or its host copy over the link), the routing leaves the device once per token, and the
cache is managed between tokens (``ggmoe.control.TokenController``). ``sync`` stays for what needs the
CPU's answer inside a layer: the host path (a slow link, where the CPU computes a miss sooner than a copy
brings it), predictors that read router probabilities, observers that read router probabilities or hidden
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


# Expert types ggml-cuda reads through an expert table: those MMVQ has a kernel for (patch 0008's
# ggml_cuda_mmvq_has_type, mirroring mul_mat_vec_q_switch_type). ggml-cpu reads every type through a table.
CUDA_TABLE_TYPES = frozenset({
    "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
})


def table_type_note(backend: str, tensors: list[tuple[str, str]]) -> str | None:
    """Why ``backend`` (a ggml device name: CPU, CUDA0, Vulkan0...) cannot read these expert weights through
    an expert table, naming the first tensor it cannot read and its type; None when it can. ``tensors``:
    (GGUF name, ggml type name) of every expert weight the cache holds."""
    name = backend.upper()
    if name.startswith("CPU"):
        return None
    if not name.startswith("CUDA"):
        return f"the {backend or 'GPU'} backend has no expert-table matmul (ggml-cpu and ggml-cuda do)"
    for tensor, gtype in tensors:
        if gtype.upper() not in CUDA_TABLE_TYPES:
            return (f"ggml-cuda reads expert tables with MMVQ, which has no kernel for {tensor} of type {gtype} "
                    "(quantize the experts to a type such as Q4_K, Q8_0 or MXFP4)")
    return None


def check_decode_mode(name: str) -> str:
    return check_choice(name, DECODE_MODES, "decode mode")


@dataclass(frozen=True)
class DecodeMode:
    """The mode that runs and why (one line for the user, the stats and /metrics)."""

    asked: str  # auto | async | sync
    mode: str  # async | sync
    reason: str  # why this mode


def sync_reasons(miss_policy: str, prefetch_note: str | None, backend_note: str | None) -> list[str]:
    """What needs the sync mode, from the configuration (miss policy as it runs, after ``auto``);
    ``prefetch_note``: why the predictor cannot run on the async decode's mailbox (None: it can)."""
    out = []
    if miss_policy != "wait":
        out.append(f"the host path (miss policy {miss_policy}) computes misses on the CPU inside a layer")
    if prefetch_note:
        out.append(prefetch_note)
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
