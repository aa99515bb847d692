"""A routing trace mapped to another model's shape: its layers, experts and top-k (estimates only).

Where a model's own routing is not at hand (``ggmoe plan --gpu``, the GPU harness's real-shape rows), a real
routing of another model stands in for it, mapped so that what a cache sees is kept: which experts a layer
reuses from token to token, and how skewed a layer's choices are.

- layers: model MoE layer j replays trace layer ``j * L_trace // L_model`` (spread, not tiled: the trace's
  first and last layers stay at the model's ends);
- experts: trace expert e of E_t stands for the model experts ``(e * E) // E_t + r`` (r = 0, 1, ... mod E),
  a block of ``E / E_t`` experts when the model has more, a shared one when it has fewer;
- top-k: a token's model experts are taken in the trace's weight order (router order where it has no
  weights), block offset r = 0 first, then r = 1, ..., the first k distinct. With more model experts, a
  token's strongest trace experts give the extra ones, so reuse and skew follow the trace.

The mapped trace names its source (``TraceMeta.source``: ``mapped from ...``) and keeps the original's
``lacks`` (router probabilities are not mapped: ``probs`` is added).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.trace.format import Trace

MAX_MAPPED = 1 << 28  # ids of a mapped trace at most (T x L x k)


def map_ids(ids: np.ndarray, weights: np.ndarray | None, n_expert_trace: int, n_expert: int, k: int) -> np.ndarray:
    """ids [T, k_t] of one trace layer (with their weights [T, k_t], or None: router order) -> [T, k]."""
    t, k_t = ids.shape
    order = np.argsort(-weights, axis=1, kind="stable") if weights is not None else np.tile(np.arange(k_t), (t, 1))
    ranked = np.take_along_axis(ids.astype(np.int64), order, axis=1)  # [T, k_t], strongest first
    base = ranked * n_expert // n_expert_trace
    out = np.full((t, k), -1, dtype=np.int64)
    for i in range(t):
        seen: list[int] = []
        r = 0
        while len(seen) < k:
            for b in base[i]:
                m = int((b + r) % n_expert)
                if m not in seen:
                    seen.append(m)
                    if len(seen) == k:
                        break
            r += 1
        out[i] = seen
    return out


def map_trace(trace: Trace, layers: tuple[int, ...], n_expert: int, k: int, n_layer: int) -> Trace:
    """``trace`` as the routing of a model with MoE layers ``layers``, ``n_expert`` experts, top-``k``."""
    if not 1 <= k <= n_expert:
        raise UsageError(f"top-k {k} must be in 1..{n_expert}")
    if not layers or trace.n_tokens * len(layers) * k > MAX_MAPPED:
        raise UsageError(f"a mapped trace of {trace.n_tokens} tokens x {len(layers)} layers x {k} is too large")
    m = trace.meta
    l_t = trace.ids.shape[1]
    w = trace.probs if "probs" not in m.lacks or trace.probs.any() else None
    cols = []
    for j in range(len(layers)):
        src = j * l_t // len(layers)
        wj = None
        if w is not None:
            wj = np.take_along_axis(w[:, src].astype(np.float32), trace.ids[:, src].astype(np.int64), axis=1)
        cols.append(map_ids(trace.ids[:, src], wj, m.n_expert, n_expert, k))
    ids = np.stack(cols, axis=1).astype(np.int16)
    meta = replace(m, n_layer=n_layer, n_expert=n_expert, n_expert_used=k, model_fingerprint="",
                   source=f"mapped from {m.source or m.model_name} ({m.n_expert} experts top-{m.n_expert_used}, "
                          f"{l_t} layers)", lacks=tuple(sorted(set(m.lacks) | {"probs", "hidden"})))
    return replace(trace, meta=meta, layers=np.asarray(layers, dtype=np.int32), ids=ids,
                   probs=np.zeros((trace.n_tokens, len(layers), n_expert), dtype=np.float16), hidden=None, logits=None)
