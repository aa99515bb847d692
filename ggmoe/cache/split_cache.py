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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ggmoe.cache.clock import Clock
from ggmoe.cache.copy import CopyBackend, CopyHandle, Priority, bottom_target
from ggmoe.cache.policies.base import Policy
from ggmoe.cache.slots import BottomTable, SlotTable
from ggmoe.cache.split import LayerSplit
from ggmoe.cache.stats import CacheStats, LayerStats


class ExpertCache(Protocol):
    """The seam: what split layers use of the ``ggmoe.cache.cache.ExpertCache`` that owns them (a protocol,
    as that module imports this one), its whole-expert machinery included."""

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

    def cancel_stale(self, il: int, handles: list[CopyHandle | None], need: list[int]) -> list[int]: ...

    def _drop_stale_prefetches(self, il: int, table: SlotTable, need: list[int]) -> None: ...

    def _count_prefetch_hits(self, il: int, table: SlotTable, need: list[int]) -> None: ...

    def _admit_after(self, il: int, table: SlotTable, need: list[int], missing: list[int]) -> None: ...

    def _land_done(self, table: SlotTable) -> None: ...

    def _prefetch_whole(self, il: int, experts: list[int], keep: set[int] | None = None,
                        ranks: list[float] | None = None, free_only: bool = False) -> int: ...


