"""Belady's optimal eviction: the candidate whose next use is furthest away (never again: infinitely far).

Offline only: it needs the future, which the simulator replaying a trace passes through ``set_future``
before each call (``ggmoe.simulate.replay``). Live, nothing does, and the first eviction raises a
``UsageError`` (the construction cannot tell, the policy is built before anyone could call ``set_future``);
``needs_future = True`` lets an engine refuse it before loading a model. With demand copies only (no
prefetching), no policy has more hits on the same calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ggmoe.base.errors import UsageError
from ggmoe.cache.policies.base import POLICIES, Policy


@POLICIES.register("belady")
class Belady(Policy):
    """Optimal offline (simulator only): evict the expert used again furthest in the future."""

    needs_future = True

    def __init__(self, n_expert: int, layers: list[int]) -> None:
        super().__init__(n_expert, layers)
        self.next_use = {il: [math.inf] * n_expert for il in layers}  # il -> [n_expert] access number or inf
        self.told = dict.fromkeys(layers, False)  # whether set_future was ever called for the layer

    def set_future(self, il: int, next_use: Mapping[int, float] | None) -> None:
        """Update the next use of the experts named (the others keep theirs: no use in between)."""
        if next_use is None:
            return
        nu = self.next_use[il]
        for e, t in next_use.items():
            nu[e] = t
        self.told[il] = True

    def _check_told(self, il: int) -> None:
        if not self.told[il]:
            raise UsageError("the belady policy needs the future (next-use times through set_future): it runs "
                             "only in the simulator, replaying a trace; live, choose another policy")

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        self._check_told(il)
        # the first of the furthest: candidates are ascending, so ties go to the lowest expert id
        return max(candidates, key=self.next_use[il].__getitem__)

    def victims(self, il: int, candidates: list[int], n: int, clock: int) -> list[int]:
        # the furthest first; reverse=True keeps ties in ascending id (the sort stays stable), as victim's max
        self._check_told(il)
        return sorted(candidates, key=self.next_use[il].__getitem__, reverse=True)[:n]
