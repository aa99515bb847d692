"""In-graph fills without a model: the assignment by hand, a cache's fill targets and how it settles the graph's fills."""

from __future__ import annotations

import pytest

from ggmoe.cache.cache import ExpertCache
from ggmoe.cache.fill import Fill, FillTargets, assign
from ggmoe.cache.policies import POLICIES

pytestmark = pytest.mark.unit

N_EXPERT, K = 8, 2


@pytest.mark.parametrize("slots, held, selected, readable, want", [
    # free slots take the misses in ascending id
    ((5, 6), (-1, -1), [3, 1], [], [(1, 5, -1), (3, 6, -1)]),
    # a readable expert is a hit; only the miss fills
    ((5, 6), (-1, -1), [3, 1], [3], [(1, 5, -1)]),
    # a slot whose expert is itself selected is skipped (that expert is a hit)
    ((0, 1), (4, 7), [4, 2], [4], [(2, 1, 7)]),
    # more misses than slots: the rest are read in place
    ((2,), (-1,), [6, 0], [], [(0, 2, -1)]),
    # every slot's expert selected: nothing fills
    ((0, 1), (4, 7), [4, 7, 3], [4, 7], []),
    # no targets
    ((), (), [1, 2], [], []),
])
def test_assign_by_hand(slots, held, selected, readable, want):
    targets = FillTargets(0, slots, held)
    assert [(f.expert, f.slot, f.held) for f in assign(targets, selected, readable)] == want


def _cache(n_slots: int = 4) -> ExpertCache:
    cache = ExpertCache(N_EXPERT, K, {0: n_slots}, POLICIES.get("lru")(N_EXPERT, [0]))
    cache.follow_tables()
    cache.fill_slots = K
    return cache


def _token(cache: ExpertCache, ids: list[int]) -> list[Fill]:
    """One decode: fill targets, the graph's fills (``assign``), then the controller's step for the layer."""
    (targets,) = cache.offer_fills()
    table = cache.tables[0]
    readable = [e for s, e in enumerate(table.expert_in_list) if e >= 0 and table.copy[s] is None]
    fills = assign(targets, ids, readable)
    cache.take_fills(fills)
    cache.after_token(0, ids)
    return fills


def test_targets_take_free_slots_then_lru_victims_and_settle_without_copies():
    cache = _cache()
    assert [(f.expert, f.slot, f.held) for f in _token(cache, [0, 1])] == [(0, 0, -1), (1, 1, -1)]
    assert _token(cache, [2, 3]) and cache.tables[0].free == []
    targets = cache.offer_fills()[0]
    assert targets.held == (0, 1)  # the least recently used, first evicted first
    cache.take_fills(assign(targets, [0, 4], [0, 1, 2, 3]))  # 0 is a hit: its slot is skipped, 4 takes 1's
    cache.after_token(0, [0, 4])
    table, st = cache.tables[0], cache.stats.layers[0]
    assert table.slot_of_list[4] == targets.slots[1] and table.slot_of_list[1] < 0 and table.slot_of_list[0] >= 0
    assert st.fills == 5 and st.admission_copies == 0 and st.host_reads == 0 and st.evictions == 1
    assert st.hits == 1 and st.misses == 5


def test_unused_free_fill_slots_go_back_and_the_flips_follow_the_graph():
    cache = _cache()
    cache.take_step()
    _token(cache, [3])  # one of the two free fill slots used
    table = cache.tables[0]
    assert sorted(table.free) == [1, 2, 3]
    step = cache.take_step()
    assert (0, 3, 0, False) in step.flips


def test_targets_never_settled_are_settled_before_the_next():
    cache = _cache()
    cache.offer_fills()
    cache.take_fills([Fill(0, 5, 0, -1)])  # the graph filled expert 5, but no controller step followed
    cache.offer_fills(0)
    assert cache.tables[0].slot_of_list[5] == 0 and not cache.fill_targets


def test_a_fill_that_a_stride_prefetch_raced_keeps_the_prefetch():
    cache = _cache()
    (targets,) = cache.offer_fills()  # free slots 0 and 1 (none kept for prefetches here)
    cache.prefetch(0, [6], free_only=True)  # while the graph runs, the prefetch takes slot 2
    cache.take_step()
    cache.take_fills([Fill(0, 6, targets.slots[0], -1)])  # the graph filled 6 too, before the prefetch landed
    cache.after_token(0, [6])
    table = cache.tables[0]
    assert table.slot_of_list[6] == 2 and targets.slots[0] in table.free
    flips = [f for f in cache.take_step().flips if f.expert == 6]
    # the entry the graph wrote, written again: to host memory while the prefetch lands, then to its slot
    assert flips[0] == (0, 6, targets.slots[0], False) and flips[-1] == (0, 6, 2, False)


