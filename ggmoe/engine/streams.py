"""Copy streams: where the expert cache's copies run, and the one way their landing is seen.

Engine layer (ctypes allowed). A stream takes copy work (a callable that writes
part of an expert into its slot, given the backend handle to issue async copies
on, or None to write at once) and returns a *marker* for it. ``ready(marker)``
says without blocking whether that work has landed; it is the only way the cache
learns that a copy landed, at token boundaries and in the sync path's queue.
``wait(marker)`` blocks: only the sync decode's demand copies, the queue's own
worker, measurements and teardown use it, never the async decode.

- ``ImmediateStream`` (the CPU build's default): the work runs inside ``put`` (a
  memcpy); every marker is ready at once.
- ``EventStream`` (a GPU): ``put`` issues async copies on a second backend
  instance of the device (its own CUDA stream) and records a ggml event after
  them; ``ready`` is ``ggml_backend_event_query`` (patch 0008, cudaEventQuery).
- ``DeferredStream`` (``GGMOE_COPY_STREAM=deferred``): the CPU build behaving
  like a GPU. The work runs later, on worker threads, after a random delay, so
  copies land out of order and a copy's slot is written while later decodes
  run; only ``ready`` tells. A cache that assumed a copy lands when issued (or
  at a synchronize nobody calls) strands its copies here, as it would on CUDA.

``copy_stream_kind()`` reads the environment once per cache; ``--stats-json``
and ``/metrics`` name the stream in effect.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from ggmoe.base.errors import EngineError, EngineNotPatchedError, UsageError
from ggmoe.cache.copy import Marker
from ggmoe.engine import ggml as B

Work = Callable[[int | None], None]  # writes part of a copy: on the given backend (async), or at once (None)

COPY_STREAM_ENV = "GGMOE_COPY_STREAM"  # immediate | deferred (the CPU build); a GPU always uses its events
COPY_DELAY_ENV = "GGMOE_COPY_DELAY_MS"  # the deferred stream's largest delay per copy, milliseconds
COPY_STREAM_KINDS = ("immediate", "deferred")
DEFERRED_DELAY_S = 0.0002  # s: the default largest delay of a deferred copy (a fixture decode step takes ~1 ms)
DEFERRED_WORKERS = 2  # threads: copies overtake each other


class WorkStream(Protocol):
    name: str  # the stream in effect, as the statistics name it: immediate, deferred or events
    handle: int | None  # the ggml backend async copies are issued on (a GPU's copy stream), else None

    def put(self, work: Work) -> Marker:
        """Run ``work`` on the stream; returns its marker at once (the copy may land later)."""

    def ready(self, marker: Marker) -> bool:
        """Whether the work of ``marker`` has landed; never blocks on a device that can be queried."""

    def wait(self, marker: Marker) -> None:
        """Block until the work of ``marker`` has landed."""

    def synchronize(self) -> None:
        """Block until everything put so far has landed."""

    def close(self) -> None:
        """Land what is in flight, then release the stream."""


def closed_stream(name: str) -> EngineError:
    """A stream used after ``close``: on CUDA ggml aborts the process (``GGML_ASSERT(backend)`` in
    ``ggml_backend_synchronize``, at exit of every cached run); every stream raises this
    instead, so the CPU build's tests catch the misuse a GPU would die of."""
    return EngineError(f"the {name} copy stream was used after it was closed")


class ImmediateStream:
    """The CPU build's default: a copy is a memcpy that has landed when ``put`` returns."""

    name = "immediate"
    handle = None

    def __init__(self) -> None:
        self._closed = False

    def put(self, work: Work) -> Marker:
        if self._closed:
            raise closed_stream(self.name)
        work(None)
        return None

    def ready(self, marker: Marker) -> bool:
        if self._closed:
            raise closed_stream(self.name)
        return True

    def wait(self, marker: Marker) -> None:
        if self._closed:
            raise closed_stream(self.name)

    def synchronize(self) -> None:
        if self._closed:
            raise closed_stream(self.name)

    def close(self) -> None:
        self._closed = True


class EventStream:
    """A GPU's copy stream: async copies on ``backend``, a ggml event recorded after each put, queried."""

    name = "events"

    def __init__(self, backend: int, device: int) -> None:
        self._query = B.event_query_fn()
        if self._query is None:
            raise EngineNotPatchedError("the installed engine lacks ggml_backend_event_query (patch 0008): run "
                                        "`ggmoe engine build --install` to rebuild it")
        self.handle = backend
        self.device = device
        self._free: list[int] = []  # events whose work landed, to record again
        self._made: list[int] = []  # every event created (freed at close, recycled or not)
        self._lock = threading.Lock()  # one issuer at a time: stream order is put order

    def put(self, work: Work) -> Marker:
        with self._lock:
            if not self.handle:
                raise closed_stream(self.name)
            work(self.handle)
            if self._free:
                ev = self._free.pop()
            else:
                ev = B.libggml_base.ggml_backend_event_new(self.device)
                if not ev:
                    raise EngineError("could not create an event on the GPU's copy stream")
                self._made.append(ev)
            B.libggml_base.ggml_backend_event_record(ev, self.handle)
            return [ev]  # a list, emptied (the event recycled) once seen landed

    def ready(self, marker: Marker) -> bool:
        if not self.handle:  # its events were freed with the stream: a query would read a destroyed event
            raise closed_stream(self.name)
        # the event read once (another thread may recycle the marker meanwhile: then it is empty, and landed)
        ev = next(iter(marker), None)
        if ev is None:
            return True
        if not self._query(ev):
            return False
        self._recycle(marker)
        return True

    def wait(self, marker: Marker) -> None:
        if not self.handle:
            raise closed_stream(self.name)
        ev = next(iter(marker), None)
        if ev is not None:
            B.libggml_base.ggml_backend_event_synchronize(ev)
            self._recycle(marker)

    def _recycle(self, marker: list) -> None:
        with self._lock:
            if marker:
                self._free.append(marker.pop())

    def synchronize(self) -> None:
        if not self.handle:  # ggml asserts on a NULL backend: the process would abort
            raise closed_stream(self.name)
        B.libggml_base.ggml_backend_synchronize(self.handle)

    def close(self) -> None:
        with self._lock:  # no put issues work on a backend being freed
            if self.handle:
                B.libggml_base.ggml_backend_synchronize(self.handle)
                for ev in self._made:
                    B.libggml_base.ggml_backend_event_free(ev)
                self._free, self._made = [], []
                B.libggml_base.ggml_backend_free(self.handle)
                self.handle = None


