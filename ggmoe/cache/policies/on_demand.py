"""The on-demand policy: keep nothing across layer calls (the no-cache baseline)."""

from __future__ import annotations

from ggmoe.cache.policies.base import POLICIES, Policy


@POLICIES.register("on-demand")
class OnDemand(Policy):
    """Load every expert a layer call needs, keep nothing: the baseline without a cache."""

    def release(self, il: int, resident: list[int]) -> list[int]:
        return list(resident)

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        return candidates[0]
