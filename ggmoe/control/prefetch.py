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

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import HookRequest, RouteEvent
from ggmoe.cache.cache import ExpertCache
from ggmoe.predict.base import Predictor

if TYPE_CHECKING:
    from ggmoe.inspect.facts import ModelFacts

IDLE_SKIP_MAX = 16  # decode tokens at most that an idle prefetcher leaves the mailbox unread
BALANCE_WEIGHT = 1 / 8  # the newest token's weight in the prefetch budget's moving balance (about 8 tokens)
# decode tokens a prefetcher that turned itself off waits before it tries one prefetch a layer again: doubled
# each time it turns off again, back to the shortest once it runs at its whole budget
PROBE_AFTER, PROBE_MAX = 32, 1024


# the mailbox reader's share of layers read too late to prefetch at or above which a run says so
BEHIND_SHARE = 0.25


def reader_behind_note(prefetch: Mapping[str, Any] | None) -> str | None:
    """From a run's ``prefetch`` report (``Pipeline.describe``): where the async decode's predictor read a quarter
    or more of its layers only after the layer it predicts had started (those issue nothing, so its hits fall to
    LRU's), one line saying so; else None. ``ggmoe run`` and ``trace`` print it, ``serve`` logs it once."""
    if not prefetch or prefetch.get("runs_on") != "mailbox" or not prefetch.get("layers_targeted"):
        return None
    behind, total = prefetch["layers_behind"], prefetch["layers_targeted"]
    if behind < BEHIND_SHARE * total:
        return None
    return (f"predictor: read {behind} of {total} layers only after the layer it predicts had started, so those "
            "prefetched nothing (the decode ran ahead of the mailbox's reader: no core was free for it; "
            "--decode-mode sync runs the predictor in the route op instead)")


def default_n_prefetch(n_expert_used: int, n_expert: int) -> int:
    """Experts prefetched per target layer when none is asked (``--prefetch``, ``n_prefetch``): twice the
    top-k, so a prediction that ranks a used expert just below the top-k still brings it in, and never more
    than the layer has. The engine, the simulator and ``eval-predictor`` all take it from here."""
    return min(2 * n_expert_used, n_expert)


@dataclass(frozen=True)
class PrefetchConfig:
    """Which predictor drives prefetching and how far ahead."""

    predictor: str  # a registered name (reuse, skip-gate, token, eam, expert-map) or a PRED.npz file
    stride: int = 2  # MoE layers ahead
    n_prefetch: int | None = None  # experts prefetched per target layer (default: default_n_prefetch)
    threshold: float | None = None  # prefetch only experts whose score reaches this (fMoE's delta)
    train: tuple[str, ...] = ()  # training traces for the predictors that learn from traces
    # True: predict on a worker thread, off the route callback's critical path (prefetch counts then depend
    # on timing); False: in the callback, after the layer's slots are decided (deterministic)
    background: bool = False
    # what a data-driven predictor learnt in an earlier run (Predictor.state(), from --stats-in), or None
    state: Mapping[str, np.ndarray] | None = None
    # True: the engine computes the predictor's nets inside the decode graph when it has them (the mlp
    # predictor; llama_ggmoe_set_predictor), and the callback only ranks; False: numpy in the callback
    in_graph: bool = True
    # the async decode's mailbox reader. True: each MoE layer's matmuls wait until the reader has handled the layer
    # (the CPU build only), so what the predictor is worth does not depend on whether this machine had a core
    # free for it (`ggmoe trace`'s default there); False: free-running, as a server runs it; None: from
    # GGMOE_MAILBOX_LOCKSTEP (off unless set)
    lockstep: bool | None = None


