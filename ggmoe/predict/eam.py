"""The ``eam`` predictor (MoE-Infinity): expert activation matrices matched against a collection.

An Expert Activation Matrix (EAM) counts, per MoE layer and expert, how often the
expert was selected: ``[n_layer, n_expert]``. The iteration-level EAM covers the
current token, the request-level EAM every token of the request so far (the
current one included). The collection keeps the request-level EAMs of past
requests (the training prompts, then, with ``online``, every finished request);
when it is full, a new EAM replaces the most similar one, so that it stays diverse.

To predict, the current request-level EAM is matched against the collection by
cosine similarity of the row-normalised matrices (each layer's row divided by its
sum: activation ratios, so long and short requests compare), the ``n_match`` best
are averaged weighted by their similarity, and the target layer's row of the
aggregate is scaled by the layer-proximity weight ``1 - (i - l) / L`` (i target,
l current layer position, L MoE layers): nearer layers get higher prefetch priority.

Matching is incremental: per collection entry c and layer l the dot product
``D[c, l] = <request EAM row l, unit EAM c row l>`` is updated with the k experts a
layer selected (O(capacity * k) per layer), and the cosine follows from D and the
row sums in O(capacity * L).
"""

from __future__ import annotations

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import MAX_COLLECTION, Param, check_state_bytes
from ggmoe.cache.policies.eam import row_normalise
from ggmoe.predict.base import PREDICTORS, ModelShape, Predictor
from ggmoe.trace.format import Trace


