"""The expert cache: per-layer slot tables, hit/miss decisions, copies, statistics.

One implementation, used by the live engine (through the route callback of the
patched llama.cpp) and by the simulator (replaying traces). What a copy costs
is not its business: it submits copies to a ``CopyBackend`` and waits for the
handles a layer needs before the layer may run; time comes from an injected
``Clock``. The engine's backend issues real copies on a wall clock; the
simulator's lands them on a virtual timeline.

Each layer has a strategy: ``WholeLayer`` (below: whole experts in its slots) or ``SplitLayer``
(``ggmoe.cache.split_cache``: MoEpic's top segments). Every per-layer call goes to the layer's strategy;
the cache keeps what both share (slot tables, loads, victims, landing, cancelling, statistics, the lock and
the step log) and asks which kind a layer is only to build them.
"""

from __future__ import annotations

import threading
from bisect import insort
from collections.abc import Iterable, Mapping
from itertools import compress

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.cache.admission import Admission
from ggmoe.cache.clock import Clock, MonotonicClock
from ggmoe.cache.copy import CopyBackend, CopyHandle, NullCopyBackend, Priority
from ggmoe.cache.fill import SCORE_SCALE, Fill, FillTargets
from ggmoe.cache.miss import (
    HOST_MAX_TOKENS,
    SLOT_HOST,
    MissCosts,
    check_miss_policy,
    prefer_host,
    split_misses,
)
from ggmoe.cache.policies.base import Policy, releases
from ggmoe.cache.prefetch_book import PrefetchBook
from ggmoe.cache.slots import BottomTable, SlotTable
from ggmoe.cache.split import LayerSplit
from ggmoe.cache.split_cache import SplitLayer
from ggmoe.cache.stats import CacheStats, LayerStats
from ggmoe.cache.step import EMPTY_STEP, Flip, StepChanges, StepLog


def keep_free_slots(n_slots: Mapping[int, int], n_expert: int, n_expert_used: int, n_prefetch: int) -> dict[int, int]:
    """Free slots kept per layer between tokens for the async decode's stride prefetch (into a running graph a
    prefetch takes only a slot no entry points at): ``min(n_prefetch, n_slots - n_expert_used)``, none where
    every expert fits (``ExpertCache.keep_free_cap`` asks each layer's strategy)."""
    return {il: _kept_free(n, n_expert, n_expert_used, n_prefetch) for il, n in n_slots.items()}


def _check_slots(n_slots: Mapping[int, int], n_expert: int, n_expert_used: int) -> None:
    """Every layer's slots hold a token's experts and no more than the layer has."""
    for il, n in n_slots.items():
        if n < n_expert_used:
            raise UsageError(f"layer {il}: {n} cache slots < n_expert_used {n_expert_used}: "
                             "a token could not have all its experts resident")
        if n > n_expert:
            raise UsageError(f"layer {il}: {n} cache slots > n_expert {n_expert}")


