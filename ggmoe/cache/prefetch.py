"""Stride prefetching: at layer l, predict layer l+s's experts and copy the likely ones in ahead of time.

The prefetcher is a route observer: the engine hands it each MoE layer's event
after the cache has answered that layer, so the prediction runs after the
layer's slots are decided. For a decode token (one token per micro-batch) it
feeds the predictor what the layer saw, asks for the scores of the layer
``stride`` MoE layers ahead, and queues prefetch copies (the lowest copy
priority) of the top ``n_prefetch`` experts that are not resident; with
``threshold`` (fMoE's similarity threshold) only experts whose score reaches
it. It also hands the cache the predicted top-k, which the cache scores when
that layer runs (the predictor's accuracy at run time). Prefills reset the
predictor's per-request state and prefetch nothing: their micro-batches
select most experts anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ggmoe.cache.cache import ExpertCache
from ggmoe.errors import UsageError
from ggmoe.hook import HookRequest, RouteEvent
from ggmoe.predict.base import Predictor


@dataclass(frozen=True)
class PrefetchConfig:
    """Which predictor drives prefetching and how far ahead."""

    predictor: str  # a registered name (reuse, skip-gate, token, eam, expert-map) or a PRED.npz file
    stride: int = 2  # MoE layers ahead
    n_prefetch: int | None = None  # experts prefetched per target layer (default: 2 x n_expert_used)
    threshold: float | None = None  # prefetch only experts whose score reaches this (fMoE's delta)
    train: tuple[str, ...] = ()  # training traces for the predictors that learn from traces


class Prefetcher:
    """A route observer that prefetches layer il+stride's predicted experts into the cache."""

    def __init__(self, cache: ExpertCache, predictor: Predictor, layers: Sequence[int], n_prefetch: int,
                 threshold: float | None = None) -> None:
        if n_prefetch < 1:
            raise UsageError("--prefetch must be at least 1")
        self.cache = cache
        self.predictor = predictor
        self.layers = tuple(layers)
        self._next = {il: self.layers[j + predictor.stride] for j, il in enumerate(self.layers)
                      if j + predictor.stride < len(self.layers)}  # source il -> target il
        self.n_prefetch = n_prefetch
        self.threshold = threshold
        self.k = cache.n_expert_used
        self.request = HookRequest(probs=predictor.needs_probs, hidden=predictor.needs_hidden)
        self.error: BaseException | None = None
        self._decoding = False

    def begin_step(self, tokens: Sequence[int]) -> None:
        """The engine is about to decode ``tokens``: a prefill starts a request, one token starts a token."""
        if len(tokens) > 1:
            self.predictor.begin_request()
            self._decoding = False
        else:
            self.predictor.begin_token(int(tokens[0]))
            self._decoding = True
            for il in self.layers[: self.predictor.stride]:  # targets no earlier layer of this token predicts
                self._prefetch(il, self.predictor.predict(il))

    def on_route(self, event: RouteEvent) -> None:
        if not self._decoding or event.n_tokens != 1:
            return
        il = event.il
        probs = event.probs[0] if event.probs is not None else None
        hidden = event.hidden[0] if event.hidden is not None else None
        self.predictor.observe(il, event.ids[0], probs, hidden)
        target = self._next.get(il)
        if target is not None:
            self._prefetch(target, self.predictor.predict(target))

    def _prefetch(self, target: int, scores: np.ndarray | None, distance: int | None = None) -> None:
        if scores is None or target not in self.cache.tables:
            return
        order = np.argsort(-scores, kind="stable")
        self.cache.score_prediction(target, [int(e) for e in order[: self.k]])
        top = [int(e) for e in order[: self.n_prefetch]]
        if self.threshold is not None:
            top = [e for e in top if scores[e] >= self.threshold]
        # fMoE's priority p / (l - l_now): likelier experts of nearer layers are copied first
        d = distance or self.predictor.stride
        self.cache.prefetch(target, top, ranks=[-float(scores[e]) / d for e in top])


def make_prefetcher(cache: ExpertCache, config: PrefetchConfig, facts: object, model_path: str) -> Prefetcher:
    """The prefetcher for a loaded model: its predictor built (and fitted, if it learns) for the model."""
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.predict import ModelShape, make_predictor
    from ggmoe.trace import load_traces

    shape = ModelShape(model_fingerprint=model_fingerprint(model_path), layers=tuple(facts.moe_layers),
                       n_expert=facts.n_expert, n_expert_used=facts.n_expert_used, n_embd=facts.n_embd)
    options = {"model": model_path} if config.predictor == "skip-gate" else {}
    if config.predictor == "oracle":
        raise UsageError("the oracle predictor needs the routing in advance: it runs in the simulator only")
    pred = make_predictor(config.predictor, shape, config.stride, **options)
    if pred.needs_fit:
        if not config.train:
            raise UsageError(f"predictor {config.predictor!r} learns from traces: give --predictor-train TRACES")
        train = load_traces(list(config.train))
        if train.meta.model_fingerprint != shape.model_fingerprint:
            raise UsageError("--predictor-train traces come from another model")
        pred.fit(train)
    n = config.n_prefetch if config.n_prefetch is not None else min(2 * facts.n_expert_used, facts.n_expert)
    return Prefetcher(cache, pred, facts.moe_layers, n, config.threshold)
