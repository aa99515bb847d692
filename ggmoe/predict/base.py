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

A cross-token predictor (``predicts_next``: reuse, eam, expert-map, an mlp file of mode
token) also answers ``predict_next(il)`` right after ``observe(il, ...)``: the scores of
layer il's experts at the NEXT token. The planner between tokens
(``ggmoe.control.planner``) asks it that for every layer.

``predict`` may use everything observed so far (earlier tokens of the request and
the layers of this token seen up to now) and returns scores, higher = more likely,
or ``None`` when it cannot predict there (e.g. a hidden-state predictor before the
token's first layer). The caller ranks the scores: the top ``n_expert_used`` are
the predicted experts, the top ``m`` the prefetch set. Strides count MoE layers
(positions in ``ModelShape.layers``), so a leading dense layer is skipped.

Predictors register in ``PREDICTORS`` by name; every family has its own module
(``simple``, ``mlp``, ``eam``, ``expert_map``) and ``ggmoe.predict`` imports them
all, so that importing the package registers the built-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import Param, check_params
from ggmoe.base.registry import Registry
from ggmoe.trace.format import Trace, TraceMeta, trace_lacks


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


@dataclass(frozen=True)
class FoldedNet:
    """A net as the engine's in-graph predictor computes it: logits = w2 relu(w1 h + b1) + b2 on the raw MoE
    input h (linear: w2 h + b2). Row-major float32, the rows of each matrix are its outputs (ggml's ne1)."""

    w1: np.ndarray | None  # [H, n_embd]; None for a linear net
    b1: np.ndarray | None  # [H]
    w2: np.ndarray  # [T * n_expert, H] (linear: [T * n_expert, n_embd])
    b2: np.ndarray  # [T * n_expert]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n, n_embd] -> logits [n, T * n_expert] (what the graph computes; tests compare)."""
        x = hidden.astype(np.float32, copy=False)
        if self.w1 is not None:
            x = np.maximum(x @ self.w1.T + self.b1, 0.0)
        return x @ self.w2.T + self.b2



def check_trace_inputs(pred: Predictor, meta: TraceMeta) -> None:
    """TraceFormatError in one line when the predictor reads what the trace lacks (an imported trace)."""
    who = f"predictor {pred.name!r}"
    for what, need in (("hidden", pred.needs_hidden), ("probs", pred.needs_probs),
                       ("token_ids", pred.needs_tokens)):
        if need:
            trace_lacks(meta, what, who)


class Predictor:
    """Base class; the defaults make a predictor that knows nothing (all scores zero)."""

    name: ClassVar[str]
    needs_fit: ClassVar[bool] = False  # fit(train) must be called before use
    needs_hidden: ClassVar[bool] = False  # observe() must get hidden states
    needs_probs: ClassVar[bool] = False  # observe() must get router probabilities
    needs_truth: ClassVar[bool] = False  # offline only: reveal() gets the token's true ids
    needs_tokens: ClassVar[bool] = False  # begin_step() must get the real token ids (an imported trace may lack them)
    predicts_next: bool = False  # predict_next() scores the next token's experts (an instance may set it: mlp)
    # the keyword options of __init__ after (shape, stride), with types and bounds (ggmoe.base.params): --opt and
    # the library's options are checked against them before any predictor is built
    PARAMS: ClassVar[tuple[Param, ...]] = ()

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

    def predict_next(self, il: int) -> np.ndarray | None:
        """Scores [n_expert] float32 for layer ``il`` of the NEXT token, right after ``observe(il, ...)`` of this
        one (between tokens: what the planner protects and admits first), or None (``predicts_next`` False)."""
        return None

    def end_request(self) -> None:  # noqa: B027 - optional hook
        """The request finished (online learners may keep what they saw)."""

    # -- the engine's in-graph predictor (llama_ggmoe_set_predictor): a net the graph computes per layer
    def graph_net(self, il: int) -> FoldedNet | None:
        """The net the engine may compute in the graph at source layer ``il`` (its logits then reach
        ``observe_scores``), or None: this predictor computes in Python."""
        return None

    def observe_scores(self, il: int, scores: np.ndarray) -> None:  # noqa: B027 - optional hook
        """The graph's logits [n_out] float32 of ``graph_net(il)`` for the current token (after ``observe``)."""

    # -- what a data-driven predictor has learnt, saved with the routing statistics (--stats-out)
    def state(self) -> dict[str, np.ndarray]:
        """Arrays that restore what the predictor has learnt (empty: nothing to keep)."""
        return {}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore ``state()``; UsageError when the arrays do not fit this predictor."""
        if arrays:
            raise UsageError(f"predictor {self.name!r} keeps no state, yet the statistics file holds some")

    @property
    def has_state(self) -> bool:
        """Whether it already knows something (a fit, or a loaded state): needs_fit is then met."""
        return False


PREDICTORS: Registry[Predictor] = Registry("predictor")


def is_predictor_file(spec: str) -> bool:
    """Whether ``spec`` names a predictor file (the ``mlp``) rather than a registered predictor."""
    return bool(spec) and (spec.endswith(".npz") or Path(spec).is_file())


def predictor_class(spec: str) -> type[Predictor]:
    """The class ``spec`` (a registered name or a PRED.npz path) builds; UsageError for an unknown name."""
    if not isinstance(spec, str):
        raise UsageError(f"a predictor is a name or a PRED.npz file, not {spec!r}")
    return PREDICTORS.get("mlp") if is_predictor_file(spec) else PREDICTORS.get(spec)


def check_predictor(spec: str) -> None:
    """A predictor name or file checked before a model loads: a known name, or a file that exists."""
    if isinstance(spec, str) and spec.endswith(".npz") and not Path(spec).is_file():
        raise UsageError(f"predictor file not found (or not a regular file): {spec}")
    predictor_class(spec)


def make_predictor(spec: str, shape: ModelShape, stride: int = 1, **options: object) -> Predictor:
    """A predictor from a registered name or a path to an ``.npz`` predictor file (the ``mlp``).

    ``options`` are checked against the class's declared ``PARAMS`` (type and bounds) before it is built."""
    cls = predictor_class(spec)
    kwargs = check_params(f"predictor {spec!r}", cls.PARAMS, options)
    if is_predictor_file(spec):
        kwargs["path"] = spec
    return cls(shape, stride, **kwargs)  # type: ignore[call-arg]