class ExpertCache(Admission, PrefetchBook):
    """Slot tables for every MoE layer, driven by a policy; ``route`` maps ids to slots."""

    def __init__(self, n_expert: int, n_expert_used: int, n_slots: dict[int, int], policy: Policy,
                 copies: CopyBackend | None = None, bytes_per_expert: dict[int, int] | None = None,
                 clock: Clock | None = None, miss_policy: str = "wait", costs: MissCosts | None = None,
                 split: Mapping[int, LayerSplit] | None = None, n_bottom: int = 0) -> None:
        """``split``: the layers whose slots hold top segments (MoEpic, ``ggmoe.cache.split``), each with
        ``n_bottom`` bottom buffers for prefetched bottoms."""
        _check_slots(n_slots, n_expert, n_expert_used)
        self.n_expert = n_expert
        self.n_expert_used = n_expert_used
        self.n_slots = dict(n_slots)
        self.policy = policy
        self.copies = copies or NullCopyBackend()
        self.time = clock or MonotonicClock()
        self.bytes_per_expert = bytes_per_expert or {}
        self.tables = {il: SlotTable(n_expert, n) for il, n in n_slots.items()}
        self.stats = CacheStats({il: LayerStats() for il in n_slots})
        self.clock = 0  # access counter: one per routed layer call
        self._bind_hooks()
        self.miss_policy = check_miss_policy(miss_policy)
        self.costs = costs  # for "auto"
        # the CPU computes a layer's host misses while the link copies its others (the simulator's hybrid
        # decode): ``auto`` then splits new misses between the two (``miss.split_misses``); False (the engine's
        # sync decode, which waits for copies before the graph's CPU part): each miss to its sooner server
        self.cpu_beside_link = False
        # the engine's wait hook (patch 0015) ends a layer call after its CPU part has started: a call with host
        # entries and copies to wait for leaves (copies, needed experts, host experts) here for ``finish_wait``
        self.defer_wait = False
        self.deferred: dict[int, tuple[list[CopyHandle], list[int], set[int]]] = {}
        self._submitted: dict[int, float] = {}  # copy handle id -> clock time it was submitted (s)
        self.log: StepLog | None = None  # the flips and copies the expert tables follow (``follow_tables``)
        self.lock = threading.Lock()
        self.n_prefetched = dict.fromkeys(n_slots, 0)  # il -> slots holding an unused prefetched expert
        self.predicted: dict[int, list[int]] = {}  # il -> experts predicted for its next call (accuracy)
        self.token = 0  # async decode: tokens seen by the controller (the epoch of a copy's submission)
        # async decode with stride prefetch (the mailbox): free slots kept per layer between tokens, into which
        # prefetches go while a graph runs (a slot that no entry points at); 0: none kept
        self.keep_free: dict[int, int] = {}
        # async decode with the mailbox: per layer, the experts whose slot was readable when the host saw the
        # layer start (what the device read from slots); after_token counts hits from it
        self._seen: dict[int, set[int]] = {}
        self._submit_token: dict[int, int] = {}  # copy handle id -> token it was submitted at
        # the planner between tokens (ggmoe.control.planner): per layer, the experts it expects at the layer's
        # next call, likeliest first. Admissions between tokens follow this order, and neither they, nor the
        # free slots kept for prefetches, nor a prefetch at a token's start (the prefetcher's keep) evict any.
        self.planned: dict[int, list[int]] = {}
        # prefetches issued plus their outcomes (used, wasted, late) counted so far, every layer: the async
        # prefetcher's budget looks at the layers only when this moved
        self.prefetch_events = 0
        # in-graph fills (the async decode, patch 0012): slots per layer and token the graph may fill (0: none), the targets
        # handed to the graph before a decode, and what it read back as filled, settled by after_token
        self.fill_slots = 0
        # the async decode's host part (patch 0016): per layer, [n_expert] True for the experts its graph computes
        # on the CPU whenever no slot holds them (``ggmoe.cache.miss.async_cpu_experts``); no entry: none
        self.cpu_of: dict[int, list[bool]] = {}
        self.fill_targets: dict[int, FillTargets] = {}
        self._filled: dict[int, list[Fill]] = {}
        self._build_layers(dict(split or {}), n_bottom)

    def _build_layers(self, split: dict[int, LayerSplit], n_bottom: int) -> None:
        """Each layer's strategy, and what follows from them (the one place that asks which kind a layer is)."""
        unknown = sorted(set(split) - set(self.n_slots))
        if unknown:
            raise UsageError(f"split layers {unknown} have no cache slots")
        if split and self.miss_policy != "wait":
            raise UsageError("split experts read what is not cached from host memory through the expert table: "
                             "the miss policy must be wait, not the host path")
        self.split = split  # il -> the split layer's top/bottom geometry
        self.bottoms = {il: BottomTable(self.n_expert, n_bottom) for il in split} if n_bottom > 0 else {}
        # each layer's strategy: whole experts in its slots, or MoEpic's tops (the cache asks it, never which)
        self.layers: dict[int, WholeLayer | SplitLayer] = {
            il: SplitLayer(self, il, split[il], self.bottoms.get(il)) if il in split else WholeLayer(self, il)
            for il in self.n_slots}
        # where the async decode's stride prefetch can ever put something (``has_free_slot``): whole-expert layers
        # that cannot hold every expert, split layers with bottom buffers; the tables are fixed for the cache's life
        self.prefetch_layers = tuple(il for il, layer in self.layers.items() if layer.can_prefetch)
        self.partial_layers = tuple(il for il in self.prefetch_layers if il not in split)
        # every layer whole-expert with a slot for every expert, under a policy that keeps what it loads: the
        # async decode's controller counts its hits without the per-layer step (``after_one_token``)
        self.roomy = not self.partial_layers and not split and not self.policy_releases
        # bytes one copy into a slot moves: a whole expert, or a split layer's top segment
        self.slot_bytes = {il: layer.slot_bytes for il, layer in self.layers.items()}

    def _bind_hooks(self) -> None:
        """The policy's and the copy backend's optional hooks, looked up once rather than per call."""
        policy, copies = self.policy, self.copies
        # whether the policy drops experts after a call (on-demand)
        self.policy_releases = releases(policy)
        # the policy's insert and evict hooks, None where it keeps the base class's (which does nothing): the
        # hottest loops skip the call
        self._on_insert = policy.on_insert if type(policy).on_insert is not Policy.on_insert else None
        self._on_evict = policy.on_evict if type(policy).on_evict is not Policy.on_evict else None
        # the policy's several victims at once (one sort instead of a scan per eviction), where it has them
        self._pick_victims = policy.victims if type(policy).victims is not Policy.victims else None
        # the policy's filter on admissions of misses served without a slot (None: it admits all, the default),
        # and its form for the in-graph fills (a score per expert)
        self._admits = policy.admit if type(policy).admit is not Policy.admit else None
        self._scores = policy.admit_scores if type(policy).admit_scores is not Policy.admit_scores else None
        # the copy queue's (None: the backend has no queue)
        self._promote = getattr(copies, "promote", None)
        self._remaining = getattr(copies, "remaining_s", None)
        # whether a copy never lands within the call that submits it (a simulated link with a cost model):
        # after_token then need not look for copies its own admissions landed
        self._lands_later = bool(getattr(copies, "lands_later", False))
        # demand_now(il, n): n demand copies of layer il run and waited for at once, without handles, when the
        # backend's queue is empty (the simulated link); False, having done nothing, when it is not
        self._demand_now = getattr(copies, "demand_now", None)

    def follow_tables(self) -> None:
        """From now on every change of what is readable where goes into a step log (``ggmoe.cache.step``): the
        async decode's expert tables follow it through ``take_step``; the first step maps every landed slot."""
        with self.lock:
            if self.log is not None:
                return
            self.log = log = StepLog()
            for il, table in self.tables.items():
                table.log, table.il = log, il
                log.flips.extend(Flip(il, e, slot) for slot, e in enumerate(table.expert_in_list)
                                 if e >= 0 and table.copy[slot] is None)
            for il, bt in self.bottoms.items():
                bt.log, bt.il = log, il

    def take_step(self) -> StepChanges:
        """The flips and copies since the last step, as one record for the executor (``EMPTY_STEP`` when nothing
        follows the tables or nothing changed)."""
        log = self.log
        if log is None or not (log.flips or log.copies):  # nothing to take (once per routed layer: no lock)
            return EMPTY_STEP
        with self.lock:
            return log.take()

    def fits(self, il: int, n_tokens: int) -> bool:
        """Whether a micro-batch of ``n_tokens`` runs on the cache (else the native path)."""
        return self.layers[il].fits(n_tokens)

    def route(self, il: int, ids: np.ndarray) -> np.ndarray:
        """ids [n_tokens, n_expert_used] -> slots [n_tokens, n_expert_used] int32, experts resident."""
        slots = self.route_flat(il, ids.ravel().tolist())
        return np.asarray(slots, dtype=np.int32).reshape(ids.shape)

    def route_flat(self, il: int, flat: list[int], next_use: Mapping[int, float] | None = None) -> list[int]:
        """``route`` on a flat list of ids (the engine's hot path: no numpy per call): a slot per id, or
        ``SLOT_HOST`` for an expert the CPU computes; the ids themselves for a split layer, read through the
        table. ``next_use`` (expert -> access number of its next use) reaches the policy when the caller knows it."""
        with self.lock:  # a prefetch worker may be placing experts (uncontended: about 0.1 us)
            return self.layers[il].route(flat, next_use)

    def finish_wait(self, il: int) -> None:
        """The wait hook of layer ``il``: ends a call ``route_flat`` left waiting (nothing to do otherwise)."""
        if il not in self.deferred:  # the common call: nothing was left waiting
            return
        with self.lock:
            deferred = self.deferred.pop(il, None)
            if deferred is None:
                return
            t0 = self.time.now()
            st = self.stats.layers[il]
            self.layers[il].finish(st, *deferred)
            st.hook_s += self.time.now() - t0

    def _wait_for(self, st: LayerStats, table: SlotTable, pending: list[CopyHandle]) -> None:
        """The layer waits until ``pending`` (its demand copies and the copies in flight it reads) landed."""
        promote = self._promote
        if promote is not None:  # queued behind prefetches or admissions: the layer waits for these
            for h in pending:
                if h.priority is not Priority.DEMAND:  # a demand copy is served first already
                    promote(h)
        tw = self.time.now()
        self.copies.wait(pending)
        st.wait_s += self.time.now() - tw
        submitted, submit_token = self._submitted, self._submit_token
        for h in pending:
            table.landed(h.slot)
            submitted.pop(h.id, None)
            submit_token.pop(h.id, None)

    @staticmethod
    def _score_guess(st: LayerStats, guess: list[int], need: list[int]) -> None:
        """A predictor's guess for this call (``score_prediction``) against what it used."""
        st.pred_total += len(guess)
        st.pred_correct += len(set(guess) & set(need))

    def _release(self, il: int, table: SlotTable, resident: list[int]) -> None:
        """A policy that keeps nothing (on-demand): drop what it releases of ``resident``."""
        slot_of = table.slot_of_list
        for e in self.policy.release(il, resident):
            self.policy.on_evict(il, e)
            self._note_eviction(il, table, slot_of[e])
            table.drop(slot_of[e])

    def after_token(self, il: int, flat: list[int]) -> None:
        """The async decode's step for one layer of one decoded micro-batch (between tokens, no graph running).

        ``flat``: the experts the layer selected, read through the expert table as it stood at launch: those
        READY in a slot were hits, the rest misses the device read from host memory. Copies that landed since
        the last token become readable (flips pointing their entries at the slots), then every missing
        expert is admitted at low priority into a free slot or the policy's victim (its entry back to host
        memory first). Nothing waits: a later token finds the admitted experts once their copies landed.
        """
        with self.lock:
            self.layers[il].after_token(flat)

    def after_one_token(self, layers: Iterable[int], rows_of: list[list[list[int]]]) -> int:
        """``after_token`` of every layer in ``layers`` for one decoded token (``rows_of[il][0]``: layer ``il``'s
        experts, -1 where the layer computed no token) in one call under one lock; returns the calls handled.

        In a ``roomy`` cache (every layer whole-expert with a slot for every expert) a layer with nothing loading
        and nothing prefetched, whose experts were all resident, only counts its hits; any other layer takes the
        per-layer path. A roomy cache never evicts (a miss always finds a free slot), so the policy, which only
        ranks victims, is not told of such accesses: nothing will ever ask for its ranks. One call a token instead
        of one a layer: on the embedded model about 0.3 µs a layer of the 3 µs that the per-layer step costs."""
        n = 0
        with self.lock:
            predicted, tables, n_prefetched, roomy = self.predicted, self.tables, self.n_prefetched, self.roomy
            for il in layers:
                flat = rows_of[il][0]
                if flat[0] < 0:  # the layer computed no token (llama.cpp's output skipping)
                    continue
                n += 1
                table = tables[il]
                if not roomy or table.n_loading or n_prefetched[il] or -1 in map(table.slot_of_list.__getitem__, flat):
                    self.layers[il].after_token(flat)
                    continue
                st = self._count_resident(il, len(set(flat)))
                if predicted and il in predicted:  # the stride prefetcher's guess, scored as in sync
                    self._score_guess(st, predicted.pop(il), sorted(set(flat)))
        return n

    def after_identity_token(self, layers: Iterable[int]) -> None:
        """``after_one_token`` of a roomy cache's decoded token whose ``layers`` were all read with identity (patch 0017:
        every expert resident in its own slot, nothing loading): each layer's ``n_expert_used`` experts were
        hits, whichever they were (a token's top-k are distinct), so the routing need not be read."""
        with self.lock:
            for il in layers:
                self._count_resident(il, self.n_expert_used)

    def _count_resident(self, il: int, n_hits: int) -> LayerStats:
        """One call of layer ``il`` whose ``n_hits`` distinct experts were all resident (lock held)."""
        self.clock += 1
        st = self.stats.layers[il]
        st.calls += 1
        st.hits += n_hits
        return st

    @property
    def fill_layers(self) -> tuple[int, ...]:
        """The layers whose misses the graph may fill: whole experts, fewer slots than experts, a policy that
        keeps what it loads (a layer with a slot for every expert admits each miss once and never evicts)."""
        return () if self.policy_releases else self.partial_layers

    def offer_fills(self, n_tokens: int = 1) -> tuple[FillTargets, ...]:
        """Before a table-mode decode of ``n_tokens`` tokens: each fill layer's fill slots (``fill_slots`` per token:
        free slots beyond those kept for the stride prefetch, then the policy's victims), reserved until the
        decode's fills are settled. Plans of an earlier decode that were never settled are settled first, with
        what it filled (``take_fills``). ``n_tokens`` 0: only that (a decode that does not read through the
        tables)."""
        with self.lock:
            for il in list(self.fill_targets):
                self.layers[il].settle_fill(self.fill_targets.pop(il), self._filled.pop(il, []))
            n = self.fill_slots * n_tokens
            if n <= 0:
                return ()
            targets = []
            for il in self.fill_layers:
                t = self.layers[il].offer_fill(n)
                if t.slots:
                    self.fill_targets[il] = t
                    targets.append(t)
            return tuple(targets)

    def preload(self) -> int:
        """Every expert of a ``roomy`` cache (a slot for each, in every layer) copied in now and landed, so the
        decode starts warm: no expert's first use is a miss read in place and then admitted. Returns how many
        were loaded (none for a cache that is not roomy)."""
        if not self.roomy:
            return 0
        n = 0
        with self.lock:
            for il, table in self.tables.items():
                missing = [e for e in range(self.n_expert) if table.slot_of_list[e] < 0]
                handles = self._load(il, table, [], missing, Priority.ADMISSION)
                self._land_all(table)
                self.stats.layers[il].preloaded += len(handles)
                n += len(handles)
        return n

    def take_fills(self, fills: Iterable[Fill]) -> None:
        """What the decode's graph filled (read back, or ``assign``-ed by the simulator): ``after_token`` of each
        layer settles them (the experts placed, their slots' experts evicted, no admission copies)."""
        with self.lock:
            for f in fills:
                self._filled.setdefault(f.il, []).append(f)

    def plan_next(self, il: int, experts: list[int]) -> None:
        """The planner's experts for layer ``il``'s next call, likeliest first (empty: no plan); see ``planned``."""
        with self.lock:
            self.planned[il] = experts

    def has_free_slot(self) -> bool:
        """Whether some whole-expert layer that cannot hold all its experts has a free slot (a prefetch into a
        running graph could go there and pay). A layer with a slot for every expert admits each miss between
        tokens and never evicts: a prefetch there could save only an expert's first miss, at most ``n_expert``
        hits in a whole session, never worth the mailbox reader's CPU."""
        return any(self.has_room(il) for il in self.prefetch_layers)

    def has_room(self, il: int) -> bool:
        """Whether a prefetch into layer ``il`` could go somewhere while a graph runs: a free slot of a
        whole-expert layer that cannot hold every expert, or an empty bottom buffer of a split layer."""
        layer = self.layers.get(il)
        return layer is not None and layer.has_room()

    def keep_free_cap(self, n_prefetch: int) -> dict[int, int]:
        """Most free slots kept per layer between tokens for the async decode's stride prefetch: ``keep_free_slots``
        for whole-expert layers; a split layer's empty bottom buffers (its tops are admitted between tokens
        only), none without buffers."""
        return {il: layer.keep_free_cap(n_prefetch) for il, layer in self.layers.items()}

    def seen_start(self, il: int, flat: list[int]) -> None:
        """Async decode with the mailbox: layer ``il`` has started with experts ``flat`` (the device reads their
        entries now). Copies that landed are marked (their entries flipped stream-ordered already); the experts
        readable now are what the layer read from slots, the rest it read from host memory. A prefetch that had
        not landed was late."""
        with self.lock:
            layer = self.layers.get(il)
            if layer is not None:
                layer.seen_start(flat)

    @staticmethod
    def _in_flight(table: SlotTable, need: list[int]) -> list[CopyHandle]:
        """Copies still landing into slots this call reads (a slot is read only after its copy landed)."""
        out = []
        for e in need:
            s = table.slot_of_list[e]
            if s >= 0 and table.copy[s] is not None:
                out.append(table.copy[s])
        return out

    @staticmethod
    def _victims(table: SlotTable, in_use: set[int]) -> list[int]:
        """Resident experts that may be evicted, ascending: not used by this call, not still loading."""
        if not table.n_loading:  # no copy in flight: set operations in C instead of a loop over the slots
            out = sorted(set(table.expert_in_list).difference(in_use))
            if out and out[0] < 0:  # -1: the empty slots
                del out[0]
            return out
        copy = table.copy
        out = [x for s, x in enumerate(table.expert_in_list) if x >= 0 and copy[s] is None and x not in in_use]
        out.sort()  # a policy's ties go to the lowest expert id
        return out

    def land_ready(self) -> None:
        """Right before the next token launches (async decode): copies that landed since the last token boundary
        become readable for it, so a copy that lands between two tokens serves the very next one instead of
        the one after. A readiness query per copy in flight; nothing waits."""
        with self.lock:
            for layer in self.layers.values():
                layer.land()

    def land_done(self, table: SlotTable) -> None:
        """Mark every copy that has landed since the last look (their slots may be read and evicted again)."""
        done, copy = self.copies.done, table.copy
        for slot in compress(range(len(copy)), copy):  # the slots with a copy in flight, found in C
            h = copy[slot]
            if done(h):
                table.landed(slot)
                self._submitted.pop(h.id, None)
                st = self.stats.layers[h.il]
                st.landed += 1
                st.lag_tokens += self.token - self._submit_token.pop(h.id, self.token)

    def _candidates(self, il: int, table: SlotTable, need: list[int], priority: Priority, n: int) -> list[int]:
        """``_load``'s victims for its ``n`` copies left (empty: none for a low-priority copy): the experts that
        may be evicted, or, for a policy that picks several at once (``Policy.victims``), its picks in reverse
        order (taken from the end)."""
        cand = self._victims(table, set(need))  # never evict what this call uses
        if not cand and priority == Priority.DEMAND:
            self._land_all(table)  # a demand copy may take a slot whose copy landed
            cand = self._victims(table, set(need))
        if cand and self._pick_victims is not None:
            cand = self._pick_victims(il, cand, n, self.clock)[::-1]
        return cand

    def _land_all(self, table: SlotTable) -> None:
        handles = [h for h in table.copy if h is not None]
        self.copies.wait(handles)
        for h in handles:
            table.landed(h.slot)
            self._submitted.pop(h.id, None)
            self._submit_token.pop(h.id, None)

    def observe(self, il: int, ids: np.ndarray | list[int]) -> None:
        """A micro-batch that ran the native path: counted; the layer's strategy decides what it leaves behind
        (a whole-expert layer nothing, a split layer its experts' tops)."""
        st = self.stats.layers[il]
        st.calls += 1
        st.native_calls += 1
        with self.lock:
            self.layers[il].observe(ids)

    def _load(self, il: int, table: SlotTable, need: list[int], missing: list[int],
              priority: Priority, reserve: int = 0, direct: bool = False) -> list[CopyHandle]:
        """Copies of ``missing`` into free slots or the policy's victims (never a slot this call reads);
        ``reserve`` free slots are left for the async decode's prefetches. ``direct``: the copies have landed
        already (``_load_now``): the experts are placed ready, no copy submitted, no handle returned."""
        policy, submit, token, clock = self.policy, self.copies.submit, self.token, self.clock
        on_insert, on_evict = self._on_insert, self._on_evict
        free, prefetched, log = table.free, table.prefetched, table.log  # log: the step's copies (None: nobody follows)
        submitted, submit_token = self._submitted, self._submit_token
        # a demand copy is waited for by the call that submits it (_wait_for): its age and token never matter
        record = priority is not Priority.DEMAND
        now = self.time.now() if record else 0.0  # s; one reading for the call's copies
        handles = []
        cand: list[int] | None = None  # victims, computed once (a miss's own copy is in use, so never one)
        batch = self._pick_victims
        evicted = n = 0
        for i, e in enumerate(missing):
            if len(free) > reserve:
                slot = free.pop(0)
            else:
                if not cand:
                    cand = self._candidates(il, table, need, priority, len(missing) - i)
                    if not cand:
                        break  # every other slot is in use or still loading: no room for a low-priority copy
                if batch is not None:
                    victim = cand.pop()  # the policy's next pick
                else:
                    victim = policy.victim(il, cand, clock)
                    cand.remove(victim)
                slot = table.slot_of_list[victim]
                if on_evict is not None:
                    on_evict(il, victim)
                evicted += 1
            if prefetched[slot]:
                self._note_eviction(il, table, slot)
            n += 1  # (place writes the victim's flip to host memory, applied with the step before any graph reads)
            if direct:
                table.place(e, slot, None)
            else:
                h = submit(il, e, slot, priority)
                if log is not None:
                    log.copies.append(h)
                if record:
                    submitted[h.id] = now
                    submit_token[h.id] = token
                table.place(e, slot, h)
                handles.append(h)
            if on_insert is not None:
                on_insert(il, e, clock)
        st = self.stats.layers[il]
        st.evictions += evicted
        st.bytes_copied += self.slot_bytes[il] * n
        return handles


