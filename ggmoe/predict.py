"""Expert predictors: which experts will MoE layer ``il + s`` select for the current token?

One small interface serves the offline evaluation on traces (``ggmoe.predict_eval``)
and the live engine. Per request and token the caller drives a predictor like this::

    p = PREDICTORS.get("reuse")(shape, stride=1)
    p.fit(train_trace)                      # data-driven predictors only (needs_fit)
    p.begin_request()
    for each token:
        p.begin_token(token_id)
        p.predict(il) for il among the first ``stride`` MoE layers   # token start: no layer seen yet
        for each MoE layer il, ascending:
            p.observe(il, ids, probs, hidden)    # ids [n_expert_used], probs [n_expert], hidden [n_embd]
            p.predict(il_target)                 # scores [n_expert] float32 for the layer ``stride`` ahead
    p.end_request()

``predict`` may use everything observed so far (earlier tokens of the request and
the layers of this token seen up to now) and returns scores, higher = more likely,
or ``None`` when it cannot predict there (e.g. a hidden-state predictor before the
token's first layer). The caller ranks the scores: the top ``n_expert_used`` are
the predicted experts, the top ``m`` the prefetch set. Strides count MoE layers
(positions in ``ModelShape.layers``), so a leading dense layer is skipped.

Predictors register in ``PREDICTORS`` by name. The simple built-ins live here;
the bigger ones have their own modules (``predict_mlp``, ``predict_eam``,
``predict_expert_map``), imported at the end so that they register too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from .errors import UsageError
from .registry import Registry
from .trace import Trace, TraceMeta


@dataclass(frozen=True)
class ModelShape:
    """The facts of a model a predictor is built for."""

    model_fingerprint: str  # ggmoe.fingerprint of the GGUF
    layers: tuple[int, ...]  # il of each MoE layer, ascending
    n_expert: int
    n_expert_used: int
    n_embd: int

    @classmethod
    def from_trace(cls, meta: TraceMeta, layers: np.ndarray) -> ModelShape:
        return cls(model_fingerprint=meta.model_fingerprint, layers=tuple(int(il) for il in layers),
                   n_expert=meta.n_expert, n_expert_used=meta.n_expert_used, n_embd=meta.n_embd)

    @property
    def n_layer(self) -> int:
        """Number of MoE layers."""
        return len(self.layers)

    def pos(self, il: int) -> int:
        """Position of MoE layer ``il`` in ``layers`` (what strides count)."""
        try:
            return self.layers.index(il)
        except ValueError:
            raise UsageError(f"layer {il} is not a MoE layer of this model ({list(self.layers)})") from None


class Predictor:
    """Base class; the defaults make a predictor that knows nothing (all scores zero)."""

    name: ClassVar[str]
    needs_fit: ClassVar[bool] = False  # fit(train) must be called before use
    needs_hidden: ClassVar[bool] = False  # observe() must get hidden states
    needs_probs: ClassVar[bool] = False  # observe() must get router probabilities
    needs_truth: ClassVar[bool] = False  # offline only: reveal() gets the token's true ids

    def __init__(self, shape: ModelShape, stride: int = 1) -> None:
        if not 1 <= stride < shape.n_layer:
            raise UsageError(f"stride {stride} needs at least {stride + 1} MoE layers; "
                             f"the model has {shape.n_layer}")
        self.shape = shape
        self.stride = stride  # MoE layers ahead the caller will ask for
        self._pos = {il: j for j, il in enumerate(shape.layers)}  # il -> position

    def fit(self, trace: Trace) -> None:  # noqa: B027 - optional hook
        """Learn from the training prompts of ``trace`` (same model)."""

    def begin_request(self) -> None:  # noqa: B027 - optional hook
        """A new request (prompt) starts: forget per-request state."""

    def begin_token(self, token_id: int) -> None:  # noqa: B027 - optional hook
        """A new token enters layer 0; the previous token (if any) has passed every layer."""

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        """Layer ``il`` routed the current token: ids [n_expert_used] int, probs [n_expert] float32,
        hidden [n_embd] float32 (the MoE input); probs/hidden may be None unless needs_* says so."""

    def predict(self, il_target: int) -> np.ndarray | None:
        """Scores [n_expert] float32 for layer ``il_target`` of the current token, or None."""
        return np.zeros(self.shape.n_expert, dtype=np.float32)

    def end_request(self) -> None:  # noqa: B027 - optional hook
        """The request finished (online learners may keep what they saw)."""


PREDICTORS: Registry[Predictor] = Registry("predictor")


def make_predictor(spec: str, shape: ModelShape, stride: int = 1, **options: object) -> Predictor:
    """A predictor from a registered name or a path to an ``.npz`` predictor file (the ``mlp``)."""
    if spec.endswith(".npz") or Path(spec).is_file():
        return PREDICTORS.get("mlp")(shape, stride, path=spec, **options)  # type: ignore[call-arg]
    return PREDICTORS.get(spec)(shape, stride, **options)  # type: ignore[call-arg]


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


@PREDICTORS.register("token")
class TokenFrequency(Predictor):
    """Per input token id and layer, how often each expert was selected in the training prompts.

    A token never seen in training gets the layer's overall frequencies. Memory:
    distinct training tokens x n_layer x n_expert float32.
    """

    needs_fit = True

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
        scores = r.probs(self._hidden[None])[0]
        if r.selection_bias is not None:
            scores = scores + r.selection_bias  # what llama.cpp ranks by
        return scores.astype(np.float32, copy=False)


def _routers_for(shape: ModelShape, model: str | Path | None) -> dict:
    from .fingerprint import model_fingerprint
    from .router import load_routers

    if model is None:
        raise UsageError("skip-gate needs the model's GGUF file for its router weights (--model)")
    if not Path(model).is_file():
        raise UsageError(f"model file not found: {model}")
    fp = model_fingerprint(model)
    if fp != shape.model_fingerprint:
        raise UsageError(f"{model} (fingerprint {fp}) is not the model the trace was recorded with "
                         f"({shape.model_fingerprint})")
    return load_routers(model)


# The bigger built-ins register themselves on import.
from . import predict_eam, predict_expert_map, predict_mlp  # noqa: E402, F401
