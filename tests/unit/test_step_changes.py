"""Step changes (ggmoe.cache.step): what the cache decided, checked without a model."""

from __future__ import annotations

import numpy as np
import pytest
from test_stride_cache import _split_cache

from ggmoe.cache import ExpertCache
from ggmoe.cache.copy import CopyHandle, NullCopyBackend, Priority
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.step import EMPTY_STEP, Flip, StepChanges, StepLog

pytestmark = pytest.mark.unit


def _handle(i: int, priority: Priority) -> CopyHandle:
    return CopyHandle(i, 0, i, i, priority)


def test_a_step_is_a_frozen_record_with_its_copies_by_priority_and_its_evictions_once_each():
    step = StepChanges((Flip(0, 3, -1), Flip(0, 3, -1), Flip(0, 5, 2), Flip(1, 4, -1, True), Flip(1, 6, -1)),
                    (_handle(0, Priority.ADMISSION), _handle(1, Priority.PREFETCH), _handle(2, Priority.ADMISSION)))
    assert step.evictions == ((0, 3), (1, 6))  # a bottom going back to host memory evicts no slot
    assert [h.id for h in step.by_priority(Priority.ADMISSION)] == [0, 2]
    assert step.by_priority(Priority.DEMAND) == ()
    with pytest.raises(AttributeError):
        step.flips = ()  # type: ignore[misc]
    assert step and not EMPTY_STEP


def test_a_log_is_cut_into_steps_and_an_empty_step_is_the_shared_empty_record():
    log = StepLog()
    assert log.take() is EMPTY_STEP
    log.flips.append(Flip(0, 1, 0))
    first = log.take()
    assert first.flips == (Flip(0, 1, 0),) and first.copies == ()
    assert log.take() is EMPTY_STEP  # taken once


def test_a_cache_nobody_follows_logs_nothing():
    cache = ExpertCache(8, 2, {0: 4}, POLICIES.get("lru")(8, [0]), NullCopyBackend(), bytes_per_expert={0: 10})
    cache.route(0, np.asarray([[1, 2]]))
    assert cache.take_step() is EMPTY_STEP and cache.tables[0].log is None


def test_following_starts_with_every_landed_slot_then_logs_each_change_in_order():
    cache = ExpertCache(8, 2, {0: 2}, POLICIES.get("lru")(8, [0]), NullCopyBackend(), bytes_per_expert={0: 10})
    cache.route_flat(0, [1, 2])  # lands at once: both ready before anybody follows
    cache.follow_tables()
    first = cache.take_step()
    assert sorted(first.flips) == [Flip(0, 1, cache.tables[0].slot_of_list[1]),
                                   Flip(0, 2, cache.tables[0].slot_of_list[2])]
    slot_of_1 = cache.tables[0].slot_of_list[1]
    cache.route_flat(0, [2, 3])  # 3 evicts 1 (LRU): 1's flip to host comes before 3's flip to its slot
    step = cache.take_step()
    assert step.flips.index(Flip(0, 1, -1)) < step.flips.index(Flip(0, 3, slot_of_1))
    assert [(h.expert, h.slot, h.priority) for h in step.copies] == [(3, slot_of_1, Priority.DEMAND)]
    assert step.evictions == ((0, 1),)


def test_a_split_layers_bottoms_flip_to_their_buffers_once_landed_and_back_when_released():
    cache, copies = _split_cache()
    table = cache.tables[0]
    for slot, e in enumerate((1, 2)):  # tops of 1 and 2 readable
        table.place(e, slot, None)
        table.free.remove(slot)
    cache.follow_tables()
    assert {f.expert for f in cache.take_step().flips} == {1, 2}
    cache.prefetch(0, [1, 2], free_only=True)  # their bottoms into the two empty buffers
    step = cache.take_step()
    assert step.flips == () and [(h.expert, h.slot) for h in step.copies] == [(1, -1), (2, -2)]
    copies.landed |= {h.id for h in copies.handles}
    cache.seen_start(0, [1])
    cache.keep_free = {0: 2}
    cache.after_token(0, [1])  # 1's bottom read; 2's never read: released for the next token
    flips = cache.take_step().flips
    assert Flip(0, 1, 0, True) in flips and Flip(0, 2, 1, True) in flips
    assert flips.index(Flip(0, 2, 1, True)) < flips.index(Flip(0, 2, -1, True))
