"""Copy backends: how an expert gets from host memory into a slot, with priorities and readiness.

The cache only submits copies and waits for their handles. The engine's backend
issues ggml copies (``ggmoe.engine.copies.GgmlCopyBackend``); ``NullCopyBackend``
lands every copy at once (bookkeeping, the simulator without a cost model);
``ThreadedCopyBackend`` runs copies on a worker thread in priority order with a
settable delay, so that tests exercise readiness, priorities and cancellation
with real concurrency on a CPU-only machine; ``StreamCopyBackend`` is the same
queue over a real asynchronous stream (the GPU's), demand copies issued at once.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import NamedTuple, Protocol


class Priority(IntEnum):
    """Lower runs first: a copy the running layer waits for, then admissions, then prefetches."""

    DEMAND = 0
    ADMISSION = 1
    PREFETCH = 2


class CopyHandle(NamedTuple):
    """One submitted copy of expert ``expert`` of layer ``il`` into ``slot`` (or a bottom buffer, for a
    negative ``slot``: ``bottom_buffer``). A named tuple: made once per copy, and built in C (a frozen
    dataclass's ``__init__`` costs a Python frame and a ``setattr`` per field)."""

    id: int  # unique per backend, in submission order
    il: int
    expert: int
    slot: int
    priority: Priority


def bottom_target(buffer: int) -> int:
    """The ``slot`` argument of a copy of a split expert's bottom segment into bottom buffer ``buffer``
    (MoEpic): negative, so it never names a slot; a copy into a slot of a split layer moves its top segment."""
    return -1 - buffer


def bottom_buffer(slot: int) -> int | None:
    """The bottom buffer a copy's ``slot`` argument names (``bottom_target``), or None for a slot."""
    return -1 - slot if slot < 0 else None


class CopyBackend(Protocol):
    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        """Start (or queue) the copy; returns at once. Within a priority, lower ``rank`` goes first."""

    def done(self, handle: CopyHandle) -> bool:
        """Whether the copy has landed (a landed slot may be read)."""

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        """Block until every one of ``handles`` has landed (a cancelled one counts as landed)."""

    def cancel(self, handle: CopyHandle) -> bool:
        """Drop a copy that has not started; True if it was dropped (its slot was never written)."""

    def close(self) -> None:
        """Release what the backend holds (threads, streams)."""

    # Optional (a backend with a queue): ``promote(handle)`` moves a queued copy to demand priority (a layer
    # is about to wait for it); ``remaining_s(handle)`` is the seconds until it would land if served next
    # (None: unknown), which the auto miss policy weighs against the CPU. ``lands_later`` (True: a copy never
    # lands within the cache call that submits it, as on the simulator's costed link) lets the cache skip
    # looking for copies its own admissions landed. ``demand_now(il, n)`` (the simulator's link) runs ``n``
    # demand copies of layer ``il`` and waits for them without handles when nothing else is queued (False,
    # having done nothing, otherwise).


class NullCopyBackend:
    """Every copy lands when submitted; optionally calls ``copy(il, expert, slot)`` to do it."""

    def __init__(self, copy: Callable[[int, int, int], None] | None = None) -> None:
        self._copy = copy
        self._ids = itertools.count()

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        if self._copy is not None:
            self._copy(il, expert, slot)
        return CopyHandle(next(self._ids), il, expert, slot, Priority(priority))

    def done(self, handle: CopyHandle) -> bool:
        return True

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        pass

    def cancel(self, handle: CopyHandle) -> bool:
        return False  # it already landed

    def close(self) -> None:
        pass


class ThreadedCopyBackend:
    """Copies on one worker thread, lowest priority value first (then lowest rank, then FIFO), in chunks.

    ``copy(il, expert, slot)`` does a whole copy; with ``chunks`` > 1, ``copy_chunk(il, expert, slot, i)``
    does part ``i`` (one expert tensor kind, say) and the worker picks the most urgent job again after
    each chunk, so a demand copy waits at most one chunk of a prefetch already running. ``delay_s``
    seconds pass before each chunk (a slow link), on the link's own timeline: a chunk lands ``delay_s`` after
    the previous one landed or after its copy was submitted, whichever is later, however late the worker
    thread wakes (a thread that sleeps ``delay_s`` per chunk would add its wake-up latency to every chunk:
    on a busy 2-core machine a 10 µs link then ran ten times slower than itself).
    """

    def __init__(self, copy: Callable[[int, int, int], None], delay_s: float = 0.0, chunks: int = 1,
                 copy_chunk: Callable[[int, int, int, int], None] | None = None) -> None:
        if chunks > 1 and copy_chunk is None:
            raise ValueError("chunked copies need copy_chunk")
        self._copy = copy
        self._copy_chunk = copy_chunk
        self.chunks = chunks
        self.delay_s = delay_s
        self._ids = itertools.count()
        self._queue: list[tuple[int, float, int, CopyHandle]] = []  # heap of (priority, rank, id, handle)
        self._progress: dict[int, int] = {}  # handle id -> chunks done (jobs started, not finished)
        self._done: set[int] = set()  # ids landed or cancelled
        self._cv = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None  # the first copy that raised; re-raised by wait()
        self.order: list[CopyHandle] = []  # copies in the order they finished (tests)
        self.chunk_log: list[tuple[int, int]] = []  # (handle id, chunk) in the order they ran (tests)
        self._link_free = 0.0  # perf_counter s at which the simulated link lands its last chunk (delay_s)
        self._submit_t: dict[int, float] = {}  # handle id -> perf_counter s it was submitted (delay_s only)
        self._thread = threading.Thread(target=self._work, name="ggmoe-copies", daemon=True)
        self._thread.start()

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        h = CopyHandle(next(self._ids), il, expert, slot, Priority(priority))
        with self._cv:
            if self._closed:
                raise RuntimeError("copy backend is closed")
            heapq.heappush(self._queue, (int(h.priority), rank, h.id, h))
            if self.delay_s:
                self._submit_t[h.id] = time.perf_counter()
            self._cv.notify_all()
        return h

    def done(self, handle: CopyHandle) -> bool:
        with self._cv:
            return handle.id in self._done

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        ids = {h.id for h in handles}
        with self._cv:
            self._cv.wait_for(lambda: ids <= self._done or self.error is not None or self._closed)
            if self.error is not None:
                raise self.error
            if not ids <= self._done:
                raise RuntimeError("copy backend closed with copies pending")

    def promote(self, handle: CopyHandle) -> None:
        """Serve a queued copy at demand priority from now on (a layer is waiting for it)."""
        with self._cv:
            for i, item in enumerate(self._queue):
                if item[2] == handle.id and item[0] > Priority.DEMAND:
                    self._queue[i] = (int(Priority.DEMAND), item[1], item[2], item[3])
                    heapq.heapify(self._queue)
                    self._cv.notify_all()
                    return

    def cancel(self, handle: CopyHandle) -> bool:
        """Drop a queued copy that no chunk of has run (a partly written slot is never handed out)."""
        with self._cv:
            if handle.id in self._done or handle.id in self._progress:
                return False
            if not any(item[2] == handle.id for item in self._queue):
                return False
            self._queue = [item for item in self._queue if item[2] != handle.id]
            heapq.heapify(self._queue)
            self._submit_t.pop(handle.id, None)
            self._done.add(handle.id)
            self._cv.notify_all()
            return True

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                h = self._queue[0][3]  # the most urgent job; stays queued until its last chunk
                chunk = self._progress.get(h.id, 0)
                self._progress[h.id] = chunk
            try:
                if self.delay_s:
                    self._link_wait(h)
                self._run_chunk(h, chunk)
            except BaseException as e:  # noqa: BLE001 - reported to the waiter, the thread stays alive
                with self._cv:
                    self.error = self.error or e
            with self._cv:
                self.chunk_log.append((h.id, chunk))
                if chunk + 1 < self.chunks and self.error is None:
                    self._progress[h.id] = chunk + 1
                    continue
                self._queue = [item for item in self._queue if item[2] != h.id]
                heapq.heapify(self._queue)
                self._progress.pop(h.id, None)
                self._submit_t.pop(h.id, None)
                self.order.append(h)
                self._done.add(h.id)
                self._cv.notify_all()

    def _run_chunk(self, h: CopyHandle, chunk: int) -> None:
        """The worker's part ``chunk`` of copy ``h`` (the whole copy when it is one chunk)."""
        if self.chunks > 1:
            self._copy_chunk(h.il, h.expert, h.slot, chunk)
        else:
            self._copy(h.il, h.expert, h.slot)

    def _link_wait(self, h: CopyHandle) -> None:
        """Sleep until the simulated link lands this chunk of ``h``: ``delay_s`` after the link's previous chunk
        or the copy's submission, whichever is later (no sleep when the worker is already past it)."""
        with self._cv:
            start = max(self._link_free, self._submit_t.get(h.id, 0.0))
            self._link_free = land = start + self.delay_s
        left = land - time.perf_counter()
        if left > 0:
            threading.Event().wait(left)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)


