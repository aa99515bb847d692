"""The expert cache's split layers (MoEpic): top segments in slots, bottoms read in place or prefetched.

A split layer's slots hold top segments (``ggmoe.cache.split``). Its experts are
always read through the expert table, so nothing ever waits for a copy:

- full hit: the top is in a slot and the bottom landed in a bottom buffer (prefetched);
- top-only hit: the top is in a slot, the bottom is read from the model's host tensor
  (``bottom_bytes`` over the link on a GPU, zero-copy);
- miss: the whole expert is read from host memory; its top is admitted at low priority.

The prefetcher (MoEpic's speculative prefetch: a predictor one layer ahead, in
descending score) queues the bottom of a predicted expert whose top is cached and
the top and the bottom otherwise. Bottom buffers are reused least recently used
first. The same code serves the sync decode (the route op's callback, before the
layer computes: copies landed by then count) and the async decode (the controller
after the token: what was readable when the token started counts).

``SplitLayer`` is one of the cache's two per-layer strategies; the other,
``WholeLayer`` (``ggmoe.cache.cache``), caches whole experts. The cache asks a
layer's strategy, never which kind the layer is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ggmoe.cache.clock import Clock
from ggmoe.cache.copy import CopyBackend, CopyHandle, Priority, bottom_target
from ggmoe.cache.policies.base import Policy
from ggmoe.cache.slots import BottomTable, SlotTable
from ggmoe.cache.split import SPLIT_MAX_TOKENS, LayerSplit
from ggmoe.cache.stats import CacheStats, LayerStats


class SlotCache(Protocol):
    """The seam: what a split layer uses of the ``ggmoe.cache.cache.ExpertCache`` that owns it (a protocol, as
    that module imports this one), its whole-expert machinery included."""

    time: Clock
    stats: CacheStats
    tables: dict[int, SlotTable]  # il -> the layer's slot table
    clock: int  # access counter: one per routed layer call
    copies: CopyBackend
    policy: Policy
    n_prefetched: dict[int, int]  # il -> slots holding an unused prefetched expert
    predicted: dict[int, list[int]]  # il -> experts predicted for its next call
    keep_free: dict[int, int]  # il -> free slots (split layers: empty bottom buffers) kept between tokens
    prefetch_events: int  # prefetches issued plus their outcomes counted so far
    policy_releases: bool  # whether the policy drops experts after a call (on-demand)

    def cancel_stale(self, il: int, handles: list[CopyHandle | None], need: list[int]) -> list[int]: ...

    def drop_stale_prefetches(self, il: int, table: SlotTable, need: list[int]) -> None: ...

    def count_prefetch_hits(self, il: int, table: SlotTable, need: list[int]) -> None: ...

    def admit_after(self, il: int, table: SlotTable, need: list[int], missing: list[int], reserve: int = 0
                     ) -> None: ...

    def land_done(self, table: SlotTable) -> None: ...

    def prefetch_whole(self, il: int, experts: list[int], keep: set[int] | None = None,
                        ranks: list[float] | None = None, free_only: bool = False) -> int: ...


class SplitLayer:
    """Split layer ``il`` of one cache: its geometry and its bottom buffers (None: no buffers, every bottom is
    read in place). The cache calls it under its lock."""

    def __init__(self, cache: SlotCache, il: int, split: LayerSplit, bottoms: BottomTable | None) -> None:
        self.cache, self.il, self.split, self.bottoms = cache, il, split, bottoms
        self.table = cache.tables[il]
        self.slot_bytes = split.top_bytes  # bytes one copy into a slot moves: a top segment
        self.can_prefetch = bottoms is not None  # a prefetch into a running graph goes to a bottom buffer

    def fits(self, n_tokens: int) -> bool:
        """Read through the expert table, misses in place: only the batch size limits."""
        return n_tokens <= SPLIT_MAX_TOKENS

    def route(self, flat: list[int], next_use: Mapping[int, float] | None) -> list[int]:
        """The sync route: the matmuls take the expert ids themselves (read through the table)."""
        if next_use is not None:
            self.cache.policy.set_future(self.il, next_use)
        self.access(flat, before_compute=True)
        return list(flat)

    def after_token(self, flat: list[int]) -> None:
        """The async decode's step for this layer: what was readable at launch counts."""
        self.access(flat, before_compute=False)

    def observe(self, ids: np.ndarray | list[int]) -> None:
        """A micro-batch above ``SPLIT_MAX_TOKENS`` tokens (prefill) ran natively: its experts' tops are admitted at
        low priority (up to the slots), so that the decode after a prefill finds them, as whole-expert layers'
        prefills leave theirs in the slots."""
        cache, table = self.cache, self.table
        if cache.policy_releases:
            return
        flat = ids.ravel().tolist() if isinstance(ids, np.ndarray) else list(ids)
        cache.clock += 1
        need = sorted(set(flat))
        self.land()
        cache.policy.on_access(self.il, need, cache.clock)
        cache.admit_after(self.il, table, need, [e for e in need if table.slot_of_list[e] < 0][: table.n_slots])
        self.land()

    def has_room(self) -> bool:
        """Whether a prefetch could go somewhere while a graph runs: an empty bottom buffer."""
        return self.bottoms is not None and self.bottoms.empty() is not None

    def keep_free_cap(self, n_prefetch: int) -> int:
        """Most empty bottom buffers kept between tokens (the tops are admitted between tokens only)."""
        return min(n_prefetch, self.bottoms.n_buffers) if self.bottoms is not None else 0

    def access(self, flat: list[int], before_compute: bool) -> None:
        """One call of the layer with the selected experts ``flat`` (the cache's lock held).

        ``before_compute`` (sync decode): copies landed by now are readable for this call, and the stale
        queued prefetches are dropped; otherwise (async decode, after the token) the state at launch counts
        and landed copies become readable afterwards."""
        cache, il, table, bt = self.cache, self.il, self.table, self.bottoms
        t0 = cache.time.now()
        st = cache.stats.layers[il]
        cache.clock += 1
        st.calls += 1
        need = sorted(set(flat))
        if before_compute:
            self.land()
            if table.n_loading:
                cache.drop_stale_prefetches(il, table, need)
            if bt is not None and bt.n_loading:
                self._drop_stale_bottoms(need)
        missing = self._count_reads(st, need, before_compute)
        if cache.n_prefetched[il]:
            cache.count_prefetch_hits(il, table, need)
        if il in cache.predicted:
            guess = cache.predicted.pop(il)
            st.pred_total += len(guess)
            st.pred_correct += len(set(guess) & set(need))
        cache.policy.on_access(il, need, cache.clock)
        cache.admit_after(il, table, need, missing)
        self.land()  # a synchronous backend (the CPU build's memcpy) has landed them already
        if bt is not None and not before_compute and cache.keep_free.get(il):
            self._keep_free(need)
        st.hook_s += cache.time.now() - t0

    def _count_reads(self, st: LayerStats, need: list[int], before_compute: bool) -> list[int]:
        """Full hits, top-only hits and misses of ``need``, counted with the bytes read in place; the misses."""
        cache, sp, table, bt = self.cache, self.split, self.table, self.bottoms
        slot_of, copy = table.slot_of_list, table.copy
        missing = []
        for e in need:
            s = slot_of[e]
            if s < 0 or copy[s] is not None:
                missing.append(e)
            elif bt is not None and bt.ready(e):
                st.hits += 1
                st.bottom_hits += 1
                b = bt.buffer_of[e]
                bt.last_use[b] = cache.clock
                if bt.unused[b] and not before_compute:  # the async decode's prefetched bottom, used
                    st.prefetch_hits += 1
                    cache.prefetch_events += 1
                bt.unused[b] = False
            else:
                st.top_hits += 1
                st.bottom_read_bytes += sp.bottom_bytes
                st.host_read_bytes += sp.bottom_bytes
        st.misses += len(missing)
        st.host_reads += len(missing)
        st.host_read_bytes += len(missing) * sp.expert_bytes
        return missing

    def _keep_free(self, need: list[int]) -> None:
        """Between tokens (async decode): empty bottom buffers until ``keep_free[il]`` are, for the next token's
        stride prefetch into a running graph (bottoms never read first, then the least recently used; never
        one this token read or one still loading)."""
        cache, bt = self.cache, self.bottoms
        assert bt is not None
        n_free = sum(1 for e in bt.expert_in if e < 0)
        want = cache.keep_free[self.il]
        if n_free >= want:
            return
        used = set(need)
        held = [b for b, e in enumerate(bt.expert_in) if e >= 0 and bt.copy[b] is None and e not in used]
        held.sort(key=lambda b: (not bt.unused[b], bt.last_use[b]))
        st = cache.stats.layers[self.il]
        for b in held[: want - n_free]:
            if bt.release(b):
                st.prefetch_wasted += 1
                cache.prefetch_events += 1

    def prefetch_free(self, experts: list[int], keep: set[int] | None, ranks: list[float] | None) -> int:
        """The async decode's stride prefetch while a graph runs (the cache's lock held; ``experts`` likeliest
        first): the bottoms of predicted experts whose tops are readable, into empty buffers only (no table
        entry points at one, so no kernel reads it), first in the copy queue. Each bottom's table entry flips
        to its buffer on the copy stream once it landed (one 8-byte word: address and packed flag). Tops are
        admitted between tokens only. Returns the bottoms queued."""
        cache, il, bt = self.cache, self.il, self.bottoms
        if bt is None:
            return 0
        slot_of, copy = self.table.slot_of_list, self.table.copy
        rank_of = dict(zip(experts, ranks, strict=True)) if ranks is not None else {}
        n = 0
        for e in experts:
            s = slot_of[e]
            if s < 0 or copy[s] is not None or bt.buffer_of[e] >= 0:
                continue  # no readable top to go with it, or its bottom is in a buffer already
            b = bt.empty()
            if b is None:
                break
            self._submit_bottom(e, b, Priority.DEMAND, rank_of.get(e, 0.0))
            n += 1
        st = cache.stats.layers[il]
        st.prefetch_issued += n
        cache.prefetch_events += n
        return n

    def _submit_bottom(self, expert: int, buffer: int, priority: Priority, rank: float) -> None:
        """A copy of ``expert``'s bottom into ``buffer``: submitted, logged for the step, placed and counted."""
        cache, bt = self.cache, self.bottoms
        assert bt is not None
        h = cache.copies.submit(self.il, expert, bottom_target(buffer), priority, rank)
        if bt.log is not None:
            bt.log.copies.append(h)
        bt.place(expert, buffer, h, cache.clock)
        st = cache.stats.layers[self.il]
        nbytes = self.split.bottom_bytes
        st.bottom_prefetches += 1
        st.bottom_prefetch_bytes += nbytes
        st.bytes_copied += nbytes

    def seen_start(self, flat: list[int]) -> None:
        """The async decode's reader saw the layer start with experts ``flat``: bottoms that landed are readable
        (their entries flipped on the copy stream already, so the layer read them there); a prefetched bottom
        of one of ``flat`` still loading was late. Tops land between tokens only (their three entries change
        together there)."""
        bt = self.bottoms
        if bt is None:
            return
        self._land_bottoms()
        late = sum(1 for e in set(flat) if bt.buffer_of[e] >= 0 and bt.copy[bt.buffer_of[e]] is not None)
        if late:
            self.cache.stats.layers[self.il].prefetch_late += late
            self.cache.prefetch_events += late

    def _drop_stale_bottoms(self, need: list[int]) -> None:
        """Early preemption at the gate for bottoms: prefetched bottoms of this layer still queued and not
        needed now are cancelled and their buffers freed. Without it, on a queue that serves admissions first
        (any asynchronous copy stream) queued bottoms hold every buffer forever and prefetching stops."""
        bt = self.bottoms
        assert bt is not None
        for b in self.cache.cancel_stale(self.il, bt.copy, need):
            bt.drop(b)

    def land(self) -> None:
        """Copies into the layer's slots and bottom buffers that landed become readable."""
        if self.table.n_loading:
            self.cache.land_done(self.table)
        self._land_bottoms()

    def _land_bottoms(self) -> None:
        """Bottom copies that landed become readable (flips pointing their entries at the buffers)."""
        bt = self.bottoms
        if bt is not None and bt.n_loading:
            done = self.cache.copies.done
            for b, h in enumerate(bt.copy):
                if h is not None and done(h):
                    bt.landed(b)

    def prefetch(self, experts: list[int], keep: set[int] | None, ranks: list[float] | None) -> int:
        """MoEpic's prefetch (the cache's lock held; ``experts`` in descending predicted score): the bottom of an
        expert whose top is cached; the top and the bottom of one whose top is not. Returns the tops queued
        (bottoms are counted in ``bottom_prefetches``)."""
        cache, il, table, bt = self.cache, self.il, self.table, self.bottoms
        protect = set(experts) | (keep or set())
        rank_of = dict(zip(experts, ranks, strict=True)) if ranks is not None else {}
        tops = 0
        for e in experts:
            rank = rank_of.get(e, 0.0)
            if table.slot_of_list[e] < 0:
                tops += cache.prefetch_whole(il, [e], protect, [rank])
                if table.slot_of_list[e] < 0:
                    continue  # no slot could take its top: its bottom alone would not be read
            if bt is None or bt.buffer_of[e] >= 0:
                continue
            b = bt.victim(protect)
            if b is None:
                continue  # every buffer is loading or holds a predicted expert
            self._submit_bottom(e, b, Priority.PREFETCH, rank)
        self.land()
        return tops
