"""Trace-driven simulation of the expert cache.

Replays a trace through the same ``ExpertCache`` and policies the engine uses,
calling ``route`` once per MoE layer per micro-batch in the order the engine
does: each prompt's prefill rows in chunks of ``n_ubatch`` tokens, then one
call per decode step, layers ascending. Replaying an engine's own trace must
give the hits and misses the engine counted.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ggmoe.cache import CacheStats, CopyBackend, ExpertCache
from ggmoe.cache.clock import ManualClock
from ggmoe.cache.policies import POLICIES
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


def replay(trace: Trace, n_slots: int | dict[int, int], policy: str = "lru", copies: CopyBackend | None = None,
           bytes_per_expert: dict[int, int] | None = None, n_ubatch: int | None = None,
           miss_policy: str = "wait") -> CacheStats:
    """Run the trace through a fresh cache; returns its statistics."""
    layers = [int(il) for il in trace.layers]
    slots = n_slots if isinstance(n_slots, dict) else {il: int(n_slots) for il in layers}
    m = trace.meta
    cache = ExpertCache(m.n_expert, m.n_expert_used, slots, POLICIES.get(policy)(m.n_expert, layers),
                        copies=copies, bytes_per_expert=bytes_per_expert, clock=ManualClock(),
                        miss_policy=miss_policy)
    ids = trace.ids.astype(np.int32)
    for rows in micro_batches(trace, n_ubatch):
        n_tokens = rows.stop - rows.start
        for j, il in enumerate(layers):
            if cache.fits(il, n_tokens):
                cache.route(il, ids[rows, j])
            else:
                cache.observe(il, ids[rows, j])
    return cache.stats