class Marker(Protocol):
    """A copy or a read in flight as the backend that started it knows it (a GPU event, a stream's ticket, a
    future): opaque to the cache, handed back only to that backend's ``ready`` and ``wait``."""


class CopyStream(Protocol):
    """One asynchronous copy stream (the engine's ``GgmlCopyBackend`` over a GPU's events or the CPU build's
    deferred stream). Readiness is a marker per issue, queried without blocking."""

    n_chunks: int  # chunks of one expert copy (one per expert tensor kind)

    def issue_chunk(self, il: int, expert: int, slot: int, i: int) -> Marker:
        """Put chunk ``i`` of the copy on the stream; returns its marker before it lands."""

    def ready(self, marker: Marker) -> bool:
        """Whether the chunk of ``marker`` has landed (never blocks)."""

    def wait_marker(self, marker: Marker) -> None:
        """Block until the chunk of ``marker`` has landed."""

    # Optional: ``issue(il, expert, slot, engine=False)`` puts the whole copy on the stream under one marker;
    # ``engine=True`` says the caller is the stream's copy engine (the simulated link's worker).


class LinkStreamCopyBackend(ThreadedCopyBackend):
    """A simulated slow link (``delay_s`` per chunk, on the base class's timeline) in front of an asynchronous
    copy stream (the CPU build's deferred stream). The link's worker puts each chunk on the stream once the
    link has moved it and goes on at once, as a DMA engine would; a copy has landed when the link moved its
    last chunk and the stream's markers of all its chunks are ready: the same readiness query as without a
    link. (Waiting for each chunk's marker on the worker, as ``copy_chunk`` does, made every chunk a thread
    hand-off: the link ran at the threads' pace, not at ``delay_s``.) The link's worker is the stream's copy
    engine: it issues with ``engine=True``, so a stream without a random delay of its own (the deferred one
    in ``tools/bench/bench_stride.py``) lands the copy on the worker when the link has moved it, as a GPU's copy
    engine does, instead of a second thread's wake-up later."""

    def __init__(self, stream: CopyStream, delay_s: float) -> None:
        self.stream = stream
        self._markers: dict[int, list[Marker]] = {}  # handle id -> the markers of its chunks put so far
        super().__init__(self._never, delay_s, chunks=stream.n_chunks, copy_chunk=self._never)

    @staticmethod
    def _never(*_: int) -> None:
        raise AssertionError("the link puts chunks on the stream (_run_chunk)")

    def _run_chunk(self, h: CopyHandle, chunk: int) -> None:
        """Once the link has moved the copy's last chunk, the whole copy goes on the stream as one piece of
        work (``issue`` where the stream has it: one marker, one hand-off to the stream's threads instead of
        one per chunk); the data cannot be read before then either way (``done`` needs every chunk)."""
        if chunk < self.chunks - 1:
            return
        issue = getattr(self.stream, "issue", None)
        ms = ([issue(h.il, h.expert, h.slot, engine=True)] if issue is not None
              else [self.stream.issue_chunk(h.il, h.expert, h.slot, i) for i in range(self.chunks)])
        with self._cv:
            self._markers[h.id] = ms

    def done(self, handle: CopyHandle) -> bool:
        with self._cv:
            if handle.id not in self._done:
                return False  # the link has not moved every chunk yet
            markers = self._markers.get(handle.id)
        if markers is None:
            return True  # seen landed before, or cancelled
        if not all(self.stream.ready(m) for m in markers):
            return False
        with self._cv:
            self._markers.pop(handle.id, None)
        return True

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        handles = list(handles)
        super().wait(handles)  # the link moved them all
        for h in handles:
            with self._cv:
                markers = self._markers.pop(h.id, [])
            for m in markers:
                self.stream.wait_marker(m)


