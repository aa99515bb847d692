"""Least recently used eviction."""

from __future__ import annotations

from ggmoe.cache.policies.base import POLICIES, Policy


@POLICIES.register("lru")
class LRU(Policy):
    """Evict the expert of the layer used least recently."""

    def __init__(self, n_expert: int, layers: list[int]) -> None:
        super().__init__(n_expert, layers)
        self.last_use = {il: [-1] * n_expert for il in layers}  # [n_expert] clock of the last use

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        lu = self.last_use[il]
        for e in experts:
            lu[e] = clock

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        return min(candidates, key=self.last_use[il].__getitem__)  # ties: lowest expert id among the oldest

    def victims(self, il: int, candidates: list[int], n: int, clock: int) -> list[int]:
        # the oldest first; a stable sort keeps ties in ascending id, as victim's min does (no hook changes ages)
        return sorted(candidates, key=self.last_use[il].__getitem__)[:n]
