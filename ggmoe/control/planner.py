"""The planner between tokens: a cross-token predictor's view of the next token, handed to the cache.

Once a decode token's MoE layer il has routed, the planner feeds its predictor what the layer saw (ids, and
the MoE input rows where the predictor reads them) and asks ``predict_next(il)``: layer il's scores at the
NEXT token. The top ``n_protect`` become the cache's plan for that layer (``ExpertCache.plan_next``):

- async decode: the controller calls ``observe`` for each layer right before the cache's step between tokens
  (``ExpertCache.after_token``), the input rows read from the mailbox, so the layer's misses are admitted in
  the plan's order, and no planned expert is evicted, neither to admit a miss nor to keep slots free for
  the stride prefetcher;
- both decodes, at a token's start (``Prefetcher.begin_step``, between tokens): the stride prefetcher's
  targets that no layer of the token predicts (the first ``stride`` MoE layers) take the plan where its own
  predictor has nothing to say there (one that reads the MoE input: mlp, skip-gate), and those prefetches
  evict no planned expert. Within a token the stride predictor's fresher guess decides alone (on the
  embedded model, protecting the plan from it cost hit rate).
- sync decode: the planner is a route observer (after the cache answered the layer). Misses there are demand
  copies inside the layer, so the plan acts only through the prefetches at a token's start.

When the next token routes the layer, the plan's top n_expert_used is scored against what it selected
(``plan_correct`` / ``plan_total`` per layer). Prefills start a request and plan nothing: the plans made then
would be for a micro-batch of many tokens. Predictors: ``reuse``, ``eam``, ``expert-map`` (sync only: it reads
router probabilities), or a PRED.npz trained with ``ggmoe train-predictor --mode token``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import HookRequest, RouteEvent
from ggmoe.cache.cache import ExpertCache
from ggmoe.predict.base import Predictor

if TYPE_CHECKING:
    from ggmoe.inspect.facts import ModelFacts


@dataclass(frozen=True)
class PlannerConfig:
    """Which cross-token predictor plans the next token, and how many experts per layer it protects."""

    predictor: str  # reuse, eam, expert-map, or a PRED.npz trained with --mode token
    n_protect: int | None = None  # experts planned per layer (default: default_protect, 2 x n_expert_used)
    train: tuple[str, ...] = ()  # training traces for a predictor that learns (eam, expert-map)
    state: Mapping[str, np.ndarray] | None = None  # what it learnt in an earlier run, or None


class NextTokenPlanner:
    """Plans each cached layer's next call from a cross-token predictor (see the module's doc)."""

    def __init__(self, cache: ExpertCache, predictor: Predictor, layers: Sequence[int], n_protect: int) -> None:
        if not predictor.predicts_next:
            raise UsageError(f"predictor {predictor.name!r} does not predict the next token's experts: the planner "
                             "takes reuse, eam, expert-map or a PRED.npz trained with --mode token")
        if not 1 <= n_protect <= cache.n_expert:
            raise UsageError(f"the planner protects 1 to n_expert = {cache.n_expert} experts per layer, "
                             f"not {n_protect}")
        self.cache = cache
        self.predictor = predictor
        self.layers = tuple(layers)
        self.n_protect = n_protect
        self.k = cache.n_expert_used
        self.request = HookRequest(probs=predictor.needs_probs, hidden=predictor.needs_hidden)
        # the async decode: the controller feeds it between tokens (the route op's events, if any, are ignored)
        self.via_controller = False
        self._decoding = False
        self._in_request = False
        self._expected: dict[int, list[int]] = {}  # il -> the plan's top n_expert_used, scored at the next call

    @property
    def decoding(self) -> bool:
        """Whether the step under way decodes one token (the only steps it plans from)."""
        return self._decoding

    def begin_step(self, tokens: Sequence[int]) -> None:
        """Before each decode: a prefill starts a request (no plan stands), one token starts a token."""
        self._decoding = len(tokens) == 1
        if self._decoding:
            self.predictor.begin_token(int(tokens[0]))
            return
        if self._in_request:  # an online learner keeps what the previous request showed it
            self.predictor.end_request()
        self.predictor.begin_request()
        self._in_request = True
        self._expected.clear()
        for il in self.cache.tables:
            self.cache.plan_next(il, [])

    def on_route(self, event: RouteEvent) -> None:
        """The sync decode: layer ``event.il`` of the token has been answered by the cache."""
        if self.via_controller or not self._decoding or event.n_tokens != 1:
            return
        probs = event.probs[0] if event.probs is not None else None
        hidden = event.hidden[0] if event.hidden is not None else None
        self.observe(event.il, event.ids[0], probs, hidden)

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        """Layer ``il`` of a decode token has routed ``ids`` [n_expert_used]: score the plan made for this call,
        then plan the layer's next one (a no-op outside decode tokens)."""
        if not self._decoding:
            return
        got = np.asarray(ids).tolist()
        expected = self._expected.pop(il, None)
        if expected and il in self.cache.tables:
            st = self.cache.stats.layers[il]
            st.plan_total += len(expected)
            st.plan_correct += len(set(expected) & set(got))
        self.predictor.observe(il, np.asarray(ids), probs, hidden)
        scores = self.predictor.predict_next(il)
        if il not in self.cache.tables:
            return
        ranked = [] if scores is None else np.argsort(-scores, kind="stable")[: max(self.k, self.n_protect)].tolist()
        self._expected[il] = ranked[: self.k]
        self.cache.plan_next(il, ranked[: self.n_protect])

    def final_state(self) -> dict[str, np.ndarray]:
        """End the open request and return what the predictor has learnt (``state()``)."""
        if self._in_request:
            self.predictor.end_request()
            self._in_request = False
        return self.predictor.state()


def check_planner(spec: str) -> None:
    """A planner's predictor checked before anything loads: a known name that predicts the next token, or a
    predictor file that exists (its mode is checked when it is read); UsageError in one line otherwise."""
    from ggmoe.predict.base import check_predictor, is_predictor_file, predictor_class

    check_predictor(spec)
    if not is_predictor_file(spec) and not predictor_class(spec).predicts_next:
        raise UsageError(f"planner {spec!r} does not predict the next token's experts; choose reuse, eam, "
                         "expert-map or a PRED.npz trained with `ggmoe train-predictor --mode token`")


def make_planner(cache: ExpertCache, config: PlannerConfig, facts: ModelFacts, model_path: str) -> NextTokenPlanner:
    """The planner for a loaded model: its predictor built (a PRED.npz must be of mode token) and fitted."""
    from ggmoe.control.prefetch import live_predictor

    check_planner(config.predictor)
    pred = live_predictor(config.predictor, facts, model_path, 1, config.train, config.state, mode="token")
    n = config.n_protect if config.n_protect is not None else default_protect(facts.n_expert, facts.n_expert_used)
    return NextTokenPlanner(cache, pred, facts.moe_layers, n)


def default_protect(n_expert: int, n_expert_used: int) -> int:
    """Experts planned per layer by default: 2 x n_expert_used, as many as the stride prefetcher prefetches. On
    the embedded model's held-out traces (8 slots, async) the hit rate rose with it from 1 to 3 x
    n_expert_used; beside a stride prefetcher 2 x kept nearly all of the gain (docs/predictors.md, "Planning
    the next token")."""
    from ggmoe.control.prefetch import default_n_prefetch

    return default_n_prefetch(n_expert_used, n_expert)