class EAMCollection:
    """A fixed-capacity set of request-level EAMs, stored row-normalised."""

    def __init__(self, capacity: int, n_layer: int, n_expert: int) -> None:
        if capacity < 1:
            raise UsageError(f"eam: capacity {capacity} must be at least 1")
        check_state_bytes("eam", 3 * 4 * capacity * n_layer * n_expert, "lower its capacity")
        self.capacity = capacity
        self.ratio = np.zeros((capacity, n_layer, n_expert), dtype=np.float32)  # row-normalised EAMs
        self.unit = np.zeros_like(self.ratio)  # [C, L, E] ratio / ||ratio|| (flattened norm)
        self.unit_le = np.zeros((n_layer, n_expert, capacity), dtype=np.float32)  # [L, E, C] unit, for observe
        self.origin = np.full(capacity, -1, dtype=np.int64)  # sequence number of the add that wrote the entry
        self.n = 0  # entries in use
        self._adds = 0

    def add(self, counts: np.ndarray) -> int:
        """Keep a request-level EAM [n_layer, n_expert]; returns its slot (-1 if it was empty)."""
        ratio = row_normalise(counts.astype(np.float32))
        norm = float(np.linalg.norm(ratio))
        if norm == 0.0:
            return -1
        unit = ratio / norm
        if self.n < self.capacity:
            slot = self.n
            self.n += 1
        else:  # replace the most similar entry: the collection keeps its variety
            sims = self.unit.reshape(self.capacity, -1) @ unit.ravel()
            slot = int(np.argmax(sims))
        self.ratio[slot], self.unit[slot], self.unit_le[:, :, slot] = ratio, unit, unit
        self.origin[slot] = self._adds
        self._adds += 1
        return slot

    def arrays(self) -> dict[str, np.ndarray]:
        """The entries in use: ``ratio`` [n, L, E] float32 and ``origin`` [n] int64."""
        return {"ratio": self.ratio[: self.n].copy(), "origin": self.origin[: self.n].copy()}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Entries saved by ``arrays()`` (at most ``capacity``; the derived unit vectors recomputed)."""
        ratio, origin = arrays.get("ratio"), arrays.get("origin")
        shape = self.ratio.shape[1:]
        if (ratio is None or origin is None or ratio.ndim != 3 or ratio.shape[1:] != shape
                or origin.shape != ratio.shape[:1] or ratio.dtype != np.float32 or origin.dtype != np.int64
                or not np.all(np.isfinite(ratio)) or (ratio < 0).any()):
            raise UsageError(f"eam: the saved collection is not [n, {shape[0]}, {shape[1]}] float32 ratios "
                             "with n origins")
        n = min(ratio.shape[0], self.capacity)
        norms = np.linalg.norm(ratio[:n].reshape(n, -1), axis=1)
        if (norms == 0).any():
            raise UsageError("eam: the saved collection holds an empty entry")
        unit = ratio[:n] / norms[:, None, None]
        self.ratio[:n], self.unit[:n], self.origin[:n] = ratio[:n], unit, origin[:n]
        self.unit_le[:, :, :n] = unit.transpose(1, 2, 0)
        self.n = n
        self._adds = int(origin[:n].max()) + 1 if n else 0


@PREDICTORS.register("eam")
class EAM(Predictor):
    """MoE-Infinity's activation-aware prediction (see the module docstring)."""

    needs_fit = True
    PARAMS = (Param("capacity", int, low=1, high=MAX_COLLECTION, help="request EAMs kept"),
              Param("n_match", int, low=1, high=MAX_COLLECTION, help="stored EAMs averaged per prediction"),
              Param("online", bool, help="add each finished request to the collection"))

    def __init__(self, shape: ModelShape, stride: int = 1, capacity: int = 256, n_match: int = 3,
                 online: bool = True) -> None:
        super().__init__(shape, stride)
        if n_match < 1:
            raise UsageError(f"eam: n_match {n_match} must be at least 1")
        self.collection = EAMCollection(capacity, shape.n_layer, shape.n_expert)
        self.n_match = n_match  # collection entries averaged per prediction
        self.online = online  # add each finished request to the collection
        n_l, n_e = shape.n_layer, shape.n_expert
        self.iteration_eam = np.zeros((n_l, n_e), dtype=np.float32)  # [L, E] counts of the current token
        self.request_eam = np.zeros((n_l, n_e), dtype=np.float32)  # [L, E] counts of the request, incl. current
        self._dots = np.zeros((capacity, n_l), dtype=np.float32)  # D[c, l], see the module docstring
        self._rowsq = np.zeros(n_l, dtype=np.float64)  # sum over e of request_eam[l, e]^2
        self._rowsum = np.zeros(n_l, dtype=np.float64)  # sum over e of request_eam[l, e]
        self._now = -1  # position of the latest observed layer of the current token
        self._match: tuple[np.ndarray, np.ndarray] | None = None  # (entries [n], weights [n]) cached
        self.last_match: tuple[np.ndarray, np.ndarray] | None = None  # for inspection: (entries, cosines)

    def fit(self, trace: Trace) -> None:
        n_l, n_e = self.shape.n_layer, self.shape.n_expert
        for p in range(trace.n_prompts):
            ids = trace.ids[trace.prompt_slice(p)].astype(np.int64)  # [T_p, L, k]
            counts = np.zeros((n_l, n_e), dtype=np.float32)
            np.add.at(counts, (np.broadcast_to(np.arange(n_l)[None, :, None], ids.shape), ids), 1.0)
            self.collection.add(counts)

    def begin_request(self) -> None:
        self.iteration_eam[:] = 0
        self.request_eam[:] = 0
        self._dots[:] = 0
        self._rowsq[:] = 0
        self._rowsum[:] = 0
        self._now = -1
        self._match = None

    def begin_token(self, token_id: int) -> None:
        self.iteration_eam[:] = 0
        self._now = -1

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        j = self._pos[il]
        ids = np.asarray(ids, dtype=np.intp)  # distinct, as a top-k is
        c = self.collection
        self._dots[:c.n, j] += c.unit_le[j, ids, :c.n].sum(axis=0)
        self._rowsq[j] += float((2.0 * self.request_eam[j, ids] + 1.0).sum())  # (q+1)^2 - q^2 per expert
        self._rowsum[j] += ids.shape[0]
        self.request_eam[j, ids] += 1.0
        self.iteration_eam[j, ids] += 1.0
        self._now = j
        self._match = None

    def end_request(self) -> None:
        if self.online and self.request_eam.any():
            self.collection.add(self.request_eam)

    def state(self) -> dict[str, np.ndarray]:
        return self.collection.arrays()

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.collection.restore(arrays)

    @property
    def has_state(self) -> bool:
        return self.collection.n > 0

    def _matched(self) -> tuple[np.ndarray, np.ndarray]:
        """Collection entries [n] and their aggregation weights [n] (summing to 1)."""
        c = self.collection
        rowsum = self._rowsum  # [L]
        if c.n == 0:
            raise UsageError("eam: the EAM collection is empty: fit() it on training traces first")
        if not rowsum.any():  # nothing seen yet in this request: every entry counts alike
            entries = np.arange(c.n)
            return entries, np.full(c.n, 1.0 / c.n)
        w = np.divide(1.0, rowsum, out=np.zeros_like(rowsum), where=rowsum > 0)
        qnorm = np.sqrt(float(np.sum(self._rowsq * w * w)))
        cos = (self._dots[:c.n].astype(np.float64) @ w) / qnorm  # [n] cosine of the row-normalised EAMs
        n = min(self.n_match, c.n)
        entries = np.argpartition(-cos, n - 1)[:n] if n < c.n else np.arange(c.n)
        entries = entries[np.argsort(-cos[entries], kind="stable")]
        self.last_match = (entries, cos[entries])
        weight = np.clip(cos[entries], 0.0, None)
        weight = weight / weight.sum() if weight.sum() > 0 else np.full(n, 1.0 / n)
        return entries, weight

    def predict(self, il_target: int) -> np.ndarray | None:
        if self._match is None:
            self._match = self._matched()
        entries, weight = self._match
        i = self._pos[il_target]
        row = weight.astype(np.float32) @ self.collection.ratio[entries, i]  # [E] aggregated activation ratios
        proximity = max(0.0, 1.0 - (i - self._now) / self.shape.n_layer)
        return row * np.float32(proximity)

    predicts_next = True

    def predict_next(self, il: int) -> np.ndarray | None:
        """The next token at ``il``: the matched request-level EAMs' row of that layer (MoE-Infinity's
        request-level prediction; no layer-proximity factor, since every layer is a token away)."""
        if self._match is None:
            self._match = self._matched()
        entries, weight = self._match
        return weight.astype(np.float32) @ self.collection.ratio[entries, self._pos[il]]
