"""MoE-Infinity's activation-aware eviction: the lowest ``(p + eps) * (1 - j / L)`` goes.

MoE-Infinity (Xue et al., arXiv 2401.14361) keeps the experts the
current request is likely to use: ``p`` is the expert's activation ratio in the request's matched Expert
Activation Matrix (EAM: the request's counts so far matched against a collection of past requests' EAMs,
``ggmoe.predict.eam``), ``eps`` keeps never-seen experts comparable, and ``1 - j / L`` (``j`` the layer's
position among the ``L`` MoE layers) favours early layers, which the next token needs first.

Two sources of ``p``:

- with ``predictor`` (a fitted ``ggmoe.predict.eam.EAM``: its collection and cosine matching, reused), each
  call's experts are observed into it and ``p`` is its matched, aggregated activation ratio for the layer;
- without one, a policy sees only accesses, so ``p`` is the request's own running EAM: the layer's use counts
  since the cache started (there are no request boundaries at this level), row-normalised
  (``row_normalise``). That ranks exactly as ``lfu`` does; the matched EAM is what makes ``eam`` differ.

The cache keeps a slot table per layer, so a victim is always chosen among one layer's experts and the
layer factor is common to every candidate: it is computed (``priority``) but cannot change the choice.
Counts are per call (an expert used by several tokens of a micro-batch counts once). Ties: least recently
used, then lowest id.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ggmoe.base.params import Param
from ggmoe.cache.policies.base import POLICIES, Policy
from ggmoe.cache.policies.usage import LayerUsage


class EAMMatcher(Protocol):
    """What the policy uses of a fitted ``ggmoe.predict.eam.EAM`` (the predictor lives above the cache)."""

    def begin_request(self) -> None: ...

    def observe(self, il: int, experts: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None: ...

    def predict(self, il: int) -> np.ndarray | None: ...


def row_normalise(counts: np.ndarray) -> np.ndarray:
    """counts [..., n_layer, n_expert] -> each layer's row divided by its sum (zero rows stay zero)."""
    s = counts.sum(axis=-1, keepdims=True)
    return np.divide(counts, s, out=np.zeros_like(counts, dtype=np.float32), where=s > 0)


EPS = 1e-3  # added to p so that experts the EAM never saw still rank by layer (MoE-Infinity's epsilon)


@POLICIES.register("eam")
class EAMPolicy(Policy):
    """MoE-Infinity: evict the lowest (p + eps) * (1 - j/L), p from the request's (matched) expert activation matrix."""

    PARAMS = (Param("predictor", object, internal=True, help="a fitted ggmoe.predict.eam.EAM"),
              Param("eps", float, low=0.0, high=1.0, help="added to p so that unseen experts still rank"))

    def __init__(self, n_expert: int, layers: list[int], predictor: EAMMatcher | None = None, eps: float = EPS) -> None:
        super().__init__(n_expert, layers)
        self.eps = eps
        self.pos = {il: j for j, il in enumerate(sorted(layers))}
        self.usage = LayerUsage(n_expert, layers)
        self.predictor = predictor
        if predictor is not None:
            predictor.begin_request()

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        self.usage.record(il, experts)
        if self.predictor is not None:
            self.predictor.observe(il, np.asarray(experts, dtype=np.intp), None, None)

    def activation(self, il: int) -> np.ndarray:
        """p [n_expert]: the layer's row of the matched EAM, or of the running one (see the module docstring)."""
        if self.predictor is not None:
            row = self.predictor.predict(il)  # matched ratios times a layer-proximity factor, the same for all
            return row / row.sum() if row is not None and row.sum() > 0 else np.zeros(self.n_expert, np.float32)
        return row_normalise(np.asarray(self.usage.count[il], dtype=np.float32))

    def priority(self, il: int, p: np.ndarray) -> np.ndarray:
        """(p + eps) * (1 - j / L) for every expert of layer ``il``."""
        return (p + self.eps) * (1.0 - self.pos[il] / len(self.pos))

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        prio = self.priority(il, self.activation(il))
        last = self.usage.last[il]
        return min(candidates, key=lambda e: (float(prio[e]), last[e], e))
