"""Trace-driven simulation of the expert cache.

Replays a trace through the same ``ExpertCache`` and policies the engine uses,
calling ``route`` once per MoE layer per micro-batch in the order the engine
does: each prompt's prefill rows in chunks of ``n_ubatch`` tokens, then one
call per decode step, layers ascending. Replaying an engine's own trace must
give the hits and misses the engine counted.

A policy that needs the future (``Policy.needs_future``, Belady) gets, before each call, the access number
(the cache's ``clock``: one per routed layer call) of the next routed call of the same layer that uses each
of the call's experts (inf: never again); before a layer's first call, also the first use of every other
expert. A native call does not count as a use: it needs no slot.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ggmoe.cache import CacheStats, CopyBackend, ExpertCache
from ggmoe.cache.assemble import CacheSpec, assemble_cache
from ggmoe.cache.clock import ManualClock
from ggmoe.cache.miss import MissCosts
from ggmoe.cache.policies import make_policy
from ggmoe.trace.format import STAGE_PREFILL, Trace


def micro_batches(trace: Trace, n_ubatch: int | None = None) -> Iterator[slice]:
    """Row ranges of the trace in the order the engine computed them."""
    n_ubatch = n_ubatch or trace.meta.n_ubatch
    for p in range(trace.n_prompts):
        sl = trace.prompt_slice(p)
        stage = trace.stage[sl]
        n_prefill = int(np.sum(stage == STAGE_PREFILL))
        for i in range(0, n_prefill, n_ubatch):
            yield slice(sl.start + i, sl.start + min(i + n_ubatch, n_prefill))
        for r in range(sl.start + n_prefill, sl.stop):
            yield slice(r, r + 1)


def _schedule(trace: Trace, cache: ExpertCache, layers: list[int], n_ubatch: int | None
              ) -> list[tuple[int, slice, bool]]:
    """(il, rows, routed) per layer call, in the engine's order; routed: on the cache, else native."""
    return [(il, rows, cache.fits(il, rows.stop - rows.start))
            for rows in micro_batches(trace, n_ubatch) for il in layers]


def next_uses(calls: list[tuple[int, list[int]]], n_expert: int) -> list[dict[int, float]]:
    """Per routed call (il, distinct experts), in order: expert -> access number of its next use in layer il.

    Access numbers count routed calls from 1, as ``ExpertCache.clock`` does. A layer's first call also names
    the first use of every expert it does not use itself (inf: never), so a prefetched expert is known too.
    """
    call_il = np.fromiter((il for il, _ in calls), dtype=np.int64, count=len(calls))
    lens = np.fromiter((len(need) for _, need in calls), dtype=np.int64, count=len(calls))
    experts = np.fromiter((e for _, need in calls for e in need), dtype=np.int64, count=int(lens.sum()))
    return next_uses_flat(call_il, lens, experts, n_expert)


def next_uses_flat(call_il: np.ndarray, lens: np.ndarray, experts: np.ndarray, n_expert: int
                   ) -> list[dict[int, float]]:
    """``next_uses`` of calls given as arrays (a long replay's million calls, without a Python loop over
    their experts): ``call_il`` [n_calls] the layer, ``lens`` [n_calls] how many distinct experts each call
    uses, ``experts`` [sum(lens)] those experts, call after call."""
    if len(experts) and (experts.min() < 0 or experts.max() >= n_expert):
        raise ValueError(f"expert ids must lie in [0, {n_expert}): got {experts.min()}..{experts.max()}")
    n_calls = len(call_il)
    call = np.repeat(np.arange(n_calls, dtype=np.int64), lens)  # [n_pairs] the call of each (call, expert)
    layers, firsts, dense = np.unique(call_il, return_index=True, return_inverse=True)
    group = dense.reshape(-1)[call] * n_expert + experts  # [n_pairs] (layer, expert) as one number
    # by group, each group's uses in call order (a stable sort; a radix sort where the groups fit 16 bits)
    order = np.argsort(group.astype(np.uint16) if len(layers) * n_expert <= 1 << 16 else group, kind="stable")
    sorted_group = group[order]
    same = sorted_group[1:] == sorted_group[:-1]  # the next pair in order is a later use of the same group
    nxt = np.full(len(order), math.inf)  # [n_pairs] access number of the next use (inf: never again)
    nxt[order[:-1][same]] = call[order][1:][same] + 1.0
    es, ts, ends = experts.tolist(), nxt.tolist(), np.cumsum(lens).tolist()
    out = [dict(zip(es[a:b], ts[a:b], strict=True)) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    first_pair = np.ones(len(order), dtype=bool)  # the first use of each (layer, expert)
    first_pair[1:] = ~same
    first_use = {(int(call_il[call[q]]), int(experts[q])): float(call[q] + 1) for q in order[first_pair]}
    for layer, i in zip(layers.tolist(), firsts.tolist(), strict=True):  # a layer's first call also names
        for e in range(n_expert):  # every expert's first use
            out[i].setdefault(e, first_use.get((layer, e), math.inf))
    return out


def replay(trace: Trace, n_slots: int | dict[int, int], policy: str = "lru", copies: CopyBackend | None = None,
           bytes_per_expert: dict[int, int] | None = None, n_ubatch: int | None = None,
           miss_policy: str = "wait", policy_options: Mapping[str, Any] | None = None,
           costs: MissCosts | None = None, beside_link: bool = False) -> CacheStats:
    """Run the trace through a fresh cache; returns its statistics.

    ``policy_options`` are the policy's keyword arguments (e.g. ``counts`` for ``static``: ``ggmoe.trace.data.load_counts``).
    ``costs``: the ``auto`` miss policy's cost model; ``beside_link``: the CPU computes beside the link (the
    engine's host part on a worker), so ``auto`` splits a layer's misses between the two.
    """
    layers = [int(il) for il in trace.layers]
    slots = n_slots if isinstance(n_slots, dict) else {il: int(n_slots) for il in layers}
    m = trace.meta
    pol = make_policy(policy, m.n_expert, layers, policy_options)
    cache = assemble_cache(CacheSpec(m.n_expert, m.n_expert_used, slots, pol, copies=copies, clock=ManualClock(),
                                      bytes_per_expert=bytes_per_expert, miss_policy=miss_policy, costs=costs))
    cache.cpu_beside_link = beside_link
    ids = trace.ids.astype(np.int32)
    pos = {il: j for j, il in enumerate(layers)}
    schedule = _schedule(trace, cache, layers, n_ubatch)
    future: list[dict[int, float]] | None = None
    if pol.needs_future:
        routed = [(il, sorted(set(ids[rows, pos[il]].ravel().tolist()))) for il, rows, ok in schedule if ok]
        future = next_uses(routed, m.n_expert)
    i = 0
    for il, rows, ok in schedule:
        if not ok:
            cache.observe(il, ids[rows, pos[il]])
        elif future is None:
            cache.route(il, ids[rows, pos[il]])
        else:
            cache.route_flat(il, ids[rows, pos[il]].ravel().tolist(), next_use=future[i])
            i += 1
    return cache.stats
