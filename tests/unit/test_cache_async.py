"""The cache's asynchronous side: slot states, copy backends, priorities, the injected clock, policy events."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ggmoe.cache import (
    ExpertCache,
    ManualClock,
    NullCopyBackend,
    Priority,
    SlotState,
    ThreadedCopyBackend,
)
from ggmoe.cache.policies import POLICIES, Policy

pytestmark = pytest.mark.unit

E, K = 8, 2


def test_a_miss_goes_empty_loading_ready():
    states = []

    class Watching(NullCopyBackend):
        def wait(self, handles):
            states.extend(cache.tables[0].state[h.slot] for h in handles)  # while in flight

    cache = ExpertCache(E, K, {0: 4}, POLICIES.get("lru")(E, [0]), copies=Watching())
    assert cache.tables[0].state == [SlotState.EMPTY] * 4
    slots = cache.route(0, np.array([[3, 5]], dtype=np.int32))
    assert states == [SlotState.LOADING, SlotState.LOADING]
    t = cache.tables[0]
    assert [t.state[s] for s in slots.ravel()] == [SlotState.READY, SlotState.READY]
    assert all(t.copy[s] is None for s in slots.ravel())


def test_threaded_backend_lands_after_its_delay():
    seen = []
    b = ThreadedCopyBackend(lambda il, e, s: seen.append((il, e, s)), delay_s=0.2)
    try:
        h = b.submit(0, 3, 1, Priority.DEMAND)
        assert not b.done(h)  # not before the delay
        t0 = time.perf_counter()
        b.wait([h])
        assert time.perf_counter() - t0 > 0.1
        assert b.done(h) and seen == [(0, 3, 1)]
    finally:
        b.close()


def test_threaded_backend_runs_demand_before_prefetch_and_cancels_queued_copies():
    gate = threading.Event()
    order = []

    def copy(il, e, s):
        gate.wait(5)
        order.append(e)

    b = ThreadedCopyBackend(copy)
    try:
        first = b.submit(0, 0, 0, Priority.PREFETCH)  # taken by the worker at once, blocks on the gate
        time.sleep(0.05)
        p1 = b.submit(0, 1, 1, Priority.PREFETCH)
        p2 = b.submit(0, 2, 2, Priority.PREFETCH)
        a = b.submit(0, 3, 3, Priority.ADMISSION)
        d = b.submit(0, 4, 4, Priority.DEMAND)
        assert b.cancel(p2)  # still queued: dropped
        gate.set()
        b.wait([first, p1, a, d, p2])
        assert order == [0, 4, 3, 1]  # the running one, then demand, admission, prefetch; p2 never ran
        assert not b.cancel(p1)  # already landed
    finally:
        b.close()


def test_threaded_backend_reports_a_failed_copy_to_the_waiter():
    def copy(il, e, s):
        raise OSError("link down")

    b = ThreadedCopyBackend(copy)
    try:
        h = b.submit(0, 1, 0, Priority.DEMAND)
        with pytest.raises(OSError, match="link down"):
            b.wait([h])
    finally:
        b.close()


def test_the_injected_clock_makes_wait_times_exact():
    clock = ManualClock()

    class Slow(NullCopyBackend):
        def wait(self, handles):
            clock.advance(0.25 * len(list(handles)))  # 250 ms per copy on the virtual timeline

    cache = ExpertCache(E, K, {0: 4}, POLICIES.get("lru")(E, [0]), copies=Slow(), clock=clock)
    cache.route(0, np.array([[1, 2]], dtype=np.int32))  # two misses
    cache.route(0, np.array([[1, 2]], dtype=np.int32))  # two hits: no wait
    cache.route(0, np.array([[1, 6]], dtype=np.int32))  # one miss
    st = cache.stats.layers[0]
    assert st.wait_s == pytest.approx(0.75) and st.hook_s == pytest.approx(0.75)
    assert (st.hits, st.misses) == (3, 3)


def test_policy_receives_events_in_order_and_the_future_when_known():
    events = []

    class Logging(Policy):
        def on_access(self, il, experts, clock):
            events.append(("access", tuple(experts)))

        def on_insert(self, il, expert, clock):
            events.append(("insert", expert))

        def on_evict(self, il, expert):
            events.append(("evict", expert))

        def set_future(self, il, next_use):
            self.next_use = dict(next_use)

        def victim(self, il, candidates, clock):
            # Belady's rule: the candidate used furthest in the future
            return max(candidates, key=lambda e: self.next_use.get(e, float("inf")))

    cache = ExpertCache(E, K, {0: 2}, Logging(E, [0]))
    cache.route_flat(0, [0, 1], next_use={0: 3, 1: 2})
    cache.route_flat(0, [2], next_use={0: 3, 1: 2, 2: 9})  # evicts 0 (used at 3), keeps 1 (used at 2)
    assert events == [("insert", 0), ("insert", 1), ("access", (0, 1)),
                      ("evict", 0), ("insert", 2), ("access", (2,))]
    assert sorted(cache.tables[0].resident()) == [1, 2]


def test_on_demand_is_a_policy_that_releases_everything():
    cache = ExpertCache(E, K, {0: 4}, POLICIES.get("on-demand")(E, [0]))
    cache.route(0, np.array([[1, 2]], dtype=np.int32))
    assert cache.tables[0].resident() == [] and cache.tables[0].free == [0, 1, 2, 3]
    cache.route(0, np.array([[1, 2]], dtype=np.int32))
    assert (cache.stats.layers[0].hits, cache.stats.layers[0].misses) == (0, 4)


def test_a_slot_still_loading_is_waited_for_before_it_is_read():
    b = ThreadedCopyBackend(lambda il, e, s: None, delay_s=0.05)
    try:
        cache = ExpertCache(E, K, {0: 4}, POLICIES.get("lru")(E, [0]), copies=b)
        t = cache.tables[0]
        h = b.submit(0, 5, 0, Priority.PREFETCH)  # a prefetch in flight into slot 0
        t.free.remove(0)
        t.place(5, 0, h)
        assert t.state[0] == SlotState.LOADING and t.n_loading == 1
        cache.route(0, np.array([[5, 6]], dtype=np.int32))  # a hit on 5: must wait for its copy
        assert b.done(h) and t.state[0] == SlotState.READY and t.n_loading == 0
        assert cache.stats.layers[0].hits == 1
    finally:
        b.close()


def test_a_demand_copy_waits_at_most_one_chunk_of_a_running_prefetch():
    gate = threading.Event()
    log = []

    def chunk(il, e, s, i):
        if e == 0 and i == 0:
            gate.wait(5)  # the prefetch's first chunk is running when the demand arrives
        log.append((e, i))

    b = ThreadedCopyBackend(lambda il, e, s: None, chunks=3, copy_chunk=chunk)
    try:
        pre = b.submit(0, 0, 0, Priority.PREFETCH)
        time.sleep(0.05)
        dem = b.submit(0, 7, 1, Priority.DEMAND)
        assert not b.cancel(pre)  # a chunk of it already ran: a half-written slot is never dropped
        gate.set()
        b.wait([dem, pre])
        assert log == [(0, 0), (7, 0), (7, 1), (7, 2), (0, 1), (0, 2)]
    finally:
        b.close()


def test_prefetches_run_by_rank_within_their_priority():
    gate = threading.Event()
    order = []

    def copy(il, e, s):
        gate.wait(5)
        order.append(e)

    b = ThreadedCopyBackend(copy)
    try:
        first = b.submit(0, 0, 0, Priority.PREFETCH)
        time.sleep(0.05)
        hs = [b.submit(0, e, e, Priority.PREFETCH, rank) for e, rank in ((1, -0.2), (2, -0.9), (3, -0.5))]
        gate.set()
        b.wait([first, *hs])
        assert order == [0, 2, 3, 1]  # fMoE's p / distance, highest first (lowest rank)
    finally:
        b.close()


def test_threaded_backend_promotes_a_queued_copy():
    from ggmoe.cache.copy import Priority, ThreadedCopyBackend

    gate = threading.Event()
    b = ThreadedCopyBackend(lambda il, e, s: gate.wait(5))
    try:
        first = b.submit(0, 0, 0, Priority.PREFETCH)
        queued = [b.submit(0, e, e, Priority.PREFETCH) for e in range(1, 4)]
        b.promote(queued[-1])
        gate.set()
        b.wait([queued[-1]])
        finished = [h.id for h in b.order]
        assert finished.index(queued[-1].id) < finished.index(queued[0].id) or queued[0].id not in finished
        assert first.id in finished
    finally:
        b.close()


class FakeStream:
    """A copy stream whose chunks land only when some waiter waits (as a synchronize would land them); a gate
    holds the worker's first wait. A chunk's marker is its position in stream order."""

    n_chunks = 3

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.issued: list[tuple[int, int]] = []  # (expert, chunk) in stream order
        self.landed = 0  # chunks of issued that have landed
        self.gate = threading.Event()
        self.syncs = 0

    def issue_chunk(self, il, expert, slot, i):
        with self.lock:
            self.issued.append((expert, i))
            return len(self.issued)

    def ready(self, marker):
        with self.lock:
            return marker <= self.landed

    def wait_marker(self, marker):
        if threading.current_thread().name == "ggmoe-copies":
            self.gate.wait(5)  # the worker's chunk is "on the link" until the test opens the gate
        with self.lock:
            self.landed = max(self.landed, marker)  # in order: everything before it landed too
            self.syncs += 1


def _stream_backend():
    from ggmoe.cache.copy import StreamCopyBackend

    s = FakeStream()
    return s, StreamCopyBackend(s)


def test_stream_queue_puts_demand_behind_one_low_priority_chunk_at_most():
    s, b = _stream_backend()
    try:
        p0 = b.submit(0, 10, 0, Priority.PREFETCH)  # the worker issues its first chunk and waits on the gate
        deadline = time.monotonic() + 5
        while not s.issued and time.monotonic() < deadline:
            time.sleep(0.001)
        p1 = b.submit(0, 11, 1, Priority.PREFETCH)
        a = b.submit(0, 12, 2, Priority.ADMISSION)
        d = b.submit(0, 13, 3, Priority.DEMAND)
        # the demand copy went on the stream at once, right behind the one prefetch chunk in flight
        assert s.issued == [(10, 0), (13, 0), (13, 1), (13, 2)]
        assert not b.done(d)
        b.wait([d])  # the main thread's synchronize lands it (and the prefetch chunk before it)
        assert b.done(d)
        assert b.cancel(p1)  # still queued: dropped, never put on the stream
        assert not b.cancel(d)  # on the stream already
        b.promote(a)  # a layer will wait for the admission: on the stream now, ahead of p0's other chunks
        s.gate.set()
        b.wait([p0, a, p1])
        assert [e for e, _ in s.issued] == [10, 13, 13, 13, 12, 12, 12, 10, 10]
        assert b.done(p0) and b.done(a)
        assert [h for h, _ in b.chunk_log] == [p0.id] * 3  # the worker ran p0 alone; p1 never ran
    finally:
        s.gate.set()
        b.close()


def test_stream_queue_promotes_a_queued_copy_onto_the_stream():
    s, b = _stream_backend()
    try:
        p0 = b.submit(0, 10, 0, Priority.PREFETCH)
        deadline = time.monotonic() + 5
        while not s.issued and time.monotonic() < deadline:
            time.sleep(0.001)
        p1 = b.submit(0, 11, 1, Priority.PREFETCH)
        p2 = b.submit(0, 12, 2, Priority.PREFETCH)
        b.promote(p2)  # a layer waits for p2: it jumps p1 and goes on the stream now
        assert s.issued == [(10, 0), (12, 0), (12, 1), (12, 2)]
        b.wait([p2])
        assert b.done(p2) and not b.cancel(p2)
        b.promote(p0)  # begun by the worker: it goes on at demand priority, chunk by chunk
        s.gate.set()
        b.wait([p0])
        b.wait([p1])  # waiting promotes a copy still queued, as the cache does before it waits
        assert s.issued[4:] == [(10, 1), (10, 2), (11, 0), (11, 1), (11, 2)]
        assert all(b.done(h) for h in (p0, p1, p2))
    finally:
        s.gate.set()
        b.close()


def test_stream_queue_drives_the_cache_exactly():
    """The cache over the stream queue: prefetches, a waited-for prefetch promoted, demand misses."""
    s, b = _stream_backend()
    s.gate.set()  # no holding back: the worker's chunks land as it synchronizes
    try:
        cache = ExpertCache(E, K, {0: 4}, POLICIES.get("lru")(E, [0]), copies=b)
        cache.route(0, np.array([[0, 1]], dtype=np.int32))
        assert cache.prefetch(0, [2, 3]) == 2
        slots = cache.route(0, np.array([[2, 4]], dtype=np.int32))  # 2 prefetched (waited if need be), 4 missed
        t = cache.tables[0]
        assert [t.expert_in_list[x] for x in slots.ravel()] == [2, 4]
        assert all(t.state[x] == SlotState.READY for x in slots.ravel())
        experts = {e for e, _ in s.issued}
        assert {0, 1, 2, 4} <= experts
        assert sorted(c for e, c in s.issued if e == 4) == [0, 1, 2]  # every chunk of the demand copy
    finally:
        b.close()


def test_a_link_in_front_of_a_stream_lands_a_copy_only_when_its_markers_are_ready():
    """LinkStreamCopyBackend: the link's worker puts chunks on the stream without waiting for them; a copy is
    done once the link moved every chunk and the stream's readiness query says they landed."""
    from ggmoe.cache.copy import LinkStreamCopyBackend

    s = FakeStream()
    b = LinkStreamCopyBackend(s, delay_s=1e-6)
    try:
        h = b.submit(0, 5, 1, Priority.ADMISSION)
        deadline = time.monotonic() + 30
        while len(s.issued) < 3 and time.monotonic() < deadline:  # the link moves all three chunks
            time.sleep(0.001)
        assert s.issued == [(5, 0), (5, 1), (5, 2)] and s.syncs == 0  # the worker never waited on a marker
        assert not b.done(h)  # on the stream, not landed: the readiness query says no
        with s.lock:
            s.landed = 2
        assert not b.done(h)  # two of three chunks
        with s.lock:
            s.landed = 3
        assert b.done(h) and b.done(h)  # and stays done
        d = b.submit(0, 6, 2, Priority.DEMAND)
        b.wait([d])  # blocks until the link moved it, then waits on its markers
        assert b.done(d) and s.issued[3:] == [(6, 0), (6, 1), (6, 2)]
        q = b.submit(0, 7, 3, Priority.PREFETCH)
        if b.cancel(q):  # not started: never put on the stream, and done as cancelled
            assert b.done(q) and all(e != 7 for e, _ in s.issued)
    finally:
        b.close()
