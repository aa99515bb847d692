"""Trace-replay routing (benchmarks only): real learned routing on a random-weight model.

Random weights route almost uniformly, the worst case for any cache. In this
mode the route callback hands the cache and the prefetcher the experts a trace
of the embedded model selected (held-out prompts, teacher-forced), instead of
the random router's, while every copy, kernel and sync stays real: the slots
the cache returns hold those experts, and the GPU computes with them.

The trace's MoE layers are tiled over the deeper model (model layer at position
j replays trace layer j mod L_trace). When the model has more experts or a
larger top-k than the trace, each trace expert e stands for ``factor =
n_expert / n_expert_trace`` experts of the model and a layer uses ``reps = k /
k_trace`` of them: e -> {e * factor + (j * reps + r) mod factor : r < reps}, so
reuse and locality follow the trace. Predictors that read router
probabilities get them spread the same way; those that need hidden states
(mlp, skip-gate) are not available in this mode: the trace's hidden size is
not the model's.

An imported public routing (``ggmoe trace import``, e.g. DeepSeek-V2-Lite's real routing in
../shared/real-routing) is mapped to the model's shape instead (``ggmoe.trace.remap``), and results name
its source (``routing_name``).

Every result produced in this mode says so (``ROUTING_NAME``, or ``routing_name`` of the trace); it is
never a default.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from ggmoe.trace import Trace, load_trace
from ggmoe.trace.data import select_prompts, split_prompts
from ggmoe.trace.format import write_trace
from ggmoe.trace.remap import map_trace

ROUTING_NAME = "trace-replay routing (benchmark only: experts from a trace of the embedded model)"


class TilingError(ValueError):
    """The trace cannot stand for the model's routing (expert counts or top-k do not divide)."""


def expert_map(n_expert_trace: int, k_trace: int, n_expert: int, k: int) -> tuple[int, int]:
    """(factor, reps): how many model experts one trace expert stands for, and how many a layer uses."""
    if n_expert % n_expert_trace or k % k_trace:
        raise TilingError(f"a trace of {n_expert_trace} experts top-{k_trace} cannot stand for {n_expert} "
                          f"experts top-{k}: the counts must divide")
    factor, reps = n_expert // n_expert_trace, k // k_trace
    if reps > factor:
        raise TilingError(f"top-{k} of {n_expert} needs {reps} model experts per trace expert, more than the "
                          f"{factor} it stands for")
    return factor, reps


def tile_ids(ids: np.ndarray, n_layer: int, factor: int, reps: int) -> np.ndarray:
    """Trace ids [T, L_t, k_t] -> model ids [T, n_layer, k_t * reps] (layers tiled, experts spread)."""
    t, l_t, k_t = ids.shape
    out = np.empty((t, n_layer, k_t * reps), dtype=np.int32)
    for j in range(n_layer):
        src = ids[:, j % l_t, :].astype(np.int32)  # [T, k_t]
        offs = np.array([(j * reps + r) % factor for r in range(reps)], dtype=np.int32)  # [reps]
        out[:, j, :] = (src[:, :, None] * factor + offs[None, None, :]).reshape(t, k_t * reps)
    return out


def tile_probs(probs: np.ndarray, n_layer: int, factor: int) -> np.ndarray:
    """Trace probabilities [T, L_t, E_t] -> [T, n_layer, E_t * factor], each spread evenly over its experts."""
    l_t = probs.shape[1]
    cols = [np.repeat(probs[:, j % l_t, :].astype(np.float32) / factor, factor, axis=1) for j in range(n_layer)]
    return np.stack(cols, axis=1).astype(np.float16)


