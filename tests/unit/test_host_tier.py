"""The host tier and the copies through it, on a held disk: a read lands only when the test releases it."""

from __future__ import annotations

import pytest

from ggmoe.cache.copy import NullCopyBackend, Priority
from ggmoe.cache.host_tier import HostMove, HostTier
from ggmoe.cache.tier_copy import TieredCopyBackend

pytestmark = pytest.mark.unit

IL = 3


class HeldReader:
    """Reads that land when ``release`` says; ``submitted`` lists (il, expert, slot) in order."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int, int]] = []
        self.landed: set[int] = set()
        self.closed = False

    def submit(self, il: int, expert: int, slot: int) -> int:
        self.submitted.append((il, expert, slot))
        return len(self.submitted) - 1

    def done(self, marker: object) -> bool:
        return marker in self.landed

    def wait(self, marker: object) -> None:
        self.landed.add(marker)  # a blocking wait: the read lands

    def release(self, *markers: int) -> None:
        self.landed.update(markers)

    def close(self) -> None:
        self.closed = True


def _tier(n_slots: int = 2, n_expert: int = 8, max_predicted: int = 8) -> tuple[HostTier, HeldReader]:
    reader = HeldReader()
    return HostTier([IL], n_expert, n_slots, {IL: 100}, reader, max_predicted=max_predicted), reader


def test_a_read_lands_only_when_the_disk_says_so():
    tier, reader = _tier()
    marker = tier.ensure(IL, 5)
    assert marker == 0 and tier.readable(IL, 5) == -1
    assert tier.ensure(IL, 5) == 0 and len(reader.submitted) == 1  # in flight: no second read
    assert tier.land() == 0
    reader.release(0)
    assert tier.land() == 1 and tier.readable(IL, 5) == 0
    assert tier.take_moves() == [HostMove(IL, 5, 0)]
    assert tier.ensure(IL, 5) is None
    st = tier.stats[IL]
    assert (st.reads, st.hits, st.bytes_read) == (1, 2, 100)


@pytest.mark.parametrize("pinned, victim", [(None, 1), (1, 2)])
def test_a_demand_evicts_the_least_recent_unpinned_expert(pinned, victim):
    tier, reader = _tier()
    for e in (1, 2):
        tier.ensure(IL, e)
        tier.wait_read(IL, e)
        tier.next_token()
    if pinned is not None:
        tier.pin(IL, pinned)
    tier.take_moves()
    tier.ensure(IL, 7)
    assert tier.take_moves()[0] == HostMove(IL, victim, -1)
    assert tier.readable(IL, victim) == -1


def test_every_slot_pinned_reads_in_place():
    tier, _ = _tier()
    for e in (1, 2):
        tier.ensure(IL, e)
        tier.wait_read(IL, e)
        tier.pin(IL, e)
    assert tier.ensure(IL, 6) is None and tier.readable(IL, 6) == -1
    assert tier.stats[IL].in_place == 1


def test_a_prediction_takes_free_slots_only_and_next_token_frees_some():
    tier, reader = _tier(n_slots=8, n_expert=12, max_predicted=2)
    for e in range(8):
        tier.ensure(IL, e)
        tier.wait_read(IL, e)
    tier.next_token()
    tier.take_moves()
    assert tier.prefetch(IL, [0]) == 0  # resident: nothing to read
    tier.ensure(IL, 7)  # asked this token: a prediction's room is never made from it
    assert tier.ensure(IL, 9, predicted=True) is None and not tier.take_moves()  # no free slot: no eviction
    tier.next_token()  # frees min(max_predicted, n_slots // 4) = 2 slots, the least recent first
    assert tier.take_moves() == [HostMove(IL, 0, -1), HostMove(IL, 1, -1)]
    assert tier.ensure(IL, 9, predicted=True) is not None


def test_predicted_reads_are_counted_when_asked_for():
    tier, reader = _tier(n_slots=4)
    tier.stats[IL].predicted_used = 10
    assert tier.prefetch(IL, [4, 5]) == 2
    tier.ensure(IL, 4)  # asked while in flight
    reader.release(0, 1)
    tier.land()
    tier.ensure(IL, 5)  # asked once landed
    st = tier.stats[IL]
    assert (st.predicted_reads, st.predicted_used, st.reads) == (2, 12, 2)


def test_a_copy_waits_for_its_read_and_pins_the_host_slot():
    tier, reader = _tier()
    copies: list[tuple[int, int, int]] = []
    backend = TieredCopyBackend(NullCopyBackend(lambda il, e, s: copies.append((il, e, s))), tier)
    h = backend.submit(IL, 4, 0, Priority.ADMISSION)
    assert not backend.done(h) and copies == []  # the read is held: the copy has not started
    reader.release(0)
    assert backend.done(h) and copies == [(IL, 4, 0)]
    assert not tier.pins  # landed: the host slot is free to go


def test_a_resident_expert_copies_at_once_and_a_cancel_before_the_read_lands_drops_the_copy():
    tier, reader = _tier()
    tier.ensure(IL, 1)
    tier.wait_read(IL, 1)
    copies: list[tuple[int, int, int]] = []
    backend = TieredCopyBackend(NullCopyBackend(lambda il, e, s: copies.append((il, e, s))), tier)
    h1 = backend.submit(IL, 1, 0, Priority.DEMAND)
    assert copies == [(IL, 1, 0)] and backend.done(h1)
    h2 = backend.submit(IL, 2, 1, Priority.PREFETCH)
    assert tier.stats[IL].predicted_reads == 1
    assert backend.cancel(h2) and backend.done(h2)
    reader.release(1)
    tier.land()
    assert copies == [(IL, 1, 0)] and tier.readable(IL, 2) >= 0  # the read went on into the host tier


def test_wait_blocks_through_the_read_then_the_copy():
    tier, reader = _tier()
    copies: list[tuple[int, int, int]] = []
    backend = TieredCopyBackend(NullCopyBackend(lambda il, e, s: copies.append((il, e, s))), tier)
    hs = [backend.submit(IL, e, e, Priority.DEMAND) for e in (2, 3)]
    backend.wait(hs)
    assert copies == [(IL, 2, 2), (IL, 3, 3)] and not tier.pins
    backend.close()
    assert reader.closed


def test_in_the_sync_decode_a_prediction_evicts_what_this_token_did_not_ask_for():
    tier, reader = _tier(n_slots=2)
    tier.predictions_evict = True
    for e in (1, 2):
        tier.ensure(IL, e)
        tier.wait_read(IL, e)
    tier.next_token()
    tier.ensure(IL, 2)  # asked this token: kept
    tier.take_moves()
    tier.stats[IL].predicted_used = 10
    assert tier.prefetch(IL, [5]) == 1
    assert tier.take_moves() == [HostMove(IL, 1, -1)]
    tier.pin(IL, 2)
    assert tier.prefetch(IL, [6]) == 0  # 2 asked for and pinned, 5's read in flight: no room


def test_a_landed_prediction_is_not_the_next_demands_victim():
    tier, reader = _tier(n_slots=2)
    tier.ensure(IL, 1)
    tier.wait_read(IL, 1)
    tier.next_token()
    tier.stats[IL].predicted_used = 10
    assert tier.prefetch(IL, [3]) == 1
    reader.release(1)
    tier.land()
    tier.next_token()
    tier.take_moves()
    tier.ensure(IL, 6)  # a demand with no free slot: evicts 1 (older), not the prediction that just landed
    assert tier.take_moves() == [HostMove(IL, 1, -1)]