class StreamCopyBackend(ThreadedCopyBackend):
    """The copy queue on one asynchronous stream: demand copies at once, the rest one chunk at a time.

    A demand copy (and a queued copy promoted because a layer waits for it) is put on the stream at once by
    the caller, all its chunks. Admissions and prefetches wait in the base class's queue; its worker puts
    the most urgent one's next chunk on the stream, waits for that chunk's marker (the GIL is free
    meanwhile), and picks again. So the stream never holds more than one low-priority chunk ahead of a
    demand copy (urgent work waits at most one chunk, as the simulator's link models it), and a queued copy
    can still be cancelled (early preemption at the gate) or promoted. Readiness of a demand copy: the
    markers of its chunks, queried without blocking.
    """

    def __init__(self, stream: CopyStream) -> None:
        self.stream = stream
        self._issue_lock = threading.Lock()  # one issuer at a time: stream order = issue order
        self._inline: dict[int, list[Marker] | None] = {}  # demand handle id -> its chunks' markers (None: not
        # yet on the stream, a promoted copy being issued)
        super().__init__(self._worker_copy, chunks=stream.n_chunks, copy_chunk=self._worker_chunk)

    def _issue(self, il: int, expert: int, slot: int, chunks: range) -> list[Marker]:
        with self._issue_lock:
            return [self.stream.issue_chunk(il, expert, slot, i) for i in chunks]

    def _worker_chunk(self, il: int, expert: int, slot: int, i: int) -> None:
        for m in self._issue(il, expert, slot, range(i, i + 1)):
            self.stream.wait_marker(m)

    def _worker_copy(self, il: int, expert: int, slot: int) -> None:
        for m in self._issue(il, expert, slot, range(self.chunks)):
            self.stream.wait_marker(m)

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        if priority != Priority.DEMAND:
            return super().submit(il, expert, slot, priority, rank)
        h = CopyHandle(next(self._ids), il, expert, slot, Priority.DEMAND)
        markers = self._issue(il, expert, slot, range(self.chunks))
        with self._cv:
            self._inline[h.id] = markers
        return h

    def done(self, handle: CopyHandle) -> bool:
        with self._cv:
            if handle.id not in self._inline:
                return handle.id in self._done
            markers = self._inline[handle.id]
        if markers is None or not all(self.stream.ready(m) for m in markers):
            return False
        with self._cv:
            self._inline.pop(handle.id, None)
            self._done.add(handle.id)
        return True

    def promote(self, handle: CopyHandle) -> None:
        """A layer waits for ``handle``: put a queued copy on the stream now; one the worker has begun goes on
        at demand priority (its next chunks are the worker's next)."""
        with self._cv:
            if handle.id in self._done or handle.id in self._inline:
                return
            queued = any(item[2] == handle.id for item in self._queue)
            if queued and handle.id not in self._progress:
                self._queue = [item for item in self._queue if item[2] != handle.id]
                heapq.heapify(self._queue)
                self._inline[handle.id] = None  # never done until issued below
            else:
                queued = False
        if queued:
            markers = self._issue(handle.il, handle.expert, handle.slot, range(self.chunks))
            with self._cv:
                self._inline[handle.id] = markers
                self._cv.notify_all()
            return
        super().promote(handle)

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        hs = list(handles)
        with self._cv:
            queued = [h for h in hs if h.id not in self._inline and h.id not in self._done]
        for h in queued:  # the cache promotes before it waits; a direct caller may not have
            self.promote(h)
        with self._cv:
            # a copy another thread is promoting is on the stream once its markers are in
            self._cv.wait_for(lambda: all(self._inline.get(h.id, ()) is not None for h in hs), timeout=60)
            inline = [(h, self._inline[h.id]) for h in hs if h.id in self._inline]
            rest = [h for h in hs if h.id not in self._inline]
        for h, markers in inline:
            for m in markers or ():
                self.stream.wait_marker(m)
            self.done(h)
        super().wait(rest)

    def cancel(self, handle: CopyHandle) -> bool:
        with self._cv:
            if handle.id in self._inline:
                return False  # on the stream already
        return super().cancel(handle)