class DeferredStream:
    """The CPU build as a GPU: each copy runs on one of ``workers`` threads after a random delay in
    [0, ``max_delay_s``] (seeded), so copies land later than issued and out of order. A failed copy raises
    from ``ready``/``wait`` (the decode that asked reports it)."""

    name = "deferred"
    handle = None

    def __init__(self, max_delay_s: float = DEFERRED_DELAY_S, workers: int = DEFERRED_WORKERS, seed: int = 0) -> None:
        self.max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ggmoe-deferred-copy")
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.put_count = 0  # copies put (tests)

    def _run(self, work: Work, due: float) -> None:
        left = due - time.perf_counter()
        if left > 0:
            threading.Event().wait(left)
        work(None)

    def put(self, work: Work) -> Marker:
        with self._lock:
            if self._closed:
                raise closed_stream(self.name)
            # the delay is a latency from the put, not time a worker sleeps once it takes the copy: a copy
            # queued behind others that is already due lands at once (sleeping per copy capped the stream
            # at about two copies per delay, far below any link, and starved the async decode's copies)
            due = time.perf_counter() + self._rng.uniform(0.0, self.max_delay_s) if self.max_delay_s else 0.0
            f = self._pool.submit(self._run, work, due)
            self._pending.add(f)
            self.put_count += 1
        f.add_done_callback(self._forget)
        return f

    def put_on_engine(self, work: Work) -> Marker:
        """``put`` from this stream's own copy engine: the simulated link's thread, once its link has moved the
        copy (``LinkStreamCopyBackend``). With no random delay of its own the work lands on that thread now,
        as a GPU's copy engine lands a copy when its last byte arrives, and its marker is ready from then:
        handing it to a worker as well added a thread's wake-up (about 0.1 to 0.6 ms on a busy 2-core VM,
        more than the link itself) to every copy. With a delay it goes to the workers as ``put`` does."""
        if self.max_delay_s:
            return self.put(work)
        with self._lock:
            if self._closed:
                raise closed_stream(self.name)
        work(None)
        with self._lock:
            self.put_count += 1
        return None

    def _forget(self, f: Future) -> None:
        with self._lock:
            self._pending.discard(f)

    def ready(self, marker: Marker) -> bool:
        if self._closed:
            raise closed_stream(self.name)
        if marker is None or not marker.done():
            return marker is None
        marker.result()  # a copy that raised: raised here
        return True

    def wait(self, marker: Marker) -> None:
        if self._closed:
            raise closed_stream(self.name)
        if marker is not None:
            marker.result()

    def synchronize(self) -> None:
        with self._lock:
            if self._closed:
                raise closed_stream(self.name)
            pending = list(self._pending)
        for f in pending:
            f.exception()  # waits; a failure is raised by whoever asks about that copy

    def close(self) -> None:
        if self._closed:
            return
        self.synchronize()
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


def copy_stream_kind() -> str:
    """The CPU build's copy stream from ``GGMOE_COPY_STREAM`` (default immediate)."""
    kind = os.environ.get(COPY_STREAM_ENV, "").strip().lower() or "immediate"
    if kind not in COPY_STREAM_KINDS:
        raise UsageError(f"{COPY_STREAM_ENV}={kind!r}: expected one of {', '.join(COPY_STREAM_KINDS)}")
    return kind


def deferred_delay_s() -> float:
    """The deferred stream's largest delay per copy, from ``GGMOE_COPY_DELAY_MS`` (seconds)."""
    raw = os.environ.get(COPY_DELAY_ENV, "").strip()
    if not raw:
        return DEFERRED_DELAY_S
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0.0 <= ms <= 10_000.0:
        raise UsageError(f"{COPY_DELAY_ENV}={raw!r}: expected milliseconds from 0 to 10000")
    return ms / 1000.0


def open_stream(gpu_backend: int | None, device: int | None) -> WorkStream:
    """The copy stream for a cache: the GPU's events when there is a GPU copy backend, else the CPU build's
    stream named by the environment."""
    if gpu_backend:
        return EventStream(gpu_backend, device)
    if copy_stream_kind() == "deferred":
        return DeferredStream(deferred_delay_s())
    return ImmediateStream()
