"""A simulated copy engine on a virtual clock: the one PCIe link, two priorities, copies in chunks.

``LinkCopyBackend`` implements the cache's ``CopyBackend`` protocol, so the
simulator drives the same ``ExpertCache`` (and ``Prefetcher``) the engine does.
Time is the cache's ``ManualClock``: the GPU stream's time. The link runs one
chunk at a time (an expert copy is ``n_chunks`` chunks, one per expert tensor
kind, each paying the profile's per-copy latency); after every chunk it takes
the most urgent queued job (demand, then admission, then prefetch; within a
priority the lower rank, then the older), so urgent work waits at most one
chunk, as the engine's copy queue does. A job cannot start before it was
submitted. ``wait`` blocks the GPU: it advances the clock to the moment the last
awaited copy lands. With no ``profile`` every copy lands at once (the CPU
build's synchronous copies: replaying an engine's trace then gives exactly the
engine's counts).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import operator
from collections.abc import Iterable, Iterator

from ggmoe.cache.clock import ManualClock
from ggmoe.cache.copy import CopyHandle, Priority, bottom_buffer
from ggmoe.cache.hardware import HardwareProfile
from ggmoe.cache.split import LayerSplit

_ADMISSION = Priority.ADMISSION


class _Handle(CopyHandle):
    """A copy handle that can carry whether it has landed by the clock's time (``FlagLinkCopyBackend``); equal
    and hashed as the CopyHandle it is (the tuple)."""

    _landed_flag = False  # not a field: set on the instance (its ``__dict__``) once landed by the time asked


class _Job:
    """One copy on the link (a plain class with slots: a replay makes millions)."""

    __slots__ = ("key", "handle", "submitted", "chunks_left", "chunk_s", "started", "live", "ready")

    def __init__(self, key: tuple[int, float, int], handle: CopyHandle, submitted: float, chunks_left: int,
                 chunk_s: float) -> None:
        self.key = key  # (priority, rank, id): the lower, the more urgent
        self.handle = handle
        self.submitted = submitted  # s
        self.chunks_left = chunks_left
        self.chunk_s = chunk_s  # s one chunk takes on the link
        self.started = False
        self.live = True  # neither finished nor cancelled
        self.ready = False  # in the ready heap (submitted by a chunk's start)


class LinkCopyBackend:
    """Copies of ``bytes_per_expert[il]`` bytes over one simulated link (see the module docstring); a split
    layer's (``split``, MoEpic) move its top segment into a slot and its bottom into a bottom buffer."""

    __slots__ = ("clock", "bytes_per_expert", "split", "profile", "n_chunks", "_ids", "_queue", "_pending", "_ready", "_fifo",
                 "_landed", "_busy_until", "_settled", "busy_s", "late_prefetches", "_chunk_of", "_track",
                 "_future", "_idle", "_idle_handles")  # a replay asks
    # millions of times: slots are read faster than a dict's entries

    def __init__(self, clock: ManualClock, bytes_per_expert: dict[int, int], profile: HardwareProfile | None,
                 n_chunks: int = 3, split: dict[int, LayerSplit] | None = None) -> None:
        self.clock = clock
        self.bytes_per_expert = bytes_per_expert
        self.split = split or {}
        self.profile = profile
        self.n_chunks = max(1, n_chunks)
        self._ids = itertools.count()
        # Jobs not finished nor cancelled, by handle id. Submissions come at a clock that never goes back, so
        # jobs not yet submitted by the link's time wait in submission order (_pending); the others sit in a
        # heap by key (_ready: entries (priority, rank, id, job), the key's fields flat, which a heap compares
        # faster than a nested key; an entry whose job is gone or whose priority changed is stale)
        self._queue: dict[int, _Job] = {}
        self._pending: collections.deque[_Job] = collections.deque()
        self._ready: list[tuple[int, float, int, _Job]] = []
        # Ready admissions of rank 0 (the async decode's, millions in a replay) wait here instead: they become
        # ready in submission order, which is their key order, so a FIFO keeps them in order without a heap's
        # comparisons. An entry whose job is gone or was promoted (now in the heap) is stale.
        self._fifo: collections.deque[_Job] = collections.deque()
        self._landed: dict[int, float] = {}  # handle id -> landing time (s)
        self._busy_until = 0.0  # s: the link is busy with a chunk until then
        self._settled = -1.0  # clock time by which every chunk that starts before it has run
        self.busy_s = 0.0  # s the link spent copying
        self.late_prefetches = 0  # prefetch copies a layer had to wait for (not landed in time)
        self._chunk_of: dict[int, float] = {}  # il -> s one chunk of a whole expert's copy takes (no split)
        self._track = False  # FlagLinkCopyBackend: landings are kept in _future until the clock reaches them
        self._future: list[tuple[float, int, _Handle]] = []  # (landing time, id, handle), a heap
        # Demand copies submitted at the clock's time while nothing else was queued (the sync decode's misses),
        # held without a job until the wait that the same cache call makes next: (handle, s per chunk, s
        # submitted). Any other use of the link first makes them jobs (_jobs_for_idle), as submit would have.
        self._idle: list[tuple[_Handle, float, float]] = []
        self._idle_handles: list[_Handle] = []

    @property
    def lands_later(self) -> bool:
        """With a cost model a copy takes time: it never lands within the cache call that submits it (the
        clock moves only between calls and in a wait). Without one every copy lands when submitted."""
        return self.profile is not None

    def copy_bytes(self, h: CopyHandle) -> int:
        """Bytes one copy moves: a whole expert, or a split layer's top (into a slot) or bottom (a buffer)."""
        sp = self.split.get(h.il)
        if sp is None:
            return self.bytes_per_expert.get(h.il, 0)
        return sp.bottom_bytes if bottom_buffer(h.slot) is not None else sp.top_bytes

    def _chunk_s(self, h: CopyHandle) -> float:
        return self._chunk_of_bytes(self.copy_bytes(h))

    def _chunk_of_bytes(self, nbytes: int) -> float:
        """s one chunk of a copy of ``nbytes`` takes on the link."""
        p = self.profile
        return p.copy_latency_s + nbytes / self.n_chunks / p.copy_bytes_per_s

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        h = _Handle(next(self._ids), il, expert, slot, priority if type(priority) is Priority else Priority(priority))
        if self.profile is None:
            self._landed[h.id] = self.clock.now()
            h._landed_flag = True
            return h
        cs = self._chunk_of.get(il)
        if cs is None:
            cs = self._chunk_s(h)
            if il not in self.split:
                self._chunk_of[il] = cs
        if priority == Priority.DEMAND and not rank and not self._queue:  # the link has nothing else queued
            self._idle.append((h, cs, self.clock.t))
            self._idle_handles.append(h)
            return h
        if self._idle:
            self._jobs_for_idle()
        job = _Job((priority, rank, h.id), h, self.clock.t, self.n_chunks, cs)  # an IntEnum orders as its int
        self._queue[h.id] = job
        self._pending.append(job)
        # _settled stays: a job submitted now starts at now or later, so every chunk that starts before a time
        # already settled has run still (an advance runs only chunks that start before the clock's time)
        return h

    def demand_now(self, il: int, n: int) -> bool:
        """``n`` demand copies of whole experts of layer ``il`` submitted at the clock's time and waited for at
        once, when nothing else is queued (the sync decode's misses): they run whole from the link's next free
        moment, one after another, and the clock moves to the last one's landing, exactly as ``submit`` then
        ``wait`` (``_wait_idle``) would, without a handle or job per copy. False, having done nothing, when
        something is queued or held (the copies must then be jobs among the others) or the layer is split."""
        if self._queue or self._idle or il in self.split:
            return False
        if self.profile is None:  # every copy lands when submitted: nothing moves
            return True
        cs = self._chunk_of.get(il)
        if cs is None:
            cs = self._chunk_of[il] = self._chunk_of_bytes(self.bytes_per_expert.get(il, 0))
        now = self.clock.t
        t, busy = (self._busy_until if self._busy_until > now else now), self.busy_s
        for _ in range(n * self.n_chunks):  # chunk by chunk: the same additions as _wait_idle's
            t = t + cs
            busy += cs
        self._ran_until(t, busy, now)
        return True

    def _jobs_for_idle(self) -> None:
        """The held demand copies become queued jobs, in submission order, as ``submit`` makes them."""
        n = self.n_chunks
        for h, cs, t in self._idle:
            job = _Job((Priority.DEMAND, 0.0, h.id), h, t, n, cs)
            self._queue[h.id] = job
            self._pending.append(job)
        self._idle.clear()
        self._idle_handles.clear()

    def _wait_idle(self) -> None:
        """``wait`` for exactly the held demand copies, submitted at the clock's time: the link has nothing else
        queued, so they run whole from its next free moment, one after another in submission order (``_drain``
        and ``_run``'s additions), and the clock moves to the last one's landing."""
        landed, busy, n = self._landed, self.busy_s, self.n_chunks
        now = self.clock.t
        t = self._busy_until if self._busy_until > now else now
        for h, cs, _ in self._idle:
            for _ in range(n):
                t = t + cs
                busy += cs
            landed[h.id] = t
            if self._track:
                heapq.heappush(self._future, (t, h.id, h))
        self._idle.clear()
        self._idle_handles.clear()
        self._ran_until(t, busy, now)

    def _ran_until(self, t: float, busy: float, now: float) -> None:
        """With nothing queued, the link ran whole copies from ``now`` until ``t`` (s), ``busy`` its busy time
        since the start: the GPU waited for them, so the clock moves to ``t``."""
        self._busy_until, self.busy_s = t, busy
        self._ready.clear()  # every entry is stale: no job is queued
        self._fifo.clear()
        self._pending.clear()
        if t > now:
            self.clock.advance(t - now)
        if self._track:
            self.settle()

    def _top(self) -> _Job | None:
        """The most urgent ready job (stale heap entries dropped)."""
        q = self._fifo
        while q and (not q[0].live or q[0].key[0] is not _ADMISSION):  # gone, or promoted into the heap
            q.popleft()
        r = self._ready
        while r:
            prio, _, _, job = r[0]
            if job.live and prio == job.key[0]:  # promote raises a job's priority: the entry with the old is stale
                return q[0] if q and q[0].key < job.key else job
            heapq.heappop(r)
        return q[0] if q else None

    def _make_ready(self, start: float) -> bool:
        """Jobs submitted by ``start`` join the ready heap; whether any did."""
        p = self._pending
        pushed = False
        while p and (not p[0].live or p[0].submitted <= start):
            job = p.popleft()
            if job.live:
                job.ready = pushed = True
                self._push_ready(job)
        return pushed

    def _push_ready(self, job: _Job) -> None:
        """``job`` joins the ready jobs (submission order: see ``_fifo``)."""
        key = job.key
        if key[0] is _ADMISSION and not key[1]:
            self._fifo.append(job)
        else:
            heapq.heappush(self._ready, (*key, job))

    def _step(self, until: float | None) -> int | None:
        """Run the most urgent job available at the link's time, chunk after chunk while no more urgent job
        has been submitted by the next chunk's start (the same order as one chunk per call: after every chunk
        the most urgent available job runs); the handle id of a job that finished, -1 if none finished, None
        when nothing can run before ``until`` (None: whenever)."""
        if self._top() is not None:  # ready jobs were submitted by an earlier chunk's start: the link decides
            start = self._busy_until
        else:
            while self._pending and not self._pending[0].live:
                self._pending.popleft()
            if not self._pending:
                return None
            start = max(self._busy_until, self._pending[0].submitted)
        if until is not None and start >= until:
            return None
        self._make_ready(start)
        job = self._top()
        job.started = True
        while True:
            self._busy_until = start + job.chunk_s
            self.busy_s += job.chunk_s
            job.chunks_left -= 1
            if job.chunks_left == 0:
                job.live = False
                del self._queue[job.handle.id]
                self._landed[job.handle.id] = self._busy_until
                if self._track:
                    heapq.heappush(self._future, (self._busy_until, job.handle.id, job.handle))
                return job.handle.id
            start = self._busy_until
            if until is not None and start >= until:
                return -1
            if self._make_ready(start) and self._top() is not job:  # nothing new: the job is still the most urgent
                return -1

    def _advance(self) -> None:
        """Run every chunk that starts before now (a chunk started finishes, even past now)."""
        now = self.clock.now()
        if not self._queue or now == self._settled:
            return
        if self._busy_until >= now:  # every chunk yet to run starts at or after the link's next free moment
            self._settled = now
            return
        while self._step(now) is not None:
            pass
        self._settled = now

    def done(self, handle: CopyHandle) -> bool:
        if self._idle:
            self._jobs_for_idle()
        now = self.clock.t  # the ManualClock's time, read directly: the async decode asks millions of times
        if now != self._settled and self._queue:  # _advance's own check, inlined
            self._advance()
        t = self._landed.get(handle.id)
        return t is not None and t <= now

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        if type(handles) is not list:
            handles = list(handles)
        if self._idle:
            if (self._idle[0][2] == self.clock.t and len(handles) == len(self._idle_handles)
                    and all(map(operator.is_, handles, self._idle_handles))):
                self._wait_idle()
                return
            self._jobs_for_idle()
        if self._queue and self.clock.t != self._settled:  # _advance's own check, inlined
            self._advance()
        queue, pending = self._queue, set()
        for h in handles:
            if h.priority is Priority.PREFETCH and not self._done_now(h):
                self.late_prefetches += 1
            if h.id in queue:  # neither landed nor cancelled
                pending.add(h.id)
        if pending:
            self._drain(pending)
        landed, last = self._landed, 0.0
        for h in handles:  # the last landing (max of the landing times, 0 when none)
            t = landed.get(h.id, 0.0)
            if t > last:
                last = t
        if last > self.clock.now():
            self.clock.advance(last - self.clock.now())
        if self._track:
            self.settle()

    def settle(self) -> None:
        """Before the cache is called (and after a wait moved the clock): ``FlagLinkCopyBackend`` marks every
        copy landed by now; here ``done`` asks lazily, so nothing to do."""

    def _drain(self, pending: set[int]) -> None:
        """``_step(None)`` until every job of ``pending`` landed, in one loop. Nothing is submitted while the GPU
        waits, and after ``_advance`` the link's next start is at or after every submission: every queued job
        is ready then, so the jobs run whole, one after another in key order, each chunk's end the previous
        one's plus its time (the same additions as chunk by chunk)."""
        if (self._ready or self._fifo) and self._top() is not None:
            start = self._busy_until
        else:
            jobs = [j for j in self._pending if j.live]
            if not jobs:
                self._pending.clear()
                return
            start = max(self._busy_until, jobs[0].submitted)
            if len(jobs) == 1 or all(a.key < b.key for a, b in zip(jobs, jobs[1:], strict=False)):  # in key order: a layer's demand
                self._pending.clear()
                rest = iter(jobs)
                self._run(rest, pending, start)
                for job in rest:  # what the list had left joins the ready heap, as _make_ready would have put it
                    job.ready = True
                    self._push_ready(job)
                return
        self._make_ready(start)
        self._run(iter(self._top, None), pending, start)

    def _run(self, jobs: Iterator[_Job], pending: set[int], t: float) -> None:
        """Run ``jobs`` whole from ``t``, one after another, until every job of ``pending`` landed."""
        busy, queue, landed = self.busy_s, self._queue, self._landed
        for job in jobs:
            job.started = True
            cs = job.chunk_s
            for _ in range(job.chunks_left):
                t = t + cs
                busy += cs
            job.chunks_left = 0
            job.live = False
            hid = job.handle.id
            del queue[hid]
            landed[hid] = t
            if self._track:
                heapq.heappush(self._future, (t, hid, job.handle))
            pending.discard(hid)
            if not pending:
                break
        self._busy_until = t
        self.busy_s = busy

    def _done_now(self, h: CopyHandle) -> bool:
        t = self._landed.get(h.id)
        return t is not None and t <= self.clock.now()

    def cancel(self, handle: CopyHandle) -> bool:
        if self._idle:
            self._jobs_for_idle()
        if self._queue and self.clock.t != self._settled:  # _advance's own check, inlined (a replay cancels millions)
            self._advance()
        j = self._queue.get(handle.id)
        if j is not None and not j.started:
            j.live = False
            del self._queue[handle.id]
            return True
        return False

    def promote(self, handle: CopyHandle) -> None:
        """Serve a queued copy at demand priority from now on (a layer waits for it)."""
        if handle.priority is Priority.DEMAND:  # served first already (promoted ones keep their handle's)
            return
        if self._idle:
            self._jobs_for_idle()
        self._advance()
        j = self._queue.get(handle.id)
        if j is not None and j.key[0] > Priority.DEMAND:
            j.key = (int(Priority.DEMAND), j.key[1], j.key[2])
            if j.ready:  # a new entry; the old one is stale
                heapq.heappush(self._ready, (*j.key, j))

    def remaining_s(self, handle: CopyHandle) -> float | None:
        """Seconds until ``handle`` lands if the link served it next (0: landed; None: unknown)."""
        if self._idle:
            self._jobs_for_idle()
        self._advance()
        if self._done_now(handle):
            return 0.0
        if handle.id in self._landed:  # its last chunk is running
            return self._landed[handle.id] - self.clock.now()
        j = self._queue.get(handle.id)
        if j is not None:
            return j.chunks_left * j.chunk_s + max(0.0, self._busy_until - self.clock.now())
        return None

    def occupy(self, seconds: float) -> float:
        """The GPU reads expert weights from pinned host memory (the async decode's misses, a split layer's
        bottoms): ``seconds`` of the link's time. Returns how long the reads take. The SMs' reads and the copy
        engine share the link: while both have work each moves at half its rate, so reads that find
        ``backlog`` seconds of copies queued take ``seconds + min(seconds, backlog)``, and the copies have
        moved ``min(seconds, backlog)`` meanwhile: they are delayed by ``seconds`` (an async token on an H200
        moves its reads and its admissions' copies in the sum of their times: docs/benchmarks.md)."""
        if self.profile is None or seconds <= 0:
            return 0.0
        if self._idle:
            self._jobs_for_idle()
        self._advance()
        now = self.clock.now()
        backlog = max(0.0, self._busy_until - now)
        for job in self._queue.values():  # only min(seconds, backlog) matters: stop once it is reached
            if backlog >= seconds:
                break
            if job.submitted <= now:
                backlog += job.chunks_left * job.chunk_s
        self._busy_until = max(self._busy_until, now) + seconds
        self.busy_s += seconds
        return seconds + min(seconds, backlog)

    def close(self) -> None:
        self._idle.clear()
        self._idle_handles.clear()
        self._queue.clear()
        self._pending.clear()
        self._ready.clear()
        self._fifo.clear()


class FlagLinkCopyBackend(LinkCopyBackend):
    """The same link, whose ``done`` is a C-level attribute read of the handle (``_landed_flag``) instead of a
    method: the async decode's controller asks it of every copy in flight for every layer of every token
    (tens of millions of times in a long replay). The flags are set by ``settle``, which the simulator calls
    before each call into the cache; inside a call the clock moves only in ``wait``, which settles again, and
    a copy submitted during a call cannot land before its clock's time. So every answer is the lazy one."""

    __slots__ = ()
    done = operator.attrgetter("_landed_flag")  # not a descriptor: link.done(h) is h._landed_flag

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._track = True

    def settle(self) -> None:
        if self._idle:
            self._jobs_for_idle()
        now = self.clock.t
        if self._queue and now != self._settled:
            self._advance()
        future = self._future
        while future and future[0][0] <= now:
            heapq.heappop(future)[2]._landed_flag = True