def _kept_free(n_slots: int, n_expert: int, n_expert_used: int, n_prefetch: int) -> int:
    """Free slots one whole-expert layer keeps between tokens (``keep_free_slots``)."""
    return 0 if n_slots >= n_expert else min(n_prefetch, n_slots - n_expert_used)


class WholeLayer:
    """Layer ``il`` of one cache, whose slots hold whole experts: one of the cache's two per-layer strategies
    (the other is ``ggmoe.cache.split_cache.SplitLayer``). The cache calls it under its lock; the slot
    machinery both strategies share (loads, victims, landing, cancelling) stays on the cache."""

    def __init__(self, cache: ExpertCache, il: int) -> None:
        self.cache, self.il = cache, il
        self.table = cache.tables[il]
        self.slot_bytes = cache.bytes_per_expert.get(il, 0)  # bytes one copy into a slot moves: a whole expert
        # a layer that cannot hold every expert: the only kind a prefetch into a running graph can pay in
        self.can_prefetch = self.table.n_slots < cache.n_expert

    def fits(self, n_tokens: int) -> bool:
        """Whether a micro-batch's distinct experts always fit the slots (else the native path)."""
        c = self.cache
        return min(n_tokens * c.n_expert_used, c.n_expert) <= self.table.n_slots

    def route(self, flat: list[int], next_use: Mapping[int, float] | None) -> list[int]:
        """The sync route: a slot per id, its expert resident, or ``SLOT_HOST`` (-1) for an expert the CPU
        computes (miss policy ``cpu`` or ``auto``, micro-batches of at most ``HOST_MAX_TOKENS`` tokens).

        The rarer concerns (copies in flight, the host path, on-demand release) are their own methods; the
        common call (hits, demand misses) stays in this one, whose every line runs a million times in a long
        replay."""
        c, il, table = self.cache, self.il, self.table
        t0 = c.time.now()
        st = c.stats.layers[il]
        if c.deferred and il in c.deferred:  # a decode that stopped before its wait hook: that call ends first
            self.finish(st, *c.deferred.pop(il))
        c.clock += 1
        st.calls += 1
        need = sorted(set(flat))  # distinct experts, ascending
        if len(need) > len(table.expert_in_list):
            raise UsageError(f"layer {il}: {len(need)} distinct experts do not fit {table.n_slots} slots "
                             "(the caller should have used the native path)")
        if next_use is not None:
            c.policy.set_future(il, next_use)
        slot_of = table.slot_of_list
        missing = [e for e in need if slot_of[e] < 0]
        st.hits += len(need) - len(missing)
        st.misses += len(missing)
        pending = self._in_flight_now(need) if table.n_loading else []
        if c.n_prefetched[il]:
            c.count_prefetch_hits(il, table, need)
        host: set[int] = set()
        if c.miss_policy != "wait" and len(flat) <= HOST_MAX_TOKENS * c.n_expert_used:
            host, pending, missing = self._to_host(pending, missing, len(need))
        if missing and not pending and not host and c._demand_now is not None and table.log is None:
            self._load_now(st, need, missing)
        elif missing:
            loaded = c._load(il, table, need, missing, Priority.DEMAND)
            pending += loaded
            st.demand_copies += len(loaded)
        # a slot's expert is fixed once loading: the answer does not wait for the copies it names
        slots = [SLOT_HOST if e in host else slot_of[e] for e in flat] if host else [slot_of[e] for e in flat]
        if pending and host and c.defer_wait:  # the wait hook waits, after the CPU part has started
            c.deferred[il] = (pending, need, host)
            st.deferred_waits += 1
        else:
            self.finish(st, pending, need, host)
        st.hook_s += c.time.now() - t0
        return slots

    def finish(self, st: LayerStats, pending: list[CopyHandle], need: list[int], host: set[int]) -> None:
        """The call's end once its slots are answered: wait for the copies it reads, admit what the CPU computes,
        tell the policy. In the call itself, or in the wait hook when the CPU part runs meanwhile."""
        c, il, table = self.cache, self.il, self.table
        if pending:
            c._wait_for(st, table, pending)
        if host:
            self._admit_host(st, need, host)
        if il in c.predicted:
            c._score_guess(st, c.predicted.pop(il), need)
        c.policy.on_access(il, need, c.clock)
        if c.policy_releases and table.holds_any():
            c._release(il, table, table.resident())

    def _in_flight_now(self, need: list[int]) -> list[CopyHandle]:
        """Before a call reads its slots: copies that landed are marked, queued prefetches it does not need
        are cancelled; the copies still landing into slots it reads."""
        c, table = self.cache, self.table
        c.land_done(table)
        c.drop_stale_prefetches(self.il, table, need)
        return c._in_flight(table, need) if table.n_loading else []

    def _load_now(self, st: LayerStats, need: list[int], missing: list[int]) -> None:
        """The demand copies of ``missing``, waited for at once, when the backend can run them without handles
        (``demand_now``: nothing else queued on the simulated link, the sync decode's common call): the same slots,
        victims and time as ``_load`` then ``_wait_for``, without a handle or a job per copy."""
        c, il, table = self.cache, self.il, self.table
        tw = c.time.now()
        if not c._demand_now(il, len(missing)):  # something is queued: copies must be jobs among the others
            loaded = c._load(il, table, need, missing, Priority.DEMAND)
            st.demand_copies += len(loaded)
            c._wait_for(st, table, loaded)
            return
        st.wait_s += c.time.now() - tw
        c._load(il, table, need, missing, Priority.DEMAND, direct=True)
        st.demand_copies += len(missing)

    def _admit_host(self, st: LayerStats, need: list[int], host: set[int]) -> None:
        """The host path computed ``host`` on the CPU this call: admit them at low priority for a later token."""
        c, table = self.cache, self.table
        st.host_computed += len(host)
        if c.policy_releases:  # a policy that keeps nothing (on-demand) would drop the admitted copy unread
            return
        slot_of = table.slot_of_list
        admit = c.admissible(self.il, table, need, [e for e in host if slot_of[e] < 0])
        # At most n_expert_used admissions in flight per layer: on a link slower than the CPU, queued
        # admissions would pile up, each holding a slot while it waits.
        room = c.n_expert_used - sum(1 for h in table.copy if h is not None and h.priority is Priority.ADMISSION)
        admit = admit[: max(room, 0)]
        if admit:  # low priority: a later token finds them; the current call computes them on the CPU
            st.admission_copies += len(c._load(self.il, table, need, admit, Priority.ADMISSION))

    def _to_host(self, pending: list[CopyHandle], missing: list[int], n_need: int
                 ) -> tuple[set[int], list[CopyHandle], list[int]]:
        """Split misses and copies in flight between the CPU and waiting, as the miss policy says (``n_need``:
        the call's distinct experts)."""
        c = self.cache
        nbytes = self.slot_bytes
        host: set[int] = set()
        keep: list[CopyHandle] = []
        now = c.time.now() if pending or c.cpu_beside_link else 0.0  # read only where a copy's age or a split asks
        remaining = c._remaining
        for h in pending:
            if c.copies.done(h):
                keep.append(h)
                continue
            left = remaining(h) if remaining is not None else None
            if left is None and c.costs is not None:  # no queue to ask: the copy's own time, less its age
                left = max(0.0, c.costs.copy_s(nbytes) - (now - c._submitted.get(h.id, now)))
            if prefer_host(c.miss_policy, c.costs, nbytes, left):
                host.add(h.expert)  # its slot stays LOADING; a later call reads it once landed
            else:
                keep.append(h)
        if c.cpu_beside_link and c.miss_policy == "auto" and c.costs is not None and missing:
            return self._split_beside(host, keep, missing, now, n_need)
        if prefer_host(c.miss_policy, c.costs, nbytes, None):  # a miss not yet copying: the same answer for each
            host.update(missing)
            return host, keep, []
        return host, keep, missing

    def _split_beside(self, host: set[int], keep: list[CopyHandle], missing: list[int], now: float, n_need: int
                      ) -> tuple[set[int], list[CopyHandle], list[int]]:
        """``auto`` with the CPU beside the link: the new misses split so that the GPU's side (the copies this call
        waits for, the new ones, then every expert not on the CPU computed on the GPU) and the CPU (the copies in
        flight it took over, then its share) finish together. The highest ids go to the CPU: any k of them cost
        the same, and a fixed choice keeps replays reproducible."""
        c = self.cache
        costs, nbytes, remaining = c.costs, self.slot_bytes, c._remaining
        link_busy = 0.0  # s until the last copy this call waits for lands (the new misses queue behind them)
        for h in keep:
            if c.copies.done(h):
                continue
            left = remaining(h) if remaining is not None else None
            if left is None:
                left = max(0.0, costs.copy_s(nbytes) - (now - c._submitted.get(h.id, now)))
            link_busy = max(link_busy, left)
        gpu_s = costs.gpu_s(nbytes)
        others = n_need - len(host) - len(missing)  # the GPU computes these whatever the split
        k = split_misses(len(missing), costs.copy_s(nbytes) + gpu_s, costs.cpu_s(nbytes), link_busy + others * gpu_s,
                         len(host) * costs.cpu_s(nbytes), costs.host_split_s)
        if k:
            host.update(missing[len(missing) - k:])
        return host, keep, missing[:len(missing) - k]

    def after_token(self, flat: list[int]) -> None:
        """The async decode's step for this layer (``ExpertCache.after_token``, under the cache's lock)."""
        c, il, table = self.cache, self.il, self.table
        st = c.stats.layers[il]
        c.clock += 1
        st.calls += 1
        need = sorted(set(flat))
        seen = c._seen.pop(il, None)
        if seen is not None:  # the mailbox saw the layer start: what was readable then is what it read
            missing = [e for e in need if e not in seen]
        else:
            slot_of, copy = table.slot_of_list, table.copy
            missing = [e for e in need if slot_of[e] < 0 or copy[slot_of[e]] is not None]
        n_miss = len(missing)
        st.hits += len(need) - n_miss
        targets = c.fill_targets.pop(il, None) if c.fill_targets else None
        if targets is not None:  # the graph filled some misses: placed, never admitted
            filled = self.settle_fill(targets, c._filled.pop(il, []))
            if filled:
                missing = [e for e in missing if e not in filled]
            st.misses += n_miss - len(missing)
            n_miss = len(missing)
        if n_miss:  # (a token whose experts were all readable skips the host-read counts: the hot path)
            st.misses += n_miss
            cpu = c.cpu_of.get(il) if c.cpu_of else None
            on_cpu = sum(map(cpu.__getitem__, missing)) if cpu is not None else 0  # the graph's host part's
            st.host_computed += on_cpu
            st.host_reads += n_miss - on_cpu
            st.host_read_bytes += (n_miss - on_cpu) * self.slot_bytes
        loading = table.n_loading
        if loading:
            c.land_done(table)
        c.policy.on_access(il, need, c.clock)
        if c.predicted and il in c.predicted:  # the stride prefetcher's guess, scored as in sync
            c._score_guess(st, c.predicted.pop(il), need)
        if c.n_prefetched[il]:
            c.count_prefetch_hits(il, table, [e for e in need if e not in missing] if n_miss else need)
        keep_free = c.keep_free.get(il, 0) if c.keep_free else 0  # free slots kept for prefetches
        if n_miss or loading or c.policy_releases:  # else nothing to admit, drop or release
            c.admit_after(il, table, need, missing, keep_free)
            if table.n_loading and not c._lands_later:  # a synchronous backend (the CPU build's memcpy)
                c.land_done(table)  # has landed them already
        if keep_free:
            self._make_room(need + c.planned.get(il, []), keep_free)

    def offer_fill(self, n: int) -> FillTargets:
        """``n`` fill slots for the next decode (``ExpertCache.offer_fills``): free slots beyond the stride
        prefetch's (taken off the free list until settled), then victims in the policy's order (never a planned
        expert, an unused prefetch or a slot still loading)."""
        c, il, table = self.cache, self.il, self.table
        if table.n_loading:
            self._reclaim_admissions()
        keep = c.keep_free.get(il, 0) if c.keep_free else 0
        free = table.free
        slots = free[keep:keep + n]
        del free[keep:keep + len(slots)]
        held = [-1] * len(slots)
        want = n - len(slots)
        if want > 0:
            slot_of = table.slot_of_list
            cand = c._victims(table, set(c.planned[il]) if c.planned.get(il) else set())
            if c.n_prefetched[il]:  # (no unused prefetch in the layer: nothing to leave out, the common case)
                cand = [x for x in cand if not table.prefetched[slot_of[x]]]
            for victim in c.policy.victims(il, cand, want, c.clock):  # first evicted first (nothing evicted yet)
                slots.append(slot_of[victim])
                held.append(victim)
        if c._scores is None or not any(h >= 0 for h in held):
            return FillTargets(il, tuple(slots), tuple(held))
        # the policy's admission filter: a miss takes a victim's slot only when it scores above the victim
        score = tuple(int(x * SCORE_SCALE) for x in c._scores(il))
        return FillTargets(il, tuple(slots), tuple(held), tuple(score[h] if h >= 0 else -1 for h in held), score)

    def _reclaim_admissions(self) -> None:
        """Admissions still queued (not started) are cancelled before a fill offer and their slots freed: a fill
        brings a miss in the graph with one crossing, where an admission is its second; and a layer whose slots
        all wait for admissions would have no fill slot, read every miss in place, admit it again, and so on.
        An expert of the async decode's host part (``cpu_of``) is never filled: its admission is its only way into
        a slot, and stays queued."""
        c, il, table = self.cache, self.il, self.table
        cpu = c.cpu_of.get(il) if c.cpu_of else None
        dropped = c._cancel_where(table.copy, Priority.ADMISSION,
                                  (lambda h: True) if cpu is None else (lambda h: not cpu[h.expert]))
        if dropped:
            c.stats.layers[il].admissions_dropped += len(dropped)
            for slot in dropped:
                if c._on_evict is not None:
                    c._on_evict(il, table.expert_in_list[slot])
                table.drop(slot)

    def settle_fill(self, targets: FillTargets, fills: list[Fill]) -> set[int]:
        """The graph's fills of one decode (the slots of ``targets``): each expert is placed ready in its slot (no copy
        follows) and the slot's expert evicted; unused free slots go back to the free list. Returns the experts
        filled. An expert a stride prefetch placed elsewhere while the graph ran keeps that slot: the fill slot
        is freed, and its entry is written again (the graph pointed it at the fill slot)."""
        c, il, table = self.cache, self.il, self.table
        st = c.stats.layers[il]
        filled, used = set(), set()
        for f in fills:
            used.add(f.slot)
            filled.add(f.expert)
            st.fills += 1
            st.bytes_copied += self.slot_bytes  # the fill crossed the link, once
            if f.held >= 0 and table.expert_in_list[f.slot] == f.held:
                if c._on_evict is not None:
                    c._on_evict(il, f.held)
                st.evictions += 1
                c._note_eviction(il, table, f.slot)
            now = table.slot_of_list[f.expert]
            if now >= 0:  # a stride prefetch placed it while the graph ran: that copy stands
                table.drop(f.slot)
                if table.log is not None:
                    table.log.flips.append(Flip(il, f.expert, f.slot))  # what the graph wrote, then undone
                    table.log.flips.append(Flip(il, f.expert, now if table.copy[now] is None else -1))
                continue
            table.place(f.expert, f.slot, None)
            if c._on_insert is not None:
                c._on_insert(il, f.expert, c.clock)
        for slot, held in zip(targets.slots, targets.held, strict=True):
            if held < 0 and slot not in used:
                insort(table.free, slot)
        return filled

    def _make_room(self, need: list[int], n_free: int) -> None:
        """Between tokens: evict until ``n_free`` slots are free for the next token's prefetches (prefetched
        experts never used first, then the policy's victims; never one the token used or one still loading)."""
        c, il, table = self.cache, self.il, self.table
        slot_of, copy = table.slot_of_list, table.copy
        st = c.stats.layers[il]
        used = set(need)
        stale = [x for x in table.expert_in_list if x >= 0 and x not in used and copy[slot_of[x]] is None
                 and table.prefetched[slot_of[x]]]
        cand: list[int] | None = None
        while len(table.free) < n_free:
            if stale:
                victim = stale.pop()
            else:
                if cand is None:
                    cand = c._victims(table, used)
                if not cand:
                    return
                victim = c.policy.victim(il, cand, c.clock)
                cand.remove(victim)
            slot = slot_of[victim]
            c.policy.on_evict(il, victim)
            st.evictions += 1
            c._note_eviction(il, table, slot)
            table.drop(slot)

    def seen_start(self, flat: list[int]) -> None:
        """The mailbox saw the layer start (``ExpertCache.seen_start``): what is readable now is what it reads."""
        c, il, table = self.cache, self.il, self.table
        if table.n_loading:
            c.land_done(table)
        slot_of, copy = table.slot_of_list, table.copy
        seen = set()
        for e in set(flat):
            s = slot_of[e]
            if s >= 0 and copy[s] is None:
                seen.add(e)
            elif s >= 0 and table.prefetched[s]:
                c.stats.layers[il].prefetch_late += 1
                c.prefetch_events += 1
        c._seen[il] = seen

    def prefetch(self, experts: list[int], keep: set[int] | None, ranks: list[float] | None) -> int:
        """Prefetch copies of the ``experts`` not resident, into free slots or victims; how many."""
        return self.cache.prefetch_whole(self.il, experts, keep, ranks)

    def prefetch_free(self, experts: list[int], keep: set[int] | None, ranks: list[float] | None) -> int:
        """The async decode's stride prefetch while a graph runs: into free slots only."""
        if not self.table.free:
            return 0
        return self.cache.prefetch_whole(self.il, experts, keep, ranks, free_only=True)

    def land(self) -> None:
        """Copies into the layer's slots that landed become readable."""
        if self.table.n_loading:
            self.cache.land_done(self.table)

    def observe(self, ids: np.ndarray | list[int]) -> None:
        """A micro-batch ran the native path: it read the model's own tensors, and leaves nothing behind."""

    def has_room(self) -> bool:
        """Whether a prefetch could go somewhere while a graph runs: a free slot, in a layer that cannot hold
        every expert. A layer with a slot for every expert admits each miss between tokens and never evicts: a
        prefetch there could save only an expert's first miss, never worth the mailbox reader's CPU."""
        return self.can_prefetch and bool(self.table.free)

    def keep_free_cap(self, n_prefetch: int) -> int:
        """Most free slots kept between tokens for the async decode's stride prefetch (``keep_free_slots``)."""
        c = self.cache
        return _kept_free(self.table.n_slots, c.n_expert, c.n_expert_used, n_prefetch)
