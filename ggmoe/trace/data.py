"""Trace data for predictors: several trace files as one, and the train/held-out split BY PROMPT.

Tokens of one prompt are strongly correlated, so a split by token would leak:
training (``predictors/``) and evaluation (``ggmoe.predict_eval``) split prompts,
with the same seeded function, so that both sides agree on the held-out prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.trace.format import STAGE_DECODE, Trace, load_trace


def merge_traces(traces: list[Trace]) -> Trace:
    """Several traces of one model (same fingerprint and layers) as one, prompts in order."""
    if not traces:
        raise UsageError("no traces given")
    first = traces[0]
    for t in traces[1:]:
        if t.meta.model_fingerprint != first.meta.model_fingerprint:
            raise UsageError(f"traces of different models: {first.meta.model_fingerprint} vs "
                             f"{t.meta.model_fingerprint}")
        if not np.array_equal(t.layers, first.layers):
            raise UsageError("traces with different MoE layers cannot be merged")
    if len(traces) == 1:
        return first
    with_hidden = all(t.hidden is not None for t in traces)
    starts = np.cumsum([0] + [t.n_tokens for t in traces[:-1]])
    offsets = np.concatenate([traces[0].prompt_offsets[:1]] +
                             [t.prompt_offsets[1:] + s for t, s in zip(traces, starts, strict=True)])

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(t, name) for t in traces], axis=0)

    # every imported routing's source is named (each once, in order): results replaying it cite them all
    source = "; ".join(dict.fromkeys(t.meta.source for t in traces if t.meta.source))
    return replace(first, meta=replace(first.meta, source=source), token_ids=cat("token_ids"), positions=cat("positions"), stage=cat("stage"),
                   prompt_offsets=offsets.astype(np.int64), ids=cat("ids"), probs=cat("probs"),
                   hidden=cat("hidden") if with_hidden else None,
                   logits=cat("logits") if all(t.logits is not None for t in traces) else None)


def load_traces(paths: list[str | Path] | tuple[str | Path, ...], hidden: bool = True) -> Trace:
    """Load and merge trace files (or directories holding trace.npz)."""
    return merge_traces([load_trace(p, hidden=hidden) for p in paths])


def split_prompts(n_prompts: int, val_frac: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) prompt indices, ascending; seeded, about ``val_frac`` held out (at least 1)."""
    if n_prompts < 2:
        raise UsageError(f"{n_prompts} prompt(s): a split by prompt needs at least 2")
    if not 0.0 < val_frac < 1.0:
        raise UsageError(f"held-out fraction {val_frac} must be in (0, 1)")
    n_val = min(max(1, round(n_prompts * val_frac)), n_prompts - 1)
    perm = np.random.default_rng(seed).permutation(n_prompts)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def select_prompts(trace: Trace, prompts: np.ndarray) -> Trace:
    """The sub-trace of the given prompts (in the given order)."""
    slices = [trace.prompt_slice(int(p)) for p in prompts]
    rows = np.concatenate([np.arange(s.start, s.stop) for s in slices]) if slices else np.zeros(0, np.int64)
    lengths = np.asarray([s.stop - s.start for s in slices], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return replace(trace, token_ids=trace.token_ids[rows], positions=trace.positions[rows],
                   stage=trace.stage[rows], prompt_offsets=offsets, ids=trace.ids[rows],
                   probs=trace.probs[rows], hidden=trace.hidden[rows] if trace.hidden is not None else None,
                   logits=trace.logits[rows] if trace.logits is not None else None)


def next_token_pairs(trace: Trace) -> np.ndarray:
    """Rows r [n] int64, ascending, such that r and r + 1 are consecutive decode tokens of one sequence: both
    decode steps, in the same prompt, at positions p and p + 1. What a cross-token predictor learns from (row
    r's state -> row r + 1's experts); never a pair across a prompt boundary or from a prefill token."""
    if trace.n_tokens < 2:
        return np.zeros(0, dtype=np.int64)
    r = np.arange(trace.n_tokens - 1, dtype=np.int64)
    prompt = np.repeat(np.arange(trace.n_prompts), np.diff(trace.prompt_offsets))  # [T] prompt of each row
    decode = trace.stage == STAGE_DECODE
    ok = (decode[:-1] & decode[1:] & (prompt[:-1] == prompt[1:])
          & (trace.positions[1:].astype(np.int64) == trace.positions[:-1].astype(np.int64) + 1))
    return r[ok]


def trace_counts(trace: Trace) -> dict[int, np.ndarray]:
    """il -> [n_expert] int64: how many tokens of the trace selected each expert of each MoE layer (the
    ``static`` policy's counts)."""
    n_expert = trace.meta.n_expert
    ids = trace.ids.astype(np.int64)  # [T, L, k]
    return {int(il): np.bincount(ids[:, j].ravel(), minlength=n_expert) for j, il in enumerate(trace.layers)}


def load_counts(paths: str | Path | Sequence[str | Path]) -> dict[int, np.ndarray]:
    """Summed ``trace_counts`` of the trace files ``paths``."""
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    total: dict[int, np.ndarray] = {}
    for p in paths:
        for il, c in trace_counts(load_trace(p, hidden=False)).items():
            total[il] = total[il] + c if il in total else c
    return total
