"""The simple built-in predictors: oracle, reuse, token frequency and skip-gate (the router of a later layer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import Param
from ggmoe.predict.base import PREDICTORS, ModelShape, Predictor
from ggmoe.trace.format import Trace


@PREDICTORS.register("oracle")
class Oracle(Predictor):
    """The true experts (upper bound; offline only: the evaluation reveals each token's routing)."""

    needs_truth = True

    def __init__(self, shape: ModelShape, stride: int = 1) -> None:
        super().__init__(shape, stride)
        self._truth: np.ndarray | None = None  # [n_layer, n_expert_used] int

    def reveal(self, ids: np.ndarray) -> None:
        """ids [n_layer, n_expert_used]: what every MoE layer will select for the current token."""
        self._truth = ids

    def predict(self, il_target: int) -> np.ndarray | None:
        scores = np.zeros(self.shape.n_expert, dtype=np.float32)
        if self._truth is not None:
            k = self.shape.n_expert_used
            scores[self._truth[self._pos[il_target]]] = np.arange(k, 0, -1, dtype=np.float32)  # router order
        return scores


@PREDICTORS.register("reuse")
class Reuse(Predictor):
    """The experts the previous token used at the target layer.

    Scores decay by ``decay`` per token (0.5): the previous token's experts always
    outrank older ones (1 > 0.5 + 0.25 + ...), and older tokens fill a prefetch
    set larger than n_expert_used.
    """

    PARAMS = (Param("decay", float, low=0.0, high=1.0, high_open=True, help="score kept per token"),)

    def __init__(self, shape: ModelShape, stride: int = 1, decay: float = 0.5) -> None:
        super().__init__(shape, stride)
        if not 0.0 <= decay < 1.0:
            raise UsageError(f"reuse: decay {decay} must be in [0, 1)")
        self.decay = decay
        self._past = np.zeros((shape.n_layer, shape.n_expert), dtype=np.float32)  # decayed use of earlier tokens
        self._now = np.zeros_like(self._past)  # [n_layer, n_expert] 1 where the current token went
        self._started = False

    def begin_request(self) -> None:
        self._past[:] = 0
        self._now[:] = 0
        self._started = False

    def begin_token(self, token_id: int) -> None:
        if self._started:
            self._past *= self.decay
            self._past += self._now
            self._now[:] = 0
        self._started = True

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        self._now[self._pos[il], ids] = 1.0

    def predict(self, il_target: int) -> np.ndarray | None:
        return self._past[self._pos[il_target]].copy()

    predicts_next = True

    def predict_next(self, il: int) -> np.ndarray | None:
        """The next token at ``il``: this token's experts there first, then the earlier ones, decayed."""
        j = self._pos[il]
        return self._now[j] + self.decay * self._past[j]


@PREDICTORS.register("token")
class TokenFrequency(Predictor):
    """Per input token id and layer, how often each expert was selected in the training prompts.

    A token never seen in training gets the layer's overall frequencies. Memory:
    distinct training tokens x n_layer x n_expert float32.
    """

    needs_fit = True
    needs_tokens = True

    def __init__(self, shape: ModelShape, stride: int = 1) -> None:
        super().__init__(shape, stride)
        self._row: dict[int, int] = {}  # token id -> row of _freq
        self._freq = np.zeros((0, shape.n_layer, shape.n_expert), dtype=np.float32)  # [n_tokens_seen, L, E]
        self._prior = np.zeros((shape.n_layer, shape.n_expert), dtype=np.float32)  # [L, E] overall, sums to 1
        self._cur = -1  # row of the current token, -1 if unseen

    def fit(self, trace: Trace) -> None:
        uniq, inv = np.unique(trace.token_ids, return_inverse=True)
        counts = np.zeros((uniq.size, self.shape.n_layer, self.shape.n_expert), dtype=np.float32)
        t, j, _ = np.indices(trace.ids.shape)
        np.add.at(counts, (inv[t], j, trace.ids.astype(np.int64)), 1.0)
        total = counts.sum(axis=0)
        self._prior = total / np.maximum(total.sum(axis=1, keepdims=True), 1.0)
        # frequencies plus a tiny share of the prior, so that ties among unseen experts follow the prior
        n_seen = counts.sum(axis=2, keepdims=True)
        self._freq = counts / np.maximum(n_seen, 1.0) + 1e-3 * self._prior[None]
        self._row = {int(tok): i for i, tok in enumerate(uniq)}

    def begin_token(self, token_id: int) -> None:
        self._cur = self._row.get(int(token_id), -1)

    def predict(self, il_target: int) -> np.ndarray | None:
        j = self._pos[il_target]
        return (self._freq[self._cur, j] if self._cur >= 0 else self._prior[j]).copy()


@PREDICTORS.register("skip-gate")
class SkipGate(Predictor):
    """The router of the target layer applied to the latest observed MoE input (no training).

    Router weights come from the GGUF (``model``) or are passed in (``routers``, tests).
    """

    needs_hidden = True
    PARAMS = (Param("model", Path, help="the GGUF whose routers are used"),
              Param("routers", dict, internal=True, help="il -> Router (tests)"))

    def __init__(self, shape: ModelShape, stride: int = 1, model: str | Path | None = None,
                 routers: dict | None = None) -> None:
        super().__init__(shape, stride)
        if routers is None:
            routers = _routers_for(shape, model)
        missing = [il for il in shape.layers if il not in routers]
        if missing:
            raise UsageError(f"skip-gate: the model has no router for MoE layers {missing}")
        bad = [il for il in shape.layers if routers[il].weight.shape != (shape.n_expert, shape.n_embd)]
        if bad:
            raise UsageError(f"skip-gate: router shapes of layers {bad} do not match "
                             f"[n_expert={shape.n_expert}, n_embd={shape.n_embd}]")
        self.routers = routers  # il -> ggmoe.router.Router
        self._hidden: np.ndarray | None = None  # [n_embd] float32, latest observed MoE input

    def begin_token(self, token_id: int) -> None:
        self._hidden = None

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        self._hidden = hidden

    def predict(self, il_target: int) -> np.ndarray | None:
        if self._hidden is None:
            return None
        r = self.routers[il_target]
        scores = r.selection_scores(self._hidden[None])[0]  # what llama.cpp ranks by (its gating)
        return np.maximum(scores, np.float32(-1e30)).astype(np.float32, copy=False)  # masked groups: finite


def _routers_for(shape: ModelShape, model: str | Path | None) -> dict:
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.inspect.router import load_routers

    if model is None:
        raise UsageError("skip-gate needs the model's GGUF file for its router weights (--model)")
    if not Path(model).is_file():
        raise UsageError(f"model file not found: {model}")
    fp = model_fingerprint(model)
    if fp != shape.model_fingerprint:
        raise UsageError(f"{model} (fingerprint {fp}) is not the model the trace was recorded with "
                         f"({shape.model_fingerprint})")
    return load_routers(model)
