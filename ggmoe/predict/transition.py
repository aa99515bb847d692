"""The ``transition`` predictor: which experts layer l + s selects, given the experts this token selected at l.

Counted on training traces: for every MoE layer position j and expert pair (e, e'), how often a token that
selected e at position j selected e' at position j + s (s the stride). The scores for a target layer are the
rows of the current token's experts at the source layer, each row normalised to the probability
P(e' at j + s | e at j), summed; plus a small share of the target layer's overall frequencies, which also
stand alone where the source layer has not routed yet.

It reads expert ids only (no hidden states, router probabilities or token ids), so it runs on imported
public routing logs. On real routing adjacent layers' choices are strongly tied, more than a token's
choices are to the previous token's (docs/policies.md, "Real routing", has the counts). A learnt-routing
counterpart of ProMoE's and fMoE's cross-layer prediction, with a table instead of a network or a search.
"""

from __future__ import annotations

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import check_state_bytes
from ggmoe.predict.base import PREDICTORS, ModelShape, Predictor
from ggmoe.trace.format import Trace

PRIOR_SHARE = 1e-3  # weight of the target layer's frequencies beside the transition rows (breaks ties)


def _one_hot(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids [T, k] -> [T, n_expert] float32 with 1 at the selected experts."""
    out = np.zeros((ids.shape[0], n_expert), dtype=np.float32)
    np.put_along_axis(out, ids.astype(np.int64), 1.0, axis=1)
    return out


@PREDICTORS.register("transition")
class Transition(Predictor):
    """P(expert at MoE layer l + stride | the current token's experts at l), counted on training traces."""

    needs_fit = True

    def __init__(self, shape: ModelShape, stride: int = 1) -> None:
        super().__init__(shape, stride)
        n_l, n_e = shape.n_layer, shape.n_expert
        check_state_bytes("transition", 4 * n_l * n_e * (n_e + 1), "use fewer layers or experts")
        self._p = np.zeros((n_l, n_e, n_e), dtype=np.float32)  # [source position, e, e'] row-normalised
        self._prior = np.zeros((n_l, n_e), dtype=np.float32)  # [position, e] frequencies, rows sum to 1
        self._cur: list[np.ndarray | None] = [None] * n_l  # the current token's ids per position
        self._fitted = False

    def fit(self, trace: Trace) -> None:
        if trace.ids.shape[1] != self.shape.n_layer:
            raise UsageError(f"transition: the trace has {trace.ids.shape[1]} MoE layers, the model "
                             f"{self.shape.n_layer}")
        n_e, s = self.shape.n_expert, self.stride
        hot = [_one_hot(trace.ids[:, j], n_e) for j in range(self.shape.n_layer)]
        for j, h in enumerate(hot):
            total = h.sum(axis=0)
            self._prior[j] = total / max(float(total.sum()), 1.0)
            if j + s < len(hot):
                counts = h.T @ hot[j + s]  # [e, e'] tokens that chose e at j and e' at j + s
                self._p[j] = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        self._fitted = True

    def begin_token(self, token_id: int) -> None:
        self._cur = [None] * self.shape.n_layer

    def begin_request(self) -> None:
        self._cur = [None] * self.shape.n_layer

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        self._cur[self._pos[il]] = np.asarray(ids, dtype=np.int64).ravel()

    def predict(self, il_target: int) -> np.ndarray | None:
        j = self._pos[il_target]
        src = j - self.stride
        prior = self._prior[j]
        if src < 0 or self._cur[src] is None:
            return prior.copy()
        return self._p[src][self._cur[src]].sum(axis=0) + PRIOR_SHARE * prior

    def state(self) -> dict[str, np.ndarray]:
        return {"transition": self._p, "prior": self._prior} if self._fitted else {}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        if not arrays:
            return
        p, prior = arrays.get("transition"), arrays.get("prior")
        if p is None or prior is None or p.shape != self._p.shape or prior.shape != self._prior.shape:
            raise UsageError(f"transition: the saved arrays do not fit this model ({self.shape.n_layer} MoE "
                             f"layers, {self.shape.n_expert} experts)")
        self._p, self._prior = p.astype(np.float32), prior.astype(np.float32)
        self._fitted = True

    @property
    def has_state(self) -> bool:
        return self._fitted
