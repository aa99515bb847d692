"""fMoE's eviction: the lowest ``p * freq`` goes.

fMoE (Yu et al., "fMoE: Fine-Grained Expert Offloading for Large Mixture-of-Experts Serving",
arXiv 2502.05370) evicts the
cached expert with the lowest product of ``p``, its probability in the current iteration-level expert map
(the gate probabilities of the semantically or trajectory-matched past iteration), and ``freq``, how often it
was used. A policy sees only which experts each call used, neither router probabilities nor expert maps, so
here (the approximation):

- ``p``: the share of the layer's latest ``window`` calls (default 8) that used the expert: recent routing
  standing in for the expert map's probability (0 for an expert none of them used);
- ``freq``: the expert's use count in the layer since the cache started (calls that used it).

Ties (e.g. every candidate outside the window, p = 0): least recently used, then lowest id.
"""

from __future__ import annotations

from collections import deque

from ggmoe.base.errors import UsageError
from ggmoe.base.params import MAX_WINDOW, Param
from ggmoe.cache.policies.base import POLICIES, Policy
from ggmoe.cache.policies.usage import LayerUsage

WINDOW = 8  # calls of a layer that make up "recent routing"


@POLICIES.register("fmoe")
class FMoE(Policy):
    """fMoE: evict the lowest p * freq (p: share of the layer's recent calls using it, freq: use count)."""

    PARAMS = (Param("window", int, low=1, high=MAX_WINDOW, help="calls of a layer that make up recent routing"),)

    def __init__(self, n_expert: int, layers: list[int], window: int = WINDOW) -> None:
        super().__init__(n_expert, layers)
        if window < 1:
            raise UsageError(f"fmoe: window {window} must be at least 1")
        self.window = window
        self.usage = LayerUsage(n_expert, layers)
        self.recent = {il: deque(maxlen=window) for il in layers}  # il -> experts of the latest calls
        self.in_window = {il: [0] * n_expert for il in layers}  # il -> [n_expert] recent calls using it

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        self.usage.record(il, experts)
        recent, hot = self.recent[il], self.in_window[il]
        if len(recent) == self.window:
            for e in recent[0]:
                hot[e] -= 1
        recent.append(tuple(experts))
        for e in experts:
            hot[e] += 1

    def priority(self, il: int, expert: int) -> float:
        return self.in_window[il][expert] / self.window * self.usage.count[il][expert]

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        last = self.usage.last[il]
        return min(candidates, key=lambda e: (self.priority(il, e), last[e], e))
