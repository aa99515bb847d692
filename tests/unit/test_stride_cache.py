"""The cache's side of the async decode's stride prefetch: free slots kept between tokens, prefetches into
free slots only, what a layer read when it started, stale admissions dropped, and the prefetcher's budget.

A copy backend whose copies land only when the test says so: every interleaving is forced, none timed."""

from __future__ import annotations

import itertools

import numpy as np

from ggmoe.cache import ExpertCache
from ggmoe.cache.cache import keep_free_slots
from ggmoe.cache.copy import CopyHandle, Priority
from ggmoe.cache.policies import POLICIES
from ggmoe.control.prefetch import Prefetcher
from ggmoe.predict.base import Predictor


class HeldCopies:
    """Copies land when ``land`` says; queued ones can be cancelled until then."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.landed: set[int] = set()
        self.cancelled: set[int] = set()
        self.handles: list[CopyHandle] = []

    def submit(self, il, expert, slot, priority, rank=0.0):
        h = CopyHandle(next(self._ids), il, expert, slot, Priority(priority))
        self.handles.append(h)
        return h

    def done(self, h):
        return h.id in self.landed or h.id in self.cancelled

    def wait(self, handles):
        self.landed |= {h.id for h in handles}

    def cancel(self, h):
        if h.id in self.landed:
            return False
        self.cancelled.add(h.id)
        return True

    def land(self, expert=None):
        self.landed |= {h.id for h in self.handles if expert is None or h.expert == expert}

    def close(self):
        pass


def _cache(n_slots=6, n_expert=16, k=2):
    copies = HeldCopies()
    cache = ExpertCache(n_expert, k, {0: n_slots, 1: n_slots}, POLICIES.get("lru")(n_expert, [0, 1]), copies=copies,
                        bytes_per_expert={0: 100, 1: 100})
    return cache, copies


def test_keep_free_slots():
    assert keep_free_slots({0: 8, 1: 32}, 32, 4, 8) == {0: 4, 1: 0}  # every expert fits in layer 1: none kept
    assert keep_free_slots({0: 8}, 32, 4, 2) == {0: 2}


def test_between_tokens_the_cache_keeps_free_slots_and_admissions_leave_them():
    cache, copies = _cache()
    cache.keep_free = {0: 2, 1: 2}
    for t in range(6):  # every token a new pair of experts: admissions fill what is not kept free
        cache.token += 1
        cache.after_token(0, [2 * t, 2 * t + 1])
        copies.land()
        cache.land_ready()
        assert len(cache.tables[0].free) >= 2, t
    assert cache.stats.layers[0].evictions > 0


def test_prefetch_into_a_running_graph_takes_free_slots_only():
    cache, copies = _cache(n_slots=4)
    for e in (0, 1, 2):
        cache.tables[0].place(e, e, None)
        cache.tables[0].free.remove(e)
    n = cache.prefetch(0, [5, 6, 7], free_only=True)
    assert n == 1  # one free slot; nothing evicted
    assert sorted(x for x in cache.tables[0].expert_in_list if x >= 0) == [0, 1, 2, 5]
    assert copies.handles[-1].priority == Priority.DEMAND  # before admissions meant for later tokens
    assert cache.prefetch(0, [6, 7], free_only=True) == 0


def test_what_a_layer_read_when_it_started_decides_hits_and_late_prefetches():
    cache, copies = _cache(n_slots=4)
    cache.prefetch(0, [3], free_only=True)
    cache.prefetch(0, [4], free_only=True)
    copies.land(expert=3)  # 3 landed before the layer started, 4 did not
    cache.token += 1
    cache.seen_start(0, [3, 4])
    copies.land()  # 4 lands while the layer runs: too late for it
    cache.after_token(0, [3, 4])
    st = cache.stats.layers[0]
    assert (st.hits, st.misses, st.prefetch_late, st.prefetch_hits) == (1, 1, 1, 1)


def test_an_earlier_tokens_queued_admissions_are_dropped():
    cache, copies = _cache(n_slots=4)
    cache.token = 1
    cache.after_token(0, [1, 2])  # admitted, never landing
    cache.token = 2
    cache.after_token(0, [3, 4])  # the old ones are cancelled, their slots go to the new misses
    st = cache.stats.layers[0]
    assert st.admissions_dropped == 2 and st.admission_copies == 4
    assert sorted(x for x in cache.tables[0].expert_in_list if x >= 0) == [3, 4]


def test_a_queued_admission_of_an_expert_missed_again_keeps_its_place():
    cache, copies = _cache(n_slots=4)
    cache.token = 1
    cache.after_token(0, [1, 2])  # admitted, never landing
    first = {h.expert: h for h in copies.handles}
    cache.token = 2
    cache.after_token(0, [2, 3])  # 2 missed again: its copy stays queued (not cancelled, not submitted again)
    st = cache.stats.layers[0]
    assert st.admissions_dropped == 1 and st.admission_copies == 3
    assert [h.expert for h in copies.handles] == [1, 2, 3]
    table = cache.tables[0]
    assert table.copy[table.slot_of_list[2]] is first[2]
    assert sorted(x for x in table.expert_in_list if x >= 0) == [2, 3]


class Fixed(Predictor):
    """Predicts experts 10..13 for every layer."""

    name = "test-fixed"

    def predict(self, il):
        s = np.zeros(self.shape.n_expert, dtype=np.float32)
        s[10:14] = 1.0
        return s


def _budgeted(n_prefetch=4):
    from ggmoe.predict import ModelShape

    cache, _ = _cache(n_slots=8)
    pf = Prefetcher(cache, Fixed(ModelShape("x", (0, 1), 16, 2, 4), 1), [0, 1], n_prefetch=n_prefetch)
    pf.free_only = True
    return pf, cache.stats.layers[1]


def _token(pf, st, used, wasted, dropped=1.0):
    """One decode token whose prefetches into layer 1 were ``used`` and ``wasted``, while ``dropped`` of its four
    admissions were dropped (1.0: a link with no time to spare)."""
    st.prefetch_hits += used
    st.prefetch_wasted += wasted
    st.admission_copies += 4
    st.admissions_dropped += round(4 * dropped)
    pf.cache.prefetch_events += used + wasted  # as the cache counts them
    pf.begin_step([7])
    return pf.limit


def test_the_budget_shrinks_while_wasted_bytes_outweigh_used_ones_on_a_busy_link_and_grows_back():
    pf, st = _budgeted()
    pf.cache.keep_free = {0: 4, 1: 4}
    assert _token(pf, st, 0, 3) == 3 and pf.cache.keep_free[1] == 1  # the free slots follow what was taken
    assert _token(pf, st, 3, 0) == 4


def test_the_budget_weighs_a_moving_balance_not_each_token():
    """A predictor that saves more than it wastes over a few tokens keeps its whole budget though half its tokens
    waste more than they save; one that wastes more overall turns itself off."""
    for (a, b), want in (((3, 0), (0, 2)), 4), (((2, 0), (0, 3)), 0):
        pf, st = _budgeted()
        limits = [_token(pf, st, *(a if i % 2 == 0 else b)) for i in range(24)]
        assert limits[-1] == want and (want == 0 or min(limits) == 4), limits


def test_wasted_prefetches_cost_nothing_on_a_link_with_time_to_spare():
    pf, st = _budgeted()
    limits = [_token(pf, st, 0, 3, dropped=0.0) for _ in range(16)]  # no admission was ever dropped
    assert limits == [4] * 16
    half = [_token(pf, st, 1, 3, dropped=0.25) for _ in range(16)]  # a quarter dropped: 3 wasted weigh 0.75
    assert half[-1] == 4


def test_a_prefetcher_turned_off_reads_nothing_and_tries_again_later_and_later():
    """Off (budget 0): no slot kept free, the mailbox unread; after PROBE_AFTER tokens one prefetch a layer is
    tried from an even balance, and each time it turns off again it waits twice as long."""
    from ggmoe.control.prefetch import PROBE_AFTER

    pf, st = _budgeted(n_prefetch=1)
    pf.cache.keep_free = {0: 1, 1: 1}
    assert _token(pf, st, 0, 3) == 0 and pf.cache.keep_free == {0: 0, 1: 0}
    waits = []
    for _ in range(2):
        off = 0
        while pf.limit == 0:
            assert pf.wants_token() is False
            pf.begin_step([7])  # nothing moved: a token with the prefetcher off
            off += 1
        waits.append(off)
        assert _token(pf, st, 0, 3) == 0  # the try wastes again: off again
    assert waits == [PROBE_AFTER, 2 * PROBE_AFTER], waits


class StartBlind(Fixed):
    """Predicts nothing for layer 0 between tokens (as an MLP reading the MoE input)."""

    name = "test-start-blind"

    def predict(self, il):
        return None if il == 0 else super().predict(il)


def test_a_layer_nothing_predicts_between_tokens_keeps_no_free_slot():
    from ggmoe.predict import ModelShape

    for predictor, kept in ((StartBlind, False), (Fixed, True)):
        cache, _ = _cache(n_slots=8)
        pf = Prefetcher(cache, predictor(ModelShape("x", (0, 1), 16, 2, 4), 1), [0, 1], n_prefetch=4)
        pf.free_only = True
        pf.begin_step([7])  # layer 0 is predicted (or not) at the token's start
        cache.stats.layers[1].prefetch_hits += 1  # something moved: the next look sets the kept slots
        cache.prefetch_events += 1
        pf.begin_step([7])
        assert (cache.keep_free[0] > 0) is kept and cache.keep_free[1] > 0, (predictor, cache.keep_free)


def test_an_idle_prefetcher_leaves_the_mailbox_unread_for_longer_and_longer():
    from ggmoe.predict import ModelShape

    cache, _ = _cache(n_slots=8)
    pf = Prefetcher(cache, Fixed(ModelShape("x", (0, 1), 16, 2, 4), 1), [0, 1], n_prefetch=4)
    pf.free_only = True
    for il in (0, 1):  # every predicted expert (10..13) resident: predictions issue nothing
        for slot, e in enumerate(range(10, 14)):
            cache.tables[il].place(e, slot, None)
            cache.tables[il].free.remove(slot)
    read = []
    for _ in range(12):  # nothing is ever issued: the reader skips 1, then 2, then 4 ... tokens
        pf.begin_step([7])
        read.append(pf.wants_token())
    assert read == [True, False, True, False, False, True, False, False, False, False, True, False]
    cache.stats.layers[0].prefetch_issued += 2  # a token's predictions issued copies: read every token again
    cache.prefetch_events += 2  # as the cache counts them
    pf.begin_step([7])
    assert pf.wants_token()
    pf.begin_step([7])
    assert pf.wants_token() is False  # that last token issued nothing: idle again, one skipped


def test_a_prefetch_threshold_filters_the_guesses_and_protects_nothing_else():
    from ggmoe.base.hook import RouteEvent
    from ggmoe.predict import ModelShape

    cache, _ = _cache(n_slots=4)
    for pair in ([0, 1], [2, 3]):
        cache.route_flat(1, pair)  # layer 1 full of experts 0..3, every copy landed
    pf = Prefetcher(cache, Fixed(ModelShape("x", (0, 1), 16, 2, 4), 1), [0, 1], n_prefetch=4, threshold=0.5)
    pf.begin_step([7])
    pf.on_route(RouteEvent(il=0, ids=np.array([[4, 5]], dtype=np.int32), probs=None, hidden=None))
    # 10..13 pass the threshold and evict 0..3 (the positions of the kept guesses name no expert to protect)
    assert sorted(x for x in cache.tables[1].expert_in_list if x >= 0) == [10, 11, 12, 13]


def test_no_prefetch_is_predicted_for_a_layer_that_holds_every_expert():
    """A layer with a slot for every expert never evicts: its free slots are no reason to read the mailbox."""
    from ggmoe.predict import ModelShape

    full, _ = _cache(n_slots=16)  # n_expert 16: every expert fits, most slots still free
    assert full.tables[0].free and not full.has_free_slot()
    part, _ = _cache(n_slots=8)
    assert part.has_free_slot()
    pf = Prefetcher(full, Fixed(ModelShape("x", (0, 1), 16, 2, 4), 1), [0, 1], n_prefetch=4)
    pf.free_only = True
    pf.begin_step([7])  # the first layers' predictions at the token's start: none issued
    assert full.stats.total().prefetch_issued == 0 and full.prefetch_events == 0


def test_the_controller_builds_no_events_for_an_observer_that_reads_the_mailbox():
    from ggmoe.control.controller import TokenController

    cache, _ = _cache(n_slots=8)
    seen = {"plain": 0, "mailbox": 0}

    class Plain:
        def on_route(self, event):
            seen["plain"] += 1

    class ViaMailbox(Plain):
        wants_routing = False

        def on_route(self, event):
            seen["mailbox"] += 1

    TokenController(cache, [Plain(), ViaMailbox()]).on_routing([0, 1], np.array([[[1, 2]], [[3, 4]]], np.int32))
    assert seen == {"plain": 2, "mailbox": 0}


def _split_cache(n_slots=4, n_bottom=2):
    """A cache of one split layer (layer 0, 8 experts, top-2) over held copies: tops 40 bytes, bottoms 60."""
    from ggmoe.cache.split import SPLIT_ROWS, KindSplit, LayerSplit, Pieces

    kind = KindSplit("up", SPLIT_ROWS, 2, 100, Pieces(0, 0, 40, 1, 40, 40), (Pieces(40, 0, 60, 1, 60, 60),))
    split = {0: LayerSplit(0, 0.4, 5, 2, (kind,))}
    copies = HeldCopies()
    cache = ExpertCache(8, 2, {0: n_slots}, POLICIES.get("lru")(8, [0]), copies=copies,
                        bytes_per_expert={0: 100}, split=split, n_bottom=n_bottom)
    return cache, copies


def test_a_split_layer_takes_prefetched_bottoms_into_empty_buffers_only_while_a_graph_runs():
    """The async decode's prefetch into a split layer: bottoms of experts whose tops are readable, into empty
    buffers, first in the queue; nothing evicted, no top copied; between tokens the kept buffers are emptied,
    a bottom never read counted wasted, one read counted used."""
    cache, copies = _split_cache()
    table, bt = cache.tables[0], cache.bottoms[0]
    for slot, e in enumerate((1, 2, 3)):  # tops of 1, 2, 3 readable; 4's top still loading
        table.place(e, slot, None)
        table.free.remove(slot)
    table.place(4, 3, CopyHandle(99, 0, 4, 3, Priority.ADMISSION))
    table.free.remove(3)
    assert cache.has_room(0) and 0 in cache.prefetch_layers
    n = cache.prefetch(0, [4, 1, 5, 2, 3], free_only=True)  # 4: top loading, 5: no top; 1 and 2 fill both buffers
    assert n == 2 and [(h.expert, h.slot, h.priority) for h in copies.handles] == [
        (1, -1, Priority.DEMAND), (2, -2, Priority.DEMAND)]
    assert not cache.has_room(0) and cache.prefetch(0, [3], free_only=True) == 0
    st = cache.stats.layers[0]
    assert st.bottom_prefetches == st.prefetch_issued == 2 and st.bottom_prefetch_bytes == 120
    copies.landed |= {h.id for h in copies.handles}
    cache.seen_start(0, [1, 3])  # landed before the layer started: 1's bottom readable there
    cache.keep_free = {0: 2}
    cache.after_token(0, [1, 3])
    assert st.bottom_hits == 1 and st.prefetch_hits == 1  # 1's prefetched bottom, read
    # two kept empty for the next token: 2's unread bottom goes (wasted), 1's stays (this token read it)
    assert st.prefetch_wasted == 1 and bt.expert_in == [1, -1]


def test_a_prefetched_bottom_still_loading_when_its_layer_starts_is_late():
    cache, copies = _split_cache()
    cache.tables[0].place(1, 0, None)
    cache.tables[0].free.remove(0)
    cache.prefetch(0, [1], free_only=True)
    cache.seen_start(0, [1, 2])
    st = cache.stats.layers[0]
    assert st.prefetch_late == 1 and st.bottom_hits == 0
