"""Least frequently used eviction (use counts per layer, kept across evictions)."""

from __future__ import annotations

from ggmoe.cache.policies.base import POLICIES, Policy
from ggmoe.cache.policies.usage import LayerUsage


@POLICIES.register("lfu")
class LFU(Policy):
    """Evict the expert the layer used least often; ties: least recently used, then lowest id."""

    def __init__(self, n_expert: int, layers: list[int]) -> None:
        super().__init__(n_expert, layers)
        self.usage = LayerUsage(n_expert, layers)

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        self.usage.record(il, experts)

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        count, last = self.usage.count[il], self.usage.last[il]
        return min(candidates, key=lambda e: (count[e], last[e], e))