class Prefetcher:
    """A route observer that prefetches layer il+stride's predicted experts into the cache.

    With ``background``, the callback only queues the event (a few microseconds); a worker thread runs
    the predictor and places the prefetches under the cache's lock, skipping a target layer that has
    already been called since the event (``prefetch_late``). Errors of the predictor then surface at the
    next decode.
    """

    def __init__(self, cache: ExpertCache, predictor: Predictor, layers: Sequence[int], n_prefetch: int,
                 threshold: float | None = None, background: bool = False) -> None:
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
        self._in_request = False  # the predictor has begun a request that has not ended
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        # the async decode's stride prefetch: the mailbox's reader calls ``observe_layer`` while the graph runs,
        # the controller's per-token events are ignored, and prefetches take free slots only (no eviction
        # while a graph may read a slot)
        self.via_mailbox = False
        self.free_only = False
        # the async decode's byte budget: experts prefetched per target layer now (0 .. n_prefetch; the sync
        # decode's prefetcher always prefetches n_prefetch), set between tokens from a moving balance of the bytes
        # used prefetches saved against those wasted and late ones cost on a busy link (``_budget``, ``_outcomes``)
        self.limit = n_prefetch
        self._balance = 0.0  # bytes: moving average of (used - wasted - late) prefetch bytes per token
        self._off = 0  # decode tokens the budget has been 0 (the prefetcher off) in a row
        self._probe_wait = PROBE_AFTER // 2  # tokens off before the next try: doubled each time it turns off
        # il -> (used, wasted + late) prefetches and (dropped, copied) admissions at the last look
        self._seen_outcomes: dict[int, tuple[int, int, int, int, int]] = {}
        self._issued: dict[int, int] = {}  # il -> prefetches issued into it, at the last look
        # tokens in a row whose predictions issued nothing (every predicted expert resident), and decode tokens
        # the mailbox is left unread for: 1, 2, 4 ... up to IDLE_SKIP_MAX, back to 0 once a prefetch is issued
        self._idle = 0
        self._events_seen = -1  # the cache's prefetch_events at the last look (-1: none yet)
        self._steady = False  # the last look found nothing moved (keep_free then stands as it is)
        self._skip = 0
        self._was_read = False  # whether the last decode token's mailbox was read
        # the first ``stride`` layers are predicted only between tokens (no earlier layer of the token predicts
        # them): those for which the predictor or the plan ever had scores there. The rest (an MLP that reads the
        # MoE input has nothing to say before the token runs) keep no free slot: one kept for nothing is a slot
        # the cache could not use (the embedded model's layers 0 and 1 lost 0.4 of their hits to it).
        self._start_targets: set[int] = set()
        if background:
            self.start_background()

    def start_background(self) -> None:
        """Predict on a worker thread from now on (the sync decode's ``--predict-in-background``)."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._work, name="ggmoe-prefetch", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item[0](*item[1:])
            except BaseException as e:  # noqa: BLE001 - surfaced by the engine's next decode
                self.error = self.error or e

    def _do(self, fn, *args) -> None:
        """Run ``fn(*args)`` now, or on the worker in order."""
        if self._queue is None:
            fn(*args)
        else:
            self._queue.put((fn, *args))

    def final_state(self) -> dict[str, np.ndarray]:
        """Stop the worker, end the open request, and return what the predictor has learnt (``state()``)."""
        self.close()
        if self._in_request:
            self.predictor.end_request()
            self._in_request = False
        return self.predictor.state()

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
            self._worker.join(timeout=5)
            self._queue = None

    def begin_step(self, tokens: Sequence[int]) -> None:
        """The engine is about to decode ``tokens``: a prefill starts a request, one token starts a token."""
        self._decoding = len(tokens) == 1
        if self.free_only and self._decoding:
            if not self.cache.prefetch_layers:  # every layer holds every expert: no prefetch can ever pay, and
                return  # the mailbox is never read (has_free_slot), so the token is not even begun
            self._throttle()
        calls = {il: self.cache.stats.layers[il].calls for il in self.layers[: self.predictor.stride]}
        self._do(self._begin, list(tokens), calls)

    def _throttle(self) -> None:
        """Between tokens (async decode): the budget from the bytes the last token's prefetches saved (used:
        read from a slot instead of over the link) against those they cost for nothing (wasted or late)."""
        events = self.cache.prefetch_events
        if events == self._events_seen and self._steady:  # nothing issued or resolved since a look that saw
            self._idle_token()  # nothing either: budget and kept slots stand; only the reader's skip moves
            if not self.limit:
                self._probe()
            return
        self._steady, self._events_seen = events == self._events_seen, events
        du, dw, issued = self._outcomes()
        self._balance += BALANCE_WEIGHT * ((du - dw) - self._balance)
        self._budget()
        # The free slots kept for the next token follow the budget and what the last token's prefetches took:
        # one more than they took, per layer, so a predictor whose experts are resident anyway (reuse, behind
        # LRU admissions) leaves the cache nearly all its slots.
        cap = self.cache.keep_free_cap(self.limit)
        unpredicted = set(self.layers[: self.predictor.stride]) - self._start_targets
        self.cache.keep_free = {il: min(c, issued[il] - self._issued.get(il, 0) + 1)
                                if c and il not in unpredicted else 0 for il, c in cap.items()}
        if sum(issued.values()) != sum(self._issued.values()):  # prefetches were issued: read every token
            self._idle = self._skip = 0
        else:
            self._idle_token()
        self._issued = issued

    def _budget(self) -> None:
        """The budget from the balance: one less while it is negative, down to none (the prefetcher off: no slot
        kept free, the mailbox left unread), one more while it is positive. Off, it tries one prefetch a layer
        again after PROBE_AFTER tokens (twice as many each time it turns off again), from an even balance: the
        routing may have changed. (Halving at each negative token kept the gpt-oss fixture's budget at one or
        two of its four prefetches though they saved more than they wasted.)"""
        was = self.limit
        if self._balance < 0:
            self.limit = max(0, self.limit - 1)
        elif self._balance > 0:
            self.limit = min(self.n_prefetch, self.limit + 1)
        if self.limit == self.n_prefetch:  # fully on again: the next time off waits the shortest
            self._probe_wait = PROBE_AFTER // 2  # (doubled as it turns off)
        if self.limit:
            self._off = 0
        elif was:  # just turned off: wait twice as long as last time before trying again
            self._probe_wait = min(PROBE_MAX, self._probe_wait * 2)
        else:
            self._probe()

    def _probe(self) -> None:
        """One more token off; after ``_probe_wait`` of them, one prefetch a layer from an even balance."""
        self._off += 1
        if self._off >= self._probe_wait:
            self.limit, self._off, self._balance = 1, 0, 0.0

    def _outcomes(self) -> tuple[float, float, dict[int, int]]:
        """Since the last look: the bytes used prefetches saved (the miss's read over the link), the bytes wasted
        and late ones cost, and every layer's prefetches issued so far. A wasted byte costs only where the link
        had no time to spare: it is weighed by the share of the misses' crossings that were on a token's path
        or dropped (the graph's in-graph fills, and an earlier token's admissions still queued when the next
        token's came) among all of them (fills and admissions). On an idle link a prefetch that is not used costs
        nothing but its free slot; on the real DeepSeek-V2-Lite routing over PCIe 4, where 88 % of admissions
        were dropped, async + reuse's prefetches cost 2 ms a token until they were weighed so. A fill crosses
        the link inside its layer, so beside fills every wasted byte counts."""
        used = wasted = 0.0
        pressed = crossed = 0
        issued: dict[int, int] = {}
        for il in self.layers:
            s = self.cache.stats.layers[il]
            nb = self.cache.slot_bytes.get(il, 0) or 1
            hits, lost, drops, admits, fills = self._seen_outcomes.get(il, (0, 0, 0, 0, 0))
            used += (s.prefetch_hits - hits) * nb
            wasted += (s.prefetch_wasted + s.prefetch_late - lost) * nb
            pressed += s.admissions_dropped - drops + s.fills - fills
            crossed += s.admission_copies - admits + s.fills - fills
            self._seen_outcomes[il] = (s.prefetch_hits, s.prefetch_wasted + s.prefetch_late, s.admissions_dropped,
                                       s.admission_copies, s.fills)
            issued[il] = s.prefetch_issued
        wasted *= min(1.0, pressed / crossed) if crossed else 0.0
        return used, wasted, issued

    def _idle_token(self) -> None:
        """The last token issued no prefetch: if it was read, leave the next ones unread, longer each time."""
        if self._was_read:
            self._idle += 1
            self._skip = min(IDLE_SKIP_MAX, 1 << (self._idle - 1))

    def wants_token(self) -> bool:
        """Async decode: whether the mailbox's reader should read the token about to decode. After tokens whose
        predictions issued nothing (every predicted expert already resident, as with every expert cached) it
        skips 1, 2, 4 ... tokens, so that its numpy does not take the decode's cores for nothing."""
        self._was_read = self._skip == 0 and self.limit > 0  # a prefetcher turned off reads nothing
        if self._skip > 0:
            self._skip -= 1
        return self._was_read

    def _begin(self, tokens: list[int], calls: dict[int, int]) -> None:
        if len(tokens) > 1:
            if self._in_request:  # an online learner keeps what the previous request showed it
                self.predictor.end_request()
            self.predictor.begin_request()
            self._in_request = True
            return
        self.predictor.begin_token(int(tokens[0]))
        for il, n in calls.items():  # targets that no earlier layer of this token predicts
            if self.free_only and self._full(il):  # nowhere to put a prefetch: no prediction (as _observe)
                continue
            self._prefetch(il, self.predictor.predict(il), n, at_start=True)

    def _planned(self, il: int) -> np.ndarray | None:
        """The planner's experts for layer ``il``'s next call (``ExpertCache.planned``) as scores, likeliest highest
        (1, then down towards 0), or None without a plan."""
        plan = self.cache.planned.get(il)
        if not plan:
            return None
        scores = np.zeros(self.cache.n_expert, dtype=np.float32)
        scores[plan] = 1.0 - np.arange(len(plan), dtype=np.float32) / len(plan)
        return scores

    @property
    def wants_routing(self) -> bool:
        """The controller's events between tokens: not when the mailbox brings the routing (``on_route``
        would drop them)."""
        return not self.via_mailbox

    def on_route(self, event: RouteEvent) -> None:
        if self.via_mailbox or not self._decoding or event.n_tokens != 1:
            return
        if self.predictor.needs_hidden and event.hidden is None and event.scores is None:
            return  # the route op was not asked for the input (the async decode's prefetcher reads the mailbox)
        target = self._next.get(event.il)
        calls = self.cache.stats.layers[target].calls if target in self.cache.tables else None
        self._do(self._observe, event, target, calls)

    def target(self, il: int) -> int | None:
        """The layer that layer ``il``'s event predicts (``stride`` MoE layers ahead), or None."""
        return self._next.get(il)

    def observe_layer(self, event: RouteEvent, prefetch: bool = True) -> None:
        """The async decode's stride prefetch: layer ``event.il`` of a decode token has started (its routing and
        input rows from the mailbox, read while the graph runs); predict ``stride`` layers ahead and prefetch.
        ``prefetch`` False: the target layer has already started (the reader fell behind the device), so the
        predictor only observes."""
        if self._decoding and event.n_tokens == 1:
            self._observe(event, self._next.get(event.il) if prefetch else None, None)

    def scores_from_graph(self) -> None:
        """The engine computes the predictor's nets in the graph: the route events bring their logits, so the
        layer's MoE input need not be copied for it."""
        self.request = HookRequest(probs=self.predictor.needs_probs, hidden=False)

    def _observe(self, event: RouteEvent, target: int | None, calls: int | None) -> None:
        probs = event.probs[0] if event.probs is not None else None
        hidden = event.hidden[0] if event.hidden is not None else None
        self.predictor.observe(event.il, event.ids[0], probs, hidden)
        if event.scores is not None:
            self.predictor.observe_scores(event.il, event.scores[0])
        if target is not None and not (self.free_only and self._full(target)):
            self._prefetch(target, self.predictor.predict(target), calls)

    def _full(self, target: int) -> bool:
        """No free slot in ``target`` where a prefetch into a running graph pays: skip predicting. A layer with a
        slot for every expert never evicts, so a prefetch there pays nothing (``ExpertCache.has_free_slot``)."""
        return not self.cache.has_room(target)

    def _prefetch(self, target: int, scores: np.ndarray | None, calls: int | None = None,
                  at_start: bool = False) -> None:
        """Prefetch ``target``'s top experts by ``scores``. ``at_start`` (between tokens, before any layer of
        the token): a predictor with nothing to say there (one that reads the MoE input) leaves it to the
        planner's plan, and no planned expert is evicted; within a token the fresher prediction decides."""
        keep, planned = None, False
        if at_start:
            planned = scores is None and self.threshold is None
            scores = self._planned(target) if planned else scores
            keep = set(self.cache.planned.get(target, ()))
        if scores is None or target not in self.cache.tables:
            return
        if at_start:
            self._start_targets.add(target)
        # one argsort and two tolist() calls: per-element numpy indexing costs ~0.1 us an element here
        order = np.argsort(-scores, kind="stable")[: max(self.k, self.n_prefetch)]
        ranked = order.tolist()
        if not planned:  # the stride predictor's accuracy (the plan's is scored by the planner)
            self.cache.score_prediction(target, ranked[: self.k])
        n = self.limit if self.free_only else self.n_prefetch
        top = ranked[:n]
        top_scores = scores[order[:n]].tolist()
        if self.threshold is not None:
            above = [j for j, v in enumerate(top_scores) if v >= self.threshold]
            top, top_scores = [top[j] for j in above], [top_scores[j] for j in above]
        if not top:
            return
        # fMoE's priority p / (l - l_now): likelier experts of nearer layers are copied first
        d = self.predictor.stride
        self.cache.prefetch(target, top, keep=keep, ranks=[-v / d for v in top_scores],
                            if_calls=calls if self._queue is not None else None, free_only=self.free_only)


def live_predictor(spec: str, facts: ModelFacts, model_path: str, stride: int, train: tuple[str, ...] = (),
                   state: Mapping[str, np.ndarray] | None = None, mode: str = "layer") -> Predictor:
    """A predictor for a loaded model, built (and fitted, if it learns) as the prefetcher and the planner need it;
    ``mode``: what a PRED.npz must have been trained for (layer: ``stride`` layers ahead; token: the next token)."""
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.predict import ModelShape, make_predictor
    from ggmoe.predict.base import is_predictor_file
    from ggmoe.trace import load_traces

    shape = ModelShape(model_fingerprint=model_fingerprint(model_path), layers=tuple(facts.moe_layers),
                       n_expert=facts.n_expert, n_expert_used=facts.n_expert_used, n_embd=facts.n_embd)
    options: dict[str, object] = {"model": model_path} if spec == "skip-gate" else {}
    if is_predictor_file(spec):
        options["mode"] = mode
    if spec == "oracle":
        raise UsageError("the oracle predictor needs the routing in advance: it runs in the simulator only")
    pred = make_predictor(spec, shape, stride, **options)
    if state:
        pred.load_state(dict(state))
    if pred.needs_fit and not (pred.has_state and not train):
        if not train:
            raise UsageError(f"predictor {spec!r} learns from traces: give --predictor-train TRACES "
                             "(or --stats-in FILE saved by a run with it)")
        traces = load_traces(list(train))
        if traces.meta.model_fingerprint != shape.model_fingerprint:
            raise UsageError("--predictor-train traces come from another model")
        pred.fit(traces)
    return pred


def make_prefetcher(cache: ExpertCache, config: PrefetchConfig, facts: ModelFacts, model_path: str) -> Prefetcher:
    """The prefetcher for a loaded model: its predictor built (and fitted, if it learns) for the model."""
    pred = live_predictor(config.predictor, facts, model_path, config.stride, config.train, config.state)
    n = config.n_prefetch if config.n_prefetch is not None else \
        default_n_prefetch(facts.n_expert_used, facts.n_expert)
    return Prefetcher(cache, pred, facts.moe_layers, n, config.threshold, background=config.background)


def build_prefetch_config(predictor: str | None, stride: int = 2, n_prefetch: int | None = None,
                          threshold: float | None = None, train: tuple[str, ...] = (),
                          background: bool = False) -> PrefetchConfig | None:
    """A PrefetchConfig from the flags, or None without --predictor."""
    if predictor is None:
        if train or n_prefetch is not None or threshold is not None or background:
            raise UsageError("--prefetch, --prefetch-threshold, --predictor-train and --predict-in-background "
                             "need --predictor")
        return None
    return PrefetchConfig(predictor=predictor, stride=stride, n_prefetch=n_prefetch, threshold=threshold,
                          train=tuple(train), background=background)