def test_no_fill_layers_where_every_expert_fits_or_nothing_is_kept():
    full = ExpertCache(N_EXPERT, K, {0: N_EXPERT}, POLICIES.get("lru")(N_EXPERT, [0]))
    assert full.fill_layers == ()
    on_demand = ExpertCache(N_EXPERT, K, {0: 4}, POLICIES.get("on-demand")(N_EXPERT, [0]))
    assert on_demand.fill_layers == ()



@pytest.mark.parametrize("bar, score, selected, want", [
    # a victim's slot only for a miss scoring above the victim; the free slot takes any
    ((-1, 5), {1: 3, 2: 9}, [1, 2], [(1, 10, -1), (2, 11, 7)]),
    ((-1, 5), {1: 9, 2: 3}, [1, 2], [(1, 10, -1)]),  # 2 scores below the victim: read in place
    ((5, -1), {1: 3, 2: 9}, [1, 2], [(1, 11, -1), (2, 10, 6)]),  # a later slot taken by an earlier miss
])
def test_assign_honours_the_admission_filter(bar, score, selected, want):
    held = (-1, 7) if bar[0] == -1 else (6, -1)
    scores = tuple(score.get(e, 0) for e in range(N_EXPERT))
    targets = FillTargets(0, (10, 11), held, bar, scores)
    assert [(f.expert, f.slot, f.held) for f in assign(targets, selected, [])] == want


def test_tinylfu_targets_carry_the_use_counts_and_lru_none():
    for name, filtered in (("lru", False), ("tinylfu", True)):
        cache = ExpertCache(N_EXPERT, K, {0: 4}, POLICIES.get(name)(N_EXPERT, [0]))
        cache.fill_slots = K
        for ids in ([0, 1], [2, 3], [0, 2]):  # the slots full: the targets' victims come with their bars
            _token(cache, ids)
        (targets,) = cache.offer_fills()
        assert any(h >= 0 for h in targets.held)
        assert (targets.score is not None and len(targets.bar) == len(targets.slots)) == filtered


def test_an_offer_reclaims_queued_admissions_for_fill_slots():
    """A layer whose slots all wait for queued admissions still gets fill slots: the queued admissions are
    cancelled (a fill brings the miss with one crossing, the admission would be its second)."""
    from ggmoe.cache.copy import ThreadedCopyBackend

    copies = ThreadedCopyBackend(lambda il, e, s: None, delay_s=60.0)  # nothing lands while the test runs
    try:
        cache = ExpertCache(N_EXPERT, K, {0: K}, POLICIES.get("lru")(N_EXPERT, [0]), copies)
        cache.follow_tables()
        cache.after_token(0, [0, 1])  # no plan: both misses admitted, queued behind the slow link
        assert cache.tables[0].n_loading == K and not cache.tables[0].free
        cache.fill_slots = K
        (targets,) = cache.offer_fills()
        assert len(targets.slots) == K and cache.stats.layers[0].admissions_dropped > 0
    finally:
        copies.close()


def test_an_offer_keeps_the_queued_admissions_of_the_host_parts_experts():
    """An expert of the async decode's host part (``cpu_of``) is never filled: its admission is its only way
    into a slot, so an offer leaves it queued and reclaims only the others'."""
    from ggmoe.cache.copy import ThreadedCopyBackend

    copies = ThreadedCopyBackend(lambda il, e, s: None, delay_s=60.0)  # nothing lands while the test runs
    try:
        cache = ExpertCache(N_EXPERT, K, {0: K}, POLICIES.get("lru")(N_EXPERT, [0]), copies)
        cache.follow_tables()
        cache.cpu_of = {0: [e == 1 for e in range(N_EXPERT)]}  # expert 1 on the CPU, 0 filled
        cache.after_token(0, [0, 1])  # both misses admitted, queued behind the slow link
        table = cache.tables[0]
        cache.fill_slots = K
        (targets,) = cache.offer_fills()
        loading = [table.expert_in_list[s] for s, h in enumerate(table.copy) if h is not None]
        assert loading == [1] and cache.stats.layers[0].admissions_dropped == 1
        assert len(targets.slots) == 1  # the other slot waits for expert 1's admission
    finally:
        copies.close()