class SplitLayers:
    """Geometry and bottom buffers of the split layers of one cache (``n_bottom`` buffers per layer)."""

    def __init__(self, split: Mapping[int, LayerSplit], n_expert: int, n_bottom: int) -> None:
        self.layers = dict(split)
        self.n_bottom = n_bottom
        self.bottoms = {il: BottomTable(n_expert, n_bottom) for il in split} if n_bottom > 0 else {}

    def __contains__(self, il: int) -> bool:
        return il in self.layers

    def access(self, cache: ExpertCache, il: int, flat: list[int], before_compute: bool) -> None:
        """One call of split layer ``il`` with the selected experts ``flat`` (the cache's lock held).

        ``before_compute`` (sync decode): copies landed by now are readable for this call, and the stale
        queued prefetches are dropped; otherwise (async decode, after the token) the state at launch counts
        and landed copies become readable afterwards."""
        t0 = cache.time.now()
        sp = self.layers[il]
        st = cache.stats.layers[il]
        table = cache.tables[il]
        bt = self.bottoms.get(il)
        cache.clock += 1
        st.calls += 1
        need = sorted(set(flat))
        if before_compute:
            self.land(cache, il)
            if table.n_loading:
                cache._drop_stale_prefetches(il, table, need)
            if bt is not None and bt.n_loading:
                self._drop_stale_bottoms(cache, il, bt, need)
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
        if cache.n_prefetched[il]:
            cache._count_prefetch_hits(il, table, need)
        if il in cache.predicted:
            guess = cache.predicted.pop(il)
            st.pred_total += len(guess)
            st.pred_correct += len(set(guess) & set(need))
        cache.policy.on_access(il, need, cache.clock)
        cache._admit_after(il, table, need, missing)
        self.land(cache, il)  # a synchronous backend (the CPU build's memcpy) has landed them already
        if bt is not None and not before_compute and cache.keep_free.get(il):
            self._keep_free(cache, il, bt, need)
        st.hook_s += cache.time.now() - t0

    @staticmethod
    def _keep_free(cache: ExpertCache, il: int, bt: BottomTable, need: list[int]) -> None:
        """Between tokens (async decode): empty bottom buffers until ``keep_free[il]`` are, for the next token's
        stride prefetch into a running graph (bottoms never read first, then the least recently used; never
        one this token read or one still loading)."""
        n_free = sum(1 for e in bt.expert_in if e < 0)
        want = cache.keep_free[il]
        if n_free >= want:
            return
        used = set(need)
        held = [b for b, e in enumerate(bt.expert_in) if e >= 0 and bt.copy[b] is None and e not in used]
        held.sort(key=lambda b: (not bt.unused[b], bt.last_use[b]))
        st = cache.stats.layers[il]
        for b in held[: want - n_free]:
            if bt.release(b):
                st.prefetch_wasted += 1
                cache.prefetch_events += 1

    def prefetch_free(self, cache: ExpertCache, il: int, experts: list[int], ranks: list[float] | None) -> int:
        """The async decode's stride prefetch into split layer ``il`` while a graph runs (the cache's lock held;
        ``experts`` likeliest first): the bottoms of predicted experts whose tops are readable, into empty
        buffers only (no table entry points at one, so no kernel reads it), first in the copy queue. Each
        bottom's table entry flips to its buffer on the copy stream once it landed (one 8-byte word: address
        and packed flag). Tops are admitted between tokens only. Returns the bottoms queued."""
        bt = self.bottoms.get(il)
        if bt is None:
            return 0
        table = cache.tables[il]
        slot_of, copy = table.slot_of_list, table.copy
        rank_of = dict(zip(experts, ranks, strict=True)) if ranks is not None else {}
        n = 0
        for e in experts:
            s = slot_of[e]
            if s < 0 or copy[s] is not None or bt.buffer_of[e] >= 0:
                continue  # no readable top to go with it, or its bottom is in a buffer already
            b = bt.empty()
            if b is None:
                break
            h = cache.copies.submit(il, e, bottom_target(b), Priority.DEMAND, rank_of.get(e, 0.0))
            if bt.log is not None:
                bt.log.copies.append(h)
            bt.place(e, b, h, cache.clock)
            n += 1
        st = cache.stats.layers[il]
        self._count_bottoms(st, il, n)
        st.prefetch_issued += n
        cache.prefetch_events += n
        return n

    def _count_bottoms(self, st: LayerStats, il: int, n: int) -> None:
        """``n`` bottoms of layer ``il`` queued into buffers: counted and their bytes copied."""
        nbytes = self.layers[il].bottom_bytes * n
        st.bottom_prefetches += n
        st.bottom_prefetch_bytes += nbytes
        st.bytes_copied += nbytes

    def seen_start(self, cache: ExpertCache, il: int, flat: list[int]) -> None:
        """The async decode's reader saw split layer ``il`` start with experts ``flat``: bottoms that landed are
        readable (their entries flipped on the copy stream already, so the layer read them there); a prefetched
        bottom of one of ``flat`` still loading was late. Tops land between tokens only (their three entries
        change together there)."""
        bt = self.bottoms.get(il)
        if bt is None:
            return
        self._land_bottoms(cache, bt)
        late = sum(1 for e in set(flat) if bt.buffer_of[e] >= 0 and bt.copy[bt.buffer_of[e]] is not None)
        if late:
            cache.stats.layers[il].prefetch_late += late
            cache.prefetch_events += late

    @staticmethod
    def _drop_stale_bottoms(cache: ExpertCache, il: int, bt: BottomTable, need: list[int]) -> None:
        """Early preemption at the gate for bottoms: prefetched bottoms of this layer still queued and not
        needed now are cancelled and their buffers freed. Without it, on a queue that serves admissions first
        (any asynchronous copy stream) queued bottoms hold every buffer forever and prefetching stops."""
        for b in cache.cancel_stale(il, bt.copy, need):
            bt.drop(b)

    def land(self, cache: ExpertCache, il: int) -> None:
        """Copies into the layer's slots and bottom buffers that landed become readable."""
        table = cache.tables[il]
        if table.n_loading:
            cache._land_done(table)
        bt = self.bottoms.get(il)
        if bt is not None:
            self._land_bottoms(cache, bt)

    @staticmethod
    def _land_bottoms(cache: ExpertCache, bt: BottomTable) -> None:
        """Bottom copies that landed become readable (flips pointing their entries at the buffers)."""
        if bt.n_loading:
            for b, h in enumerate(bt.copy):
                if h is not None and cache.copies.done(h):
                    bt.landed(b)

    def prefetch(self, cache: ExpertCache, il: int, experts: list[int], keep: set[int] | None,
                 ranks: list[float] | None) -> int:
        """MoEpic's prefetch for split layer ``il`` (the cache's lock held; ``experts`` in descending predicted
        score): the bottom of an expert whose top is cached; the top and the bottom of one whose top is not.
        Returns the tops queued (bottoms are counted in ``bottom_prefetches``)."""
        st = cache.stats.layers[il]
        table = cache.tables[il]
        bt = self.bottoms.get(il)
        protect = set(experts) | (keep or set())
        rank_of = dict(zip(experts, ranks, strict=True)) if ranks is not None else {}
        tops = 0
        for e in experts:
            rank = rank_of.get(e, 0.0)
            if table.slot_of_list[e] < 0:
                tops += cache._prefetch_whole(il, [e], protect, [rank])
                if table.slot_of_list[e] < 0:
                    continue  # no slot could take its top: its bottom alone would not be read
            if bt is None or bt.buffer_of[e] >= 0:
                continue
            b = bt.victim(protect)
            if b is None:
                continue  # every buffer is loading or holds a predicted expert
            h = cache.copies.submit(il, e, bottom_target(b), Priority.PREFETCH, rank)
            if bt.log is not None:
                bt.log.copies.append(h)
            bt.place(e, b, h, cache.clock)
            self._count_bottoms(st, il, 1)
        self.land(cache, il)
        return tops