def tile_trace(trace: Trace, layers: tuple[int, ...], n_expert: int, k: int, fingerprint: str) -> Trace:
    """The trace as the model's: its layers, experts and fingerprint (hidden states and raw logits dropped)."""
    factor, reps = expert_map(trace.meta.n_expert, trace.meta.n_expert_used, n_expert, k)
    meta = dataclasses.replace(trace.meta, model_fingerprint=fingerprint, n_layer=max(layers) + 1,
                               n_expert=n_expert, n_expert_used=k,
                               model_name=f"{trace.meta.model_name} (tiled: {ROUTING_NAME})")
    return dataclasses.replace(trace, meta=meta, layers=np.asarray(layers, dtype=np.int32),
                               ids=tile_ids(trace.ids, len(layers), factor, reps).astype(np.int16),
                               probs=tile_probs(trace.probs, len(layers), factor), hidden=None,
                               logits=None)  # raw router logits do not tile: the probabilities do


def routing_name(trace: Trace) -> str:
    """What every result replaying ``trace`` says about its routing: the real routing's source, or the tiling."""
    if trace.meta.source:
        return (f"trace-replay routing (benchmark only: real routing, {trace.meta.source}, "
                "mapped to the model's shape by ggmoe.trace.remap)")
    return ROUTING_NAME


def model_trace(trace: Trace, layers: tuple[int, ...], n_expert: int, k: int, fingerprint: str) -> Trace:
    """The routing the model replays: an imported (public, real) routing mapped to its shape
    (``ggmoe.trace.remap``: layers spread, experts in blocks, weight order); a trace of the embedded model tiled."""
    if not trace.meta.source:
        return tile_trace(trace, layers, n_expert, k, fingerprint)
    mapped = map_trace(trace, layers, n_expert, k, max(layers) + 1)
    return dataclasses.replace(mapped, meta=dataclasses.replace(mapped.meta, model_fingerprint=fingerprint))


def split_tiled(trace_path: str | Path, layers: tuple[int, ...], n_expert: int, k: int, fingerprint: str,
                out_dir: Path, held_out: float = 0.25, seed: int = 0) -> tuple[Path, Path]:
    """The model's routing (``model_trace``) split by prompt: (train.npz, held-out.npz) written to ``out_dir``."""
    trace = load_trace(trace_path)
    tiled = model_trace(trace, layers, n_expert, k, fingerprint)
    train_p, held_p = split_prompts(tiled.n_prompts, held_out, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held = out_dir / "train.npz", out_dir / "held-out.npz"
    write_trace(select_prompts(tiled, train_p), train)
    write_trace(select_prompts(tiled, held_p), held)
    return train, held


class TraceRouting:
    """The routing override: layer il's selected experts for the next micro-batch, from a tiled trace.

    A token cursor advances at the first MoE layer of each micro-batch; the other layers take the same
    rows, so a token's experts agree across layers as in the trace (the last layer of a prompt computes
    only its last rows: it takes the batch's last ones). The cursor wraps around the trace. A one-token
    call (decode) returns a list made in advance; ``seconds`` and ``calls`` count what the override costs
    inside the route callback (it is part of the measured hook time and decode time).
    """

    def __init__(self, trace: Trace) -> None:
        self.ids = np.ascontiguousarray(trace.ids.astype(np.int32))  # [T, L, k]
        self.rows = [[self.ids[t, j].tolist() for j in range(self.ids.shape[1])] for t in range(self.ids.shape[0])]
        self.pos = {int(il): j for j, il in enumerate(trace.layers)}
        self.first = int(trace.layers[0])
        self.n = self.ids.shape[0]
        self.cursor = 0  # the next micro-batch's first row
        self.start, self.width = 0, 0  # rows of the current micro-batch
        self.seconds, self.calls = 0.0, 0  # s spent in the override, and its calls

    def __call__(self, il: int, n_tokens: int) -> list[int]:
        t0 = time.perf_counter()
        if il == self.first:
            self.start, self.width = self.cursor, n_tokens
            self.cursor = (self.cursor + n_tokens) % self.n
        first = self.start + max(self.width - n_tokens, 0)
        if n_tokens == 1:
            out = self.rows[first % self.n][self.pos[il]]
        else:
            rows = np.arange(first, first + n_tokens) % self.n
            out = self.ids[rows, self.pos[il], :].ravel().tolist()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out
