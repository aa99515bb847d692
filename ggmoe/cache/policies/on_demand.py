"""The on-demand policy: no reuse across layer calls (the no-cache baseline)."""

from __future__ import annotations

from ggmoe.cache.policies.base import POLICIES, Policy


@POLICIES.register("on-demand")
class OnDemand(Policy):
    """Load every expert a layer call needs, keep nothing: the baseline without a cache."""

    reuse = False

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        return candidates[0]
