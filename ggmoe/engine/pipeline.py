"""The one pipeline: route hook, cache runtime, expert tables, controller, prefetcher and observers on a context.

Engine layer (ctypes allowed). ``Engine`` and ``ggmoe.load()`` (through
``GgmoeLlama``) build exactly this object on their ``llama_context *`` and call
it around every ``llama_decode``:

- ``begin_step(tokens)`` before: the prefetcher's token-based predictors read the batch;
- ``after_decode(n_tokens)`` after the logits were read (the device is idle): in the async decode the
  routing output goes to the ``TokenController`` (cache admissions, then the observers);
- ``take_error()``: what the route callback, the route op or the prefetch worker stored (a callback never
  raises into C); the caller raises it from the call that ran the decode.

Decode modes (``ggmoe.cache.decode_mode``): in ``async``, micro-batches of at most ``max_tokens`` tokens
read their experts through the expert tables with no route op (no Python per MoE layer); larger ones
(prefill) take the route op on the same cache, whose slot changes the tables follow. While an observer
reads router probabilities or hidden states, or a benchmark overrides the routing, table mode is off and
every micro-batch takes the route op (the sync path), with the tables kept current for when it comes back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from ggmoe.base.errors import EngineError, UsageError
from ggmoe.base.hook import HookRequest, RouteEvent, RouteObserver
from ggmoe.cache import CacheStats
from ggmoe.cache.decode_mode import (
    TABLE_MAX_TOKENS,
    DecodeMode,
    choose_decode_mode,
    sync_reasons,
    table_type_note,
)
from ggmoe.cache.fill import Fill
from ggmoe.cache.host_tier import HostTier
from ggmoe.cache.miss import async_cpu_masks, auto_without_host_path
from ggmoe.cache.split import model_split
from ggmoe.control import TokenController
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.graph_predictor import GraphPredictor, attach_graph_predictor
from ggmoe.engine.hooks import Observers, RouteOpHook
from ggmoe.engine.mailbox import Mailbox, lockstep_from_env
from ggmoe.engine.runtime import CacheRuntime
from ggmoe.engine.stride import StrideReader
from ggmoe.engine.tables import ExpertTables
from ggmoe.inspect.facts import ModelFacts

if TYPE_CHECKING:
    from ggmoe.control.planner import NextTokenPlanner
    from ggmoe.control.prefetch import Prefetcher

# How far ``CachePipeline._teardown`` goes: "cache" takes the cache off the live context and frees it, the route hook
# and observers staying (``reconfigure``); "context" takes everything off the context, memory kept until the context
# that computed with it is gone (``detach``); "all" does both (``close``).
TeardownStage = Literal["cache", "context", "all"]


def table_max_tokens(n_batch: int, n_ubatch: int) -> int:
    """The largest micro-batch that reads through the tables (0: none), such that it is always the last
    micro-batch of its ``llama_decode`` call (the routing output holds one micro-batch): any size up to
    ``TABLE_MAX_TOKENS`` when a call is one micro-batch, else only a final one smaller than ``n_ubatch``."""
    if n_ubatch >= n_batch:
        return TABLE_MAX_TOKENS
    return max(0, min(TABLE_MAX_TOKENS, n_ubatch - 1))


def last_ubatch(n_tokens: int, n_ubatch: int) -> int:
    """Tokens in the last micro-batch llama.cpp makes of a ``llama_decode`` call of ``n_tokens`` tokens."""
    return n_tokens - n_ubatch * ((n_tokens - 1) // n_ubatch)


def backend_note(facts: ModelFacts, on_gpu: bool) -> str | None:
    """Why the device cannot read these experts through tables (None: it can): ggml-cpu reads every type;
    ggml-cuda the types MMVQ has a kernel for; other GPU backends have no ``mul_mat_id_table``."""
    if not on_gpu:
        return None
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    name = B.libggml.ggml_backend_dev_name(dev).decode() if dev else "GPU"
    return table_type_note(name, [(t.name, t.ggml_type) for layer in facts.layers for t in layer.cached])


class HostTierUses:
    """Every layer's routed experts to the host tier's policy (ids only): it ages experts by every use."""

    request = HookRequest(probs=False, hidden=False)

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier

    def on_route(self, event: RouteEvent) -> None:
        self.tier.touch(event.il, np.unique(event.ids))


class CachePipeline:
    """Route hook + observers, and with a cache config: cache runtime, decode mode, expert tables, token
    controller, prefetcher and in-graph predictor, on one ``llama_context``."""

    def __init__(self, model_ptr: int, ctx_ptr: int, facts: ModelFacts, model_path: Path,
                 run: RunConfig | None, observers: Observers | Sequence[RouteObserver] = (),
                 n_threads: int | None = None, n_batch: int = 512, n_ubatch: int = 512) -> None:
        _patched.symbols()  # EngineNotPatchedError names the fix when the engine lacks the patch
        self._ctx_ptr = ctx_ptr
        self.facts = facts
        self.hook = RouteOpHook(observers if isinstance(observers, Observers) else None, facts.gating)
        self.observers = self.hook.observers
        self.runtime: CacheRuntime | None = None
        self.run_config: RunConfig | None = None  # the configuration the cache was built for (as asked)
        self.prefetcher: Prefetcher | None = None  # when the cache prefetches
        self.graph_predictor: GraphPredictor | None = None  # its nets in the graph, when it has any
        self.tables: ExpertTables | None = None
        self.planner: NextTokenPlanner | None = None  # when a cross-token predictor plans
        self.tier_uses: HostTierUses | None = None  # the host tier's view of the routing, under a disk tier
        self.mailbox: Mailbox | None = None  # the async decode's mailbox (the stride reader's, the planner's rows)
        self.stride: StrideReader | None = None  # the async decode's stride prefetch (the mailbox's reader)
        self._reading = False  # the stride reader has a token of the decode in flight
        self.controller: TokenController | None = None
        self.decode_mode: DecodeMode | None = None  # None without a cache
        self.n_ubatch = n_ubatch
        self._model_ptr, self._model_path, self._n_threads, self._n_batch = model_ptr, model_path, n_threads, n_batch
        self.hook.install(ctx_ptr)
        self._route_inputs = self.observers.on_change
        try:
            if not isinstance(observers, Observers):
                for obs in observers:
                    self.observers.add(obs)
            if run is not None:
                self._build_cache(run)
        except BaseException:
            self._teardown("all")
            raise

    def _build_cache(self, run: RunConfig) -> None:
        """Cache runtime, decode mode, tables, controller and prefetcher for ``run`` on the context."""
        ctx_ptr, facts, model_path = self._ctx_ptr, self.facts, self._model_path
        route_inputs = self._route_inputs
        # auto never asks for a host path that cannot serve this cache: it runs as wait and says why
        decode = run.decode
        miss, why = auto_without_host_path(decode.miss_policy, bool(model_split(facts, run.cache.layer_theta)))
        self.runtime = CacheRuntime.for_model(self._model_ptr, ctx_ptr,
                                              replace(run, decode=replace(decode, miss_policy=miss)), facts,
                                              self._n_threads, model_path)
        if why is not None:
            self.runtime.miss_policy_note = why
        self.run_config = run
        self.hook.cache = self.runtime.cache
        if run.prefetch is not None:
            from ggmoe.control.prefetch import make_prefetcher

            # in the foreground until the decode mode is known (the async decode reads on its own thread)
            self.prefetcher = make_prefetcher(self.runtime.cache, replace(run.prefetch, background=False), facts,
                                              str(model_path))
        if run.planner is not None:
            from ggmoe.control.planner import make_planner

            self.planner = make_planner(self.runtime.cache, run.planner, facts, str(model_path))
        on_gpu = bool(self.runtime.stream.backend)
        note = backend_note(facts, on_gpu)
        split = bool(self.runtime.split)  # MoEpic's split layers read through their tables in both modes
        if split and note:
            raise UsageError(f"split experts (top share θ < 1) are read through the expert table: {note}")
        masks = self._cpu_masks(run)  # the async host part's: auto keeps a host path in sync only for some layer
        reasons = sync_reasons(self.runtime.miss_policy, self._prefetch_note(), note,
                               auto=decode.mode == "auto" and bool(masks))
        reasons += self._disk_reasons(on_gpu, decode.mode)
        idle = self._prefetch_idle_note()  # the async decode's stride prefetch would never find a free slot
        if idle is not None and decode.mode == "auto":
            reasons.append(idle)  # auto takes the sync decode, where the predictor runs
        max_tokens = table_max_tokens(self._n_batch, self.n_ubatch)
        if not max_tokens:
            reasons.append(f"micro-batches of {self.n_ubatch} tokens are too small for the routing output")
        # auto weighs what each mode costs a token on this machine: on a GPU, where the async decode moves each
        # miss over the link twice (read in place, then admitted), and for a stride prefetch, which runs in
        # either mode (the route op's callback, or the mailbox's reader)
        weighed = (self.runtime.mode_estimate(run, self._n_threads or os.cpu_count() or 1)
                   if (self.prefetcher is not None or on_gpu) and decode.mode == "auto" and not reasons
                   else None)
        self.decode_mode = choose_decode_mode(decode.mode, reasons, weighed,
                                              "with a stride prefetch" if self.prefetcher is not None else "on a GPU")
        if idle is not None and self.decode_mode.mode == "async":  # asked for: it runs, and says the predictor won't
            self.decode_mode = replace(self.decode_mode, reason=f"{self.decode_mode.reason}; {idle}")
        if self.prefetcher is not None and self.decode_mode.mode == "sync":
            self._sync_prefetch(run)
        if self.decode_mode.mode == "async" or split:
            self._make_tables(self.decode_mode.mode == "async" and decode.fills, max(max_tokens, 1))
            # sync-path slot changes reach the tables at once (a split layer reads them in the same call)
            self.hook.after_route = self._tables_follow
        if self.decode_mode.mode == "async":
            self._start_async(max_tokens, route_inputs)
        if self.planner is not None:  # the sync decode's route events; in async, while table mode is off
            self.observers.add(self.planner)
        self._after_mode(masks)

    def _after_mode(self, masks: dict[int, list[bool]]) -> None:
        """What follows the decode mode: the CPU beside the link (the sync decode with a host-part worker), the
        host tier's uses, the async decode's host part (``masks``: its experts per layer, ``_cpu_masks``). A cache
        with a slot for every expert is warm in the sync decode too (``_start_async`` warms it in async): its host
        path was left off on that promise (``without_host_path_when_full``)."""
        if self.decode_mode.mode == "sync":
            self.runtime.cache.preload()
        if self.decode_mode.mode == "async" and self.runtime.miss_policy != "wait":
            self._async_host_part(masks)
        if self.decode_mode.mode == "sync" and self.runtime.host_threads:
            self._beside_link(True)
        if self.runtime.tier is not None:
            self.tier_uses = HostTierUses(self.runtime.tier)
            self.observers.add(self.tier_uses)
            self.runtime.tier.predictions_evict = self.decode_mode.mode == "sync"

    def _beside_link(self, on: bool) -> None:
        """The CPU part beside the link (or not): a layer call with CPU entries waits for its copies in the wait
        hook, after the worker has started on them, and ``auto`` splits a layer's misses between the two."""
        self.hook.install_wait(self._ctx_ptr, on)
        cache = self.runtime.cache
        cache.defer_wait = cache.cpu_beside_link = on

    def _disk_reasons(self, on_gpu: bool, asked: str) -> list[str]:
        """Why a disk tier takes the sync decode: always on a GPU, for ``auto`` on the CPU build."""
        if self.runtime.disk is None:
            return []
        if on_gpu:
            return ["a disk tier: the GPU's kernels cannot read an expert that is only in the model file (the "
                    "async decode reads misses in place over the link)"]
        if asked == "auto":  # the CPU build: async runs when asked for
            return ["a disk tier: the sync decode reads each miss into the host tier (O_DIRECT, several in "
                    "flight), where the async decode reads it in place from the file's mapping"]
        return []

    def _start_async(self, max_tokens: int, route_inputs: Callable[[HookRequest], None]) -> None:
        """The async decode's controller, predictors and table mode; a cache with a slot for every expert is
        warmed first (no expert's first use a miss)."""
        if self.runtime.cache.preload():
            self._tables_follow()
        self.controller = TokenController(self.runtime.cache, None, self.planner)
        self._async_predictors(max_tokens)
        self._identity()

        def on_change(request: HookRequest) -> None:
            route_inputs(request)
            self._update_table_mode()

        self.observers.on_change = on_change
        self._update_table_mode()

    def _identity(self) -> None:
        """A warmed cache with a slot for every expert, each expert in its own, and no predictor reading the
        mailbox: its layers' graphs read the slots with stock's matmuls, no table (patch 0017). A later flip of
        a layer turns it off again (``ExpertTables.apply``)."""
        cache = self.runtime.cache
        if (self.tables is None or not self.run_config.decode.identity or not cache.roomy  # (roomy: a keeping policy)
                or self.mailbox is not None or self.planner is not None):
            return
        self.tables.set_identity([il for il in cache.n_slots if self.tables.is_identity(il)], True)

    def _cpu_masks(self, run: RunConfig) -> dict[int, list[bool]]:
        """Per layer, the experts the async decode's host part would compute whenever no slot holds them (none
        for a layer it leaves to the link), from the miss policy in effect and the cost model."""
        cache, facts = self.runtime.cache, self.facts
        if self.runtime.miss_policy == "wait":
            return {}
        return async_cpu_masks(self.runtime.miss_policy, cache.costs, cache.bytes_per_expert, cache.n_slots,
                               facts.n_expert, facts.n_expert_used, run.decode.routing_counts,
                               keeps=not cache.policy_releases)

    def _async_host_part(self, masks: dict[int, list[bool]]) -> None:
        """The async decode's host part (patch 0016): per layer, the experts the graph computes on the CPU whenever
        no slot holds them (``masks``, from the miss policy and the cost model); where none does, the run says
        why."""
        cache = self.runtime.cache
        cache.cpu_of = masks
        self.tables.set_host_part(cache.cpu_of)
        # (a warm cache of every expert runs as wait, said by ``without_host_path_when_full``; cpu flags every
        # expert of every other cache: no layer here is auto's choice)
        if not cache.cpu_of and not self.runtime.miss_policy_note:
            self.runtime.miss_policy_note = ("auto: the async decode's graph reads a miss over the link sooner than "
                                             "the CPU computes it, so its host part takes no layer")

    def _make_tables(self, fill: bool, max_tokens: int) -> None:
        """The expert tables the cache's steps write, with the fill words where the graph fills misses (patch
        0012: room for a token's every miss, ``n_expert_used``)."""
        facts, cache = self.facts, self.runtime.cache
        self.tables = ExpertTables(self._ctx_ptr, self.runtime.slots, facts.n_expert, facts.n_expert_used,
                                   facts.n_layer, max_tokens, cache.fill_layers if fill else (), facts.n_expert_used)
        if self.tables.fills is not None:
            cache.fill_slots = facts.n_expert_used
        self.tables.follow(cache)

    def _prefetch_note(self) -> str | None:
        """Why the prefetcher's or the planner's predictor cannot run on the async decode (None: they can, on
        the mailbox)."""
        for who, owner in (("predictor", self.prefetcher), ("planner", self.planner)):
            pred = owner.predictor if owner is not None else None
            if pred is not None and pred.needs_probs:
                return (f"{who} {pred.name!r} reads router probabilities, which the async decode's mailbox does "
                        "not carry (ids and the MoE input only)")
            if pred is not None and pred.needs_hidden and self.facts.gating.weight_before_ffn:
                return (f"{who} {pred.name!r} reads the MoE input, which {self.facts.arch} weights before its "
                        "experts: the async decode's mailbox carries its ids only")
        return None

    def _prefetch_idle_note(self) -> str | None:
        """Why the async decode's stride prefetch would never run (None: it can, or there is no prefetcher): a
        prefetch into a running graph takes a free slot only, and a layer with as many slots as a token's experts
        keeps none free (``ExpertCache.keep_free_cap``). The sync decode's prefetch evicts, so it runs there."""
        cache, pf = self.runtime.cache, self.prefetcher
        if pf is None or not cache.prefetch_layers:  # every expert cached: nothing to prefetch in either mode
            return None
        cap = cache.keep_free_cap(pf.n_prefetch)
        if any(cap.get(il, 0) for il in cache.prefetch_layers):
            return None
        slots = sorted({cache.n_slots[il] for il in cache.prefetch_layers})
        return (f"predictor {pf.predictor.name!r} cannot prefetch in the async decode: {slots[-1]} slots per "
                f"layer for top-{cache.n_expert_used} leave no free slot (the sync decode's prefetch evicts)")

    def _sync_prefetch(self, run: RunConfig) -> None:
        """The sync decode's prefetcher: a route observer (in-graph nets and the worker thread as configured)."""
        if run.prefetch.in_graph:
            self.graph_predictor = attach_graph_predictor(self._ctx_ptr, self.prefetcher.predictor,
                                                          self.facts.moe_layers)
            if self.graph_predictor is not None:
                self.prefetcher.scores_from_graph()
        if run.prefetch.background:
            self.prefetcher.start_background()
        self.observers.add(self.prefetcher)

    def _async_predictors(self, max_tokens: int) -> None:
        """The async decode's mailbox where a predictor reads it (the stride prefetcher's reader thread; the
        planner's MoE input rows, read between tokens), then the stride prefetch."""
        facts = self.facts
        readers = [o.predictor for o in (self.prefetcher, self.planner) if o is not None]
        if self.prefetcher is not None or any(p.needs_hidden for p in readers):
            self.mailbox = Mailbox(self._ctx_ptr, facts.n_layer, max(max_tokens, 1), facts.n_expert_used,
                                   facts.n_embd, hidden=any(p.needs_hidden for p in readers),
                                   # lockstep waits for the reader's acknowledgements: only with a reader
                                   lockstep=self.prefetcher is not None and self._lockstep())
        if self.planner is not None:  # its inputs come from the mailbox (a request would turn table mode off)
            self.planner.request = HookRequest(probs=False, hidden=False)
        if self.prefetcher is not None:
            self._stride_prefetch()

    def _lockstep(self) -> bool:
        """Whether the mailbox's reader runs in lockstep with the decode (``PrefetchConfig.lockstep``, else
        ``GGMOE_MAILBOX_LOCKSTEP``); refused on a GPU, whose kernels never wait for the host."""
        on_gpu = bool(self.runtime.stream.backend)
        asked = self.run_config.prefetch.lockstep if self.run_config.prefetch is not None else None
        if asked is None:
            return lockstep_from_env(on_gpu)
        if asked and on_gpu:
            raise UsageError("lockstep (each layer waits for the predictor's reader) is the CPU build's: a GPU "
                             "never waits for the host; measure without it")
        return asked

    def _mailbox_rows(self) -> dict[int, np.ndarray]:
        """Between tokens: il -> the MoE input row [n_embd] float32 of the last token the decode just ran at each
        MoE layer, from the mailbox (layers it holds none for left out)."""
        mb, rows = self.mailbox, {}
        if mb is None or mb.hidden is None:
            return rows
        for il in self.facts.moe_layers:
            n, with_hidden = mb.written(il)
            if n and with_hidden:
                rows[il] = mb.hidden[il, n - 1].copy()
        return rows

    def _stride_prefetch(self) -> None:
        """The async decode's prefetcher: the mailbox's reader thread, entries flipped on the copy stream,
        and free slots kept per layer for prefetches into a running graph. Still a route observer for the
        micro-batches that take the route op while table mode is off (it then prefetches as in sync)."""
        facts, cache = self.facts, self.runtime.cache
        self.stride = StrideReader(self.mailbox, self.prefetcher, cache, facts.moe_layers)
        self.runtime.stream.flip = self.tables.entry_flip
        self._keep_free = cache.keep_free_cap(self.prefetcher.n_prefetch)
        # in table mode it asks the route op for nothing (its inputs come from the mailbox); while table mode is off
        # it asks for what its predictor reads, as in sync (``_route_requests``), and never keeps table mode off
        self.prefetcher.request = HookRequest(probs=False, hidden=False)
        self.observers.add(self.prefetcher)

    def reconfigure(self, run: RunConfig) -> None:
        """Replace the cache with one built for ``run`` (MoEpic's reconfiguration between requests: other
        slot counts and top shares): between decodes only. The old slots, tables and prefetcher leave the
        context first; what was resident is not carried over (the new cache starts empty), nor are the
        statistics. On an error the pipeline is left without a cache and the error is raised."""
        if not self._ctx_ptr:
            raise EngineError("the pipeline is detached from its context")
        self._teardown("cache")
        try:
            self._build_cache(run)
        except BaseException:
            self._teardown("cache")
            raise

    # -- decode mode
    def _table_mode_wanted(self) -> bool:
        """Whether no observer needs the route op: the prefetcher's and the planner's own requests do not count
        (in table mode the mailbox and the controller bring their inputs; they ask only while it is off)."""
        own = self._own_observers()
        return self.controller is not None and not any(
            o.request.probs or o.request.hidden for o in self.observers.items if not any(o is x for x in own))

    def _own_observers(self) -> tuple[RouteObserver, ...]:
        """The async decode's prefetcher and planner (observers whose inputs follow table mode)."""
        if self.controller is None:
            return ()
        return tuple(o for o in (self.prefetcher, self.planner) if o is not None)

    def _route_requests(self, table_mode: bool) -> None:
        """The async decode's prefetcher and planner ask the route op for nothing while table mode serves the
        decode (the mailbox brings their inputs), and for what their predictors read while it is off (an observer
        needs the route op): they then predict from the route op's events, as in sync."""
        changed = False
        for obs in self._own_observers():
            pred = obs.predictor
            want = (HookRequest(probs=False, hidden=False) if table_mode
                    else HookRequest(probs=pred.needs_probs, hidden=pred.needs_hidden))
            changed |= obs.request != want
            obs.request = want
        if changed:
            self.observers.refresh()  # the union to the route op (``on_change``)

    def _update_table_mode(self) -> None:
        """Table mode on while nothing needs the route op's per-layer answer (see the module's doc)."""
        if self.tables is None or not self._ctx_ptr:
            return
        want = self._table_mode_wanted()
        if want and not self.tables.enabled:
            self.tables.enable()
        elif not want and self.tables.enabled:
            self.tables.disable()
        on = self.tables.enabled
        if self.mailbox is not None and want and on:  # the mailbox while tables serve the decode
            self.mailbox.attach()
        if self.planner is not None and self.controller is not None:  # else the route op's events
            self.planner.via_controller = on
        if self.stride is not None:
            self.prefetcher.via_mailbox = self.prefetcher.free_only = on
            self.runtime.cache.keep_free = dict(self._keep_free) if on else {}
        self._route_requests(on)  # last: it may call back here (the route op's inputs changed)

    def set_routing_override(self, override: Callable[[int, int], list[int]] | None) -> None:
        """Benchmarks only (trace-replay routing): the experts ``override(il, n_tokens)`` gives replace the
        router's: in the route op's answers (sync path), and in table mode as the forced routing the device
        reads (written before each table-mode decode)."""
        self.hook.routing_override = override
        if self.tables is not None:
            self.tables.force(override is not None)

    @property
    def mode_in_effect(self) -> str | None:
        """async or sync as the next decode runs (None without a cache)."""
        if self.decode_mode is None:
            return None
        return "async" if self.tables is not None and self.tables.enabled else "sync"

    # -- around each llama_decode
    def begin_step(self, tokens: Sequence[int]) -> None:
        """Before each ``llama_decode``: the tokens of the batch (the token-based predictors read them); the
        routing output cleared when its last micro-batch will read through the tables."""
        if self._reading:  # a decode that failed left its token open: close it before the next one
            self._reading = False
            self.stride.end_token()
        if self.prefetcher is not None:
            self.prefetcher.begin_step(list(tokens))
        if self.planner is not None:
            self.planner.begin_step(tokens)
        tables = self.tables
        self._tier_step()
        if self.controller is not None and tables.enabled:
            self.runtime.cache.land_ready()  # copies landed since the last token: readable for this one
        n = last_ubatch(len(tokens), self.n_ubatch)
        if tables is not None and tables.fills is not None:  # only a one-token decode fills: llama.cpp may split
            # a batch of several tokens (one micro-batch per sequence without a unified KV cache), and a later
            # micro-batch would read a filled slot's old expert through its entry before the controller's step
            self._offer_fills(1 if tables.enabled and len(tokens) == 1 else 0)
        if tables is not None:
            self._tables_follow()  # what the cache changed since the last step, on the device before the decode
        if tables is not None and tables.enabled and n <= tables.max_tokens:
            if n > 1:  # one token: every layer computes it, so every row is written (nothing stale to clear)
                tables.clear_routing()
            override = self.hook.routing_override
            if override is not None and tables.forcing:
                k = self.facts.n_expert_used
                layers = list(self.facts.moe_layers)
                tables.write_forced(layers, [np.asarray(override(il, n), dtype=np.int32).reshape(n, k)
                                             for il in layers])
            if (self.stride is not None and len(tokens) == 1 and self.runtime.cache.has_free_slot()
                    and self.prefetcher.wants_token()):
                self.stride.begin_token()  # the last thing before the decode launches
                self._reading = True
            elif self.stride is not None:  # a table-mode decode of several tokens: nobody reads it
                self.stride.mailbox.release_all()

    def _tier_step(self) -> None:
        """Between decodes, under a disk tier: the model file checked (before a graph reads it in place), the
        host tier's landed reads made readable, its clock advanced, and every expert that entered or left it
        pointed at its new host address in the tables."""
        rt = self.runtime
        tier = rt.tier if rt is not None else None
        if tier is None:
            return
        tier.reader.check()
        tier.land()
        tier.next_token()
        planned = rt.cache.planned  # the planner's next-token experts per layer, likeliest first: read ahead from disk
        for il in self.facts.moe_layers:
            if planned.get(il):
                tier.prefetch(il, planned[il])
        moves = tier.take_moves()
        if self.tables is not None:
            n_kinds = {il: len(t.views) for il, t in self.tables.layers.items()}
            for m in moves:
                if m.il in n_kinds:
                    self.tables.layers[m.il].host_moved(m.expert, [rt.source(m.il, k, m.expert)
                                                                   for k in range(n_kinds[m.il])])

    def _fills_in_place(self, fills: Sequence[Fill]) -> None:
        """Under a disk tier, the fills the graph copied from the file's mapping (not from a host slot): read in
        place, counted by the host tier."""
        tier = self.runtime.tier
        if tier is not None:
            for f in fills:
                tier.note_in_place(f.il, (f.expert,))

    def _offer_fills(self, n_tokens: int) -> None:
        """The fill slots of a one-token table-mode decode (``n_tokens`` 1; 0: not one), on the device with a new
        stamp. Fills of a decode that was never settled (it failed after its graph ran) are read back and
        settled first."""
        cache, words = self.runtime.cache, self.tables.fills
        if cache.fill_targets:  # that decode's graph done first (a no-op when the device is idle)
            B.llama_cpp.llama_synchronize(self._ctx_ptr)
            cache.take_fills(words.read())
        words.write(cache.offer_fills(n_tokens))  # none but a table decode's: stale targets never run

    def _tables_follow(self) -> None:
        """The cache's step since the last one into the tables, and the tables onto the device."""
        self.tables.apply(self.runtime.cache.take_step())
        self.tables.flush()

    def after_decode(self, n_tokens: int) -> None:
        """After a ``llama_decode`` of ``n_tokens`` tokens whose logits were read: in table mode, the last
        micro-batch's routing (when it read through the tables) goes to the controller, once per decode."""
        if self._reading:  # every layer has written: the reader finishes before the controller runs
            self._reading = False
            self.stride.end_token()
        tables = self.tables
        if tables is None or not tables.enabled or self.hook.error is not None:
            return
        n = last_ubatch(n_tokens, self.n_ubatch)
        if n > tables.max_tokens:
            return  # it took the route op: the callback saw it layer by layer
        if n == 1 and self._identity_token():
            return
        B.llama_cpp.llama_synchronize(self._ctx_ptr)  # no-op after the logits read; the routing is complete
        try:
            if tables.fills is not None:  # what the graph filled: placed by the controller's step, not admitted
                fills = tables.fills.read()
                self._fills_in_place(fills)
                self.runtime.cache.take_fills(fills)
            hidden = self._mailbox_rows() if self.controller.wants_hidden(n) else None  # the planner's input rows
            tables.apply(self.controller.on_routing(self.facts.moe_layers, tables.read_routing(n), self.observers.items,
                                                    hidden))
            tables.flush()  # the plan's entries on the device now: any decode after this one reads them
        except BaseException as e:  # noqa: BLE001 - raised by the caller, as the callback's errors are
            self.hook.error = e

    def _identity_token(self) -> bool:
        """After a one-token decode that read every cached layer with identity and that nothing reads the routing
        of: the controller counts its hits without reading the routing back (about 9 µs a token of the embedded
        model's 270 on this CPU: most of what a cache with every expert resident added to stock's decode).
        False: the routing is read (``on_routing``)."""
        tables = self.tables
        if tables.fills is not None or len(tables.identity) != len(tables.layers):
            return False
        try:
            step = self.controller.on_identity_token(tables.layers.keys(), self.observers.items)
            if step is None:
                return False
            tables.apply(step)
            tables.flush()
        except BaseException as e:  # noqa: BLE001 - raised by the caller, as the callback's errors are
            self.hook.error = e
        return True

    @contextmanager
    def step(self, tokens: Sequence[int], on_error: Callable[[], None] | None = None) -> Iterator[None]:
        """One ``llama_decode`` of ``tokens``, which the caller runs (and whose logits it reads) inside the
        ``with`` block: ``begin_step`` before, ``after_decode`` after a decode that succeeded, then what the
        callback, the route op, the controller or a prefetch thread stored is raised (they never raise into C);
        from the decode's own exception when it failed, which is raised as it is otherwise. ``on_error`` runs
        before a stored error is raised (the caller forgets the sequence: this decode's KV entries are
        meaningless). The one decode step: the ``Engine``, the ``llama_cpp.Llama`` subclass and its
        multi-sequence batches all run their decode in it (a block, not a callback: the pipeline never calls
        up into its caller)."""
        self.begin_step(tokens)
        try:
            yield
        except BaseException as e:
            # a decode that raised may have left its graph running (only reading the logits synchronizes): the
            # tables, the fill words and the routing are read and written next, on a GPU through another stream
            if self._ctx_ptr:
                B.llama_cpp.llama_synchronize(self._ctx_ptr)
            self._raise_stored(on_error, e)
            raise
        self.after_decode(len(tokens))
        self._raise_stored(on_error, None)

    def _raise_stored(self, on_error: Callable[[], None] | None, cause: BaseException | None) -> None:
        err = self.take_error()
        if err is not None:
            if on_error is not None:
                on_error()
            if cause is None:
                raise err
            raise err from cause

    def take_error(self) -> BaseException | None:
        """What the callback, the route op, the controller or the prefetch worker stored (cleared)."""
        hook, err = self.hook, None
        if self._ctx_ptr:  # the op's code read in C and the callback's exception read as data: the hook's own
            code = hook.error_code(self._ctx_ptr) if hook.error_code is not None else 0  # Python runs only
            if code or hook.error is not None:  # when one was recorded (this is asked once per token)
                err = hook.error_from(code)
        if err is None and self.prefetcher is not None:
            err = self.prefetcher.take_error()
        if err is None and self.stride is not None:
            err = self.stride.take_error()
        return err

    # -- what it holds
    @property
    def stats(self) -> CacheStats | None:
        return self.runtime.cache.stats if self.runtime is not None else None

    @property
    def n_slots(self) -> dict[int, int]:
        return dict(self.runtime.cache.n_slots) if self.runtime is not None else {}

    def occupancy(self) -> dict[int, int]:
        """Resident experts per cached layer (0 .. n_slots)."""
        if self.runtime is None:
            return {}
        return {il: len(t.resident()) for il, t in self.runtime.cache.tables.items()}

    def report(self) -> dict[str, object]:
        """The cache's record since it was built, the one both drivers give (``--stats-json``,
        ``ggmoe.load().stats()["cache"]``, /metrics): the policy and the miss policy (asked, in effect and why),
        the decode mode and the prefetch (``describe``), the slots per layer and what they hold, then the
        statistics' totals and layers. Empty without a cache."""
        rt, cfg = self.runtime, self.run_config
        if rt is None or cfg is None:
            return {}
        return {"policy": cfg.cache.policy, "miss_policy": cfg.decode.miss_policy, "miss_policy_in_effect": rt.miss_policy,
                "miss_policy_note": rt.miss_policy_note, **self.describe(),
                "slots_per_layer": {str(k): v for k, v in self.n_slots.items()},
                "occupancy": {str(k): v for k, v in self.occupancy().items()}, **self._host_tier_report(),
                **self._host_part_report(), **rt.cache.stats.to_dict()}

    def _host_part_report(self) -> dict[str, object]:
        """With the host path: where its CPU part runs (a worker's threads, 0: in the main graph) and the
        worker's counters."""
        rt = self.runtime
        if rt.miss_policy == "wait":
            return {}
        from ggmoe.engine.host_part import host_part_stats

        # the async decode's host part: per layer, the experts its graph computes on the CPU while no slot holds them
        cpu_experts = {str(il): sum(mask) for il, mask in rt.cache.cpu_of.items()}
        return {"host_part": {"threads": rt.host_threads, "spin_us": rt.host_spin_us if rt.host_threads else 0,
                              "beside_link": rt.cache.cpu_beside_link,
                              "async_cpu_experts": cpu_experts, **asdict(host_part_stats(self._ctx_ptr))}}

    def _host_tier_report(self) -> dict[str, object]:
        """Under a disk tier: the host tier's size and counters, totals and per layer (else nothing)."""
        rt = self.runtime
        tier = rt.tier if rt is not None else None
        if tier is None:
            return {}
        reader = tier.reader
        return {"host_tier": {"host_slots_per_layer": tier.n_slots, "host_ram": self.run_config.tiers.host_ram,
                              "direct_io": all(f.direct for f in reader.files.values()),
                              "disk_bytes_read": reader.bytes_read, **tier.totals(),
                              "layers": {str(il): st.to_dict() for il, st in tier.stats.items()}}}

    def describe(self) -> dict[str, object]:
        """The decode mode and the miss policy, as the stats and /metrics report them."""
        if self.runtime is None:
            return {}
        mode = self.decode_mode
        return {"decode_mode": mode.asked, "decode_mode_in_effect": self.mode_in_effect,
                "decode_mode_reason": mode.reason,
                "copy_stream": self.runtime.stream.stream.name,  # immediate, deferred or events (a GPU)
                "table_writes": self.tables.writes if self.tables is not None else 0,
                "controller_tokens": self.controller.tokens if self.controller is not None else 0,
                **self._prefetch_description(),
                **({"planner": {"predictor": self.planner.predictor.name, "protect": self.planner.n_protect,
                                "runs_on": "controller" if self.planner.via_controller else "route op"}}
                   if self.planner is not None else {})}

    def _prefetch_description(self) -> dict[str, object]:
        """Where the prefetcher runs and its budget (none without a predictor)."""
        pf = self.prefetcher
        if pf is None:
            return {}
        return {"prefetch": {"predictor": pf.predictor.name, "stride": pf.predictor.stride,
                             "runs_on": "mailbox" if self.stride is not None and pf.via_mailbox else "route op",
                             "experts_per_layer": pf.limit if pf.free_only else pf.n_prefetch,
                             "keep_free": dict(self.runtime.cache.keep_free) if self.stride is not None else {},
                             # the mailbox's reader: layers read only after the layer they predict had started
                             "layers_behind": self.stride.layers_behind if self.stride is not None else 0,
                             "layers_targeted": self.stride.layers_targeted if self.stride is not None else 0,
                             # benchmarks only (GGMOE_MAILBOX_LOCKSTEP): the device waited for the host per layer
                             "lockstep": bool(self.stride is not None and self.stride.mailbox.lockstep)}}

    # -- lifecycle
    def detach(self) -> None:
        """Stop the prefetch worker, land the copies in flight and stop the copy queue, and take the callback,
        tables and predictor off the context (before it and the model are freed: a copy still in flight would read
        the model, on a GPU through its copy engine). Every step runs even when an earlier one raises; a second
        call finds nothing left to do."""
        self._teardown("context")

    def close(self) -> None:
        """Free the tables, the slot tensors and the copy stream (after the context that computed with them): off
        the context first when ``detach`` has not run, and the rest even when that raises (the runtime lands its
        copies itself). Harmless after ``detach`` and when called again."""
        self._teardown("all")

    def _teardown(self, stage: TeardownStage) -> None:
        """The one teardown path: the steps in the one order every stage (``TeardownStage``) follows, those the
        stage takes in one ExitStack, so each runs even when an earlier one raises (the error is raised once the
        last has run; of several, the last carries the earlier as its context). A step that has run leaves
        nothing for the next pass to find: a stage run again, or "all" after "context", does only what is left."""
        ctx, rt, tables, gp = self._ctx_ptr, self.runtime, self.tables, self.graph_predictor
        keep_hook = stage == "cache"  # the route hook and the observers stay on the context for the next cache
        free = stage != "context"  # else the context still computes with the slots and tables until it is freed
        steps: list[Callable[[], object]] = [self._close_stride]  # the reader before the mailbox and the tables
        if self.prefetcher is not None:
            steps.append(self.prefetcher.close)
        if keep_hook:
            steps.append(self._forget_cache)
        if rt is not None:  # copies read the model's host experts and write table entries: landed before either goes
            steps.append(rt.quiesce)
        if ctx:  # into the context only while it lives: a second pass after "context" finds it gone
            if not keep_hook:
                steps.append(partial(self.hook.uninstall, ctx))  # the route and wait callbacks
            elif rt is not None and rt.cache.defer_wait:
                steps.append(partial(self._beside_link, False))  # the wait hook only: the route hook stays
            if tables is not None:
                steps.append(tables.detach)
        if gp is not None:  # out of the context's graphs (while it lives) before its tensors go
            steps += [partial(gp.close, ctx_alive=bool(ctx)), partial(setattr, self, "graph_predictor", None)]
        if not keep_hook:
            steps.append(partial(setattr, self, "_ctx_ptr", 0))
        if free and rt is not None:
            steps.append(partial(self._free_runtime, ctx))
        if free and tables is not None:  # after the runtime: a copy may write a table entry until it lands
            steps += [tables.close, partial(setattr, self, "tables", None)]
        with ExitStack() as stack:
            for step in reversed(steps):  # an ExitStack runs its callbacks last to first
                stack.callback(step)

    def _close_stride(self) -> None:
        """Stop the mailbox's reader and take the mailbox off the context (before the context or the tables go)."""
        if self.stride is not None:
            if self._reading:
                self._reading = False
                self.stride.end_token()
            self.stride.close()
            self.stride = None
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        if self.runtime is not None:
            self.runtime.stream.flip = None  # copies put from now on write no table entry
            self.runtime.cache.keep_free = {}

    def _forget_cache(self) -> None:
        """The route hook and the observers, which stay, let go of the cache: its prefetcher, planner and host tier are no
        longer observers, and the route inputs' changes no longer turn table mode on or off."""
        own = [o for o in (self.prefetcher, self.planner, self.tier_uses) if o is not None]
        self.prefetcher = self.planner = self.tier_uses = self.controller = self.decode_mode = self.run_config = None
        self.hook.cache = self.hook.after_route = None
        self.observers.on_change = self._route_inputs  # first: the removals below tell the hook, not the tables
        for obs in own:
            self.observers.remove(obs)

    def _free_runtime(self, ctx: int) -> None:
        """Free the slot tensors and the copy stream (copies in flight land first), after a live context (``ctx``;
        0: gone) forgot the slots: it would build its next graph over freed tensors. When it cannot forget them,
        they are left allocated."""
        rt, self.runtime = self.runtime, None
        if ctx:
            rt.unregister(ctx, rt.cache.n_slots)
        rt.close()
