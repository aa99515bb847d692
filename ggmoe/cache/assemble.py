"""One assembly of the expert cache: an ``ExpertCache`` from a frozen record of what it is made of.

The engine's runtime (``ggmoe.engine.runtime``) and the trace replay (``ggmoe.simulate.replay``) build
the same cache from the same kinds of facts: the model's shape, slots per layer, a policy, a copy backend
and a clock. ``CacheSpec`` names them once, so what the cache needs is decided in one record and each
caller fills in only what differs (real copies and time in the engine, a virtual clock in the replay).
What the caller builds itself (the policy, the copy backend, the clock) stays the caller's: this module
only joins them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ggmoe.cache import CopyBackend, ExpertCache
from ggmoe.cache.clock import Clock
from ggmoe.cache.miss import MissCosts
from ggmoe.cache.policies import Policy
from ggmoe.cache.split import LayerSplit


@dataclass(frozen=True)
class CacheSpec:
    """What one ``ExpertCache`` is made of: its constructor's arguments, named, in its order."""

    n_expert: int  # experts per MoE layer
    n_expert_used: int  # experts each token selects (top-k)
    n_slots: Mapping[int, int]  # slots per cached MoE layer
    policy: Policy  # the eviction policy, built for those layers
    copies: CopyBackend | None = None  # None: every copy lands at once (``NullCopyBackend``)
    bytes_per_expert: Mapping[int, int] | None = None  # bytes of one whole expert per layer (statistics)
    clock: Clock | None = None  # None: the monotonic clock (real time)
    miss_policy: str = "wait"  # what a miss does: wait for the copy, or the host path (cpu, auto)
    costs: MissCosts | None = None  # the auto miss policy's cost model
    split: Mapping[int, LayerSplit] | None = None  # MoEpic's split layers (slots hold top segments)
    n_bottom: int = 0  # bottom buffers per split layer (prefetched bottoms)


def assemble_cache(spec: CacheSpec) -> ExpertCache:
    """The cache the spec describes; the cache checks it (slots against top-k and ``n_expert``, split
    layers against the miss policy) and raises ``UsageError`` as it always has."""
    return ExpertCache(spec.n_expert, spec.n_expert_used, dict(spec.n_slots), spec.policy, spec.copies,
                       bytes_per_expert=spec.bytes_per_expert, clock=spec.clock,
                       miss_policy=spec.miss_policy, costs=spec.costs, split=spec.split,
                       n_bottom=spec.n_bottom)
