"""Static pinning: the experts a workload uses most, per layer, from trace counts, stay resident.

Per-layer expert counts (``counts``: il -> [n_expert]) come from traces recorded earlier
(``ggmoe.trace.data.load_counts``: every routed token of one trace file or several) or from routing statistics
(``--stats-in``), so the same policy runs live and in replay. The victim is the candidate with the lowest
count (ties: least recently used, then lowest id): whatever the number of slots S, once the S hottest experts
of a layer are in, none of them leaves while a colder candidate is resident. With ``n_pinned``, only the top
``n_pinned`` experts per layer (by count, ties lowest id) are pinned and the rest of the slots are an LRU: an
unpinned candidate is evicted least recently used first, a pinned one only when every candidate is pinned (the
coldest of them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import Param
from ggmoe.cache.policies.base import POLICIES, Policy
from ggmoe.cache.policies.usage import LayerUsage


@POLICIES.register("static")
class Static(Policy):
    """Pinned hottest experts per layer from expert counts: evict the coldest."""

    PARAMS = (Param("counts", Mapping, internal=True, help="il -> [n_expert] counts"),
              Param("n_pinned", int, low=0, high=1 << 16, help="experts pinned per layer (the rest: LRU)"))

    def __init__(self, n_expert: int, layers: list[int], counts: Mapping[int, Sequence[float]] | None = None,
                 n_pinned: int | None = None) -> None:
        super().__init__(n_expert, layers)
        if counts is None:
            raise UsageError("static: give per-layer expert counts, as counts= (il -> [n_expert])")
        given = dict(counts)
        missing = [il for il in layers if il not in given]
        if missing:
            raise UsageError(f"static: no counts for MoE layers {missing}")
        self.counts = {il: np.asarray(given[il], dtype=np.float64) for il in layers}
        for il, c in self.counts.items():
            if c.shape != (n_expert,):
                raise UsageError(f"static: layer {il} has {c.shape} counts, expected ({n_expert},)")
        if n_pinned is not None and not 0 <= n_pinned <= n_expert:
            raise UsageError(f"static: n_pinned {n_pinned} must be in [0, {n_expert}]")
        self.pinned = {il: self._top(c, n_pinned) for il, c in self.counts.items()}
        self.usage = LayerUsage(n_expert, layers)

    @staticmethod
    def _top(counts: np.ndarray, n: int | None) -> set[int]:
        """The ``n`` hottest experts (ties: lowest id); every expert when ``n`` is None."""
        order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        return set(order if n is None else order[:n])

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        self.usage.record(il, experts)

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        pinned, count, last = self.pinned[il], self.counts[il], self.usage.last[il]
        free = [e for e in candidates if e not in pinned]
        if free:
            return min(free, key=lambda e: (last[e], e))
        return min(candidates, key=lambda e: (count[e], last[e], e))
