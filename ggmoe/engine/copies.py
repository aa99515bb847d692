"""The engine's expert copies: ggml's backend API on a copy stream, and the copy and CPU speed measured.

Engine layer (ctypes allowed). ``GgmlCopyBackend`` implements
``ggmoe.cache.CopyBackend`` with ggml's backend API: on a GPU a second backend
instance of the device gives its own stream for async copies from pinned host
memory; on a CPU-only build a copy is a plain ``tensor_set`` (memcpy), which
exercises the same path. ``measure_costs`` times a few of its copies and a
read of the same bytes on the CPU (the ``auto`` miss policy's cost model).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ggmoe.cache import CopyHandle, Priority
from ggmoe.cache.copy import Marker, bottom_buffer
from ggmoe.cache.miss import MissCosts
from ggmoe.cache.split import Pieces
from ggmoe.engine import ggml as B
from ggmoe.engine.slot_tensors import SlotPair, SlotTensors
from ggmoe.engine.streams import WorkStream


def _writes(p: SlotPair, expert: int, slot: int) -> list[tuple[int, int, Pieces]]:
    """What a copy of ``expert`` into ``slot`` of kind ``p`` writes: (tensor, byte offset of the expert there,
    run) for each 2-D piece; a negative ``slot`` names a bottom buffer (``ggmoe.cache.copy.bottom_target``)."""
    if p.split is None:
        return [(p.cache, slot * p.nb2, p.whole)]
    b = bottom_buffer(slot)
    if b is None:
        return [(p.cache, slot * p.split.top_bytes, p.split.top)]
    return [(p.bottom, b * p.split.bottom_bytes, r) for r in p.split.bottom]


_TENSOR_P: dict[int, object] = {}  # tensor address -> its typed pointer (``_tensor_p``)


def _tensor_p(tensor: int) -> object:
    """The ``ggml_tensor *`` of address ``tensor``, made once per tensor: a copy writes three slot tensors and
    three table entries per expert, and a ``ctypes.cast`` each time cost about a microsecond apiece of the
    mailbox reader's time per layer. Slot and table tensors live as long as their cache; a later tensor at a
    freed one's address gets the same pointer value, so the memo is never stale."""
    t = _TENSOR_P.get(tensor)
    if t is None:
        if len(_TENSOR_P) >= 1 << 16:  # bounded: caches rebuilt many times over (a server reconfiguring)
            _TENSOR_P.clear()
        t = _TENSOR_P[tensor] = ctypes.cast(tensor, B.ggml_tensor_p)
    return t


class GgmlCopyBackend:
    """The engine's copies: ggml's backend API on a copy stream (``ggmoe.engine.streams``).

    ``submit`` puts the copy of every expert tensor kind on the stream and returns at once; ``done`` asks the
    stream's readiness query (on a GPU an event recorded after the copy, queried without blocking), so a copy
    is seen as landed only when it has, on every stream: immediate (the CPU build's memcpy), deferred (the
    CPU build behaving like a GPU) or events (a GPU). ``wait`` blocks (the sync decode's demand copies).
    Copies, once put, cannot be cancelled.
    """

    def __init__(self, slots: SlotTensors, stream: WorkStream) -> None:
        self.pairs = slots.pairs
        self.stream = stream
        self._ids = itertools.count()
        self._markers: dict[int, Marker] = {}  # handle id -> its stream marker, until seen landed
        # the async decode's stride prefetch: (il, kind index, expert, slot) -> (table tensor, byte offset, entry
        # value) of the expert-table entry to point at the slot once that kind's copy landed, written on the
        # stream after the copy's kinds (stream order: a kernel that reads the entry then finds the copy landed;
        # an expert's entries in one strided write, ``_flip_all``); None
        # for no such write (split layers, or not the async decode)
        self.flip: Callable[[int, int, int, int], tuple[int, int, int] | None] | None = None
        # where a copy reads expert ``expert`` of kind ``kind`` (index in the layer's pairs) of layer ``il``: its
        # host tier slot under a disk tier (``CacheRuntime``), asked when the copy is issued; None: the model's
        # own expert tensor in host memory
        self.source: Callable[[int, int, int], int] | None = None

    @property
    def backend(self) -> int | None:
        """The GPU backend the copies are issued on (None on a CPU-only build)."""
        return self.stream.handle

    def _write(self, p: SlotPair, expert: int, slot: int, stream: int | None, src: int) -> None:
        """One expert tensor kind of ``expert`` into ``slot`` (a whole expert, a split layer's top, or for a
        negative slot its bottom into a bottom buffer), read from address ``src``: on ``stream`` (async) or at
        once."""
        for tensor, at, r in _writes(p, expert, slot):
            if r.size == 0 or r.n == 0:
                continue  # θ = 0: an empty top
            t = _tensor_p(tensor)
            if r.n == 1:
                if stream:
                    B.libggml_base.ggml_backend_tensor_set_async(stream, t, src + r.src, at + r.dst, r.size)
                else:
                    B.libggml_base.ggml_backend_tensor_set(t, src + r.src, at + r.dst, r.size)
            elif stream:
                B.libggml_base.ggml_backend_tensor_set_2d_async(stream, t, src + r.src, at + r.dst, r.size, r.n,
                                                                r.dst_stride, r.src_stride)
            else:
                B.libggml_base.ggml_backend_tensor_set_2d(t, src + r.src, at + r.dst, r.size, r.n, r.dst_stride,
                                                          r.src_stride)

    def issue(self, il: int, expert: int, slot: int, chunks: range | None = None, engine: bool = False) -> Marker:
        """Put expert tensor kinds ``chunks`` (default: all) of ``expert``'s copy into ``slot`` on the stream;
        returns the stream's marker for them. ``engine``: the caller is the stream's copy engine (the simulated
        link's thread, its link done with the copy): the stream's ``put_on_engine`` where it has one."""
        pairs = self.pairs[il]
        kinds = [i for i in (chunks if chunks is not None else range(len(pairs))) if i < len(pairs)]
        flip, source = self.flip, self.source
        srcs = [source(il, i, expert) if source is not None else pairs[i].host_data + expert * pairs[i].nb2
                for i in kinds]  # asked now: a deferred stream runs ``work`` later

        def work(stream: int | None) -> None:
            for i, src in zip(kinds, srcs, strict=True):
                self._write(pairs[i], expert, slot, stream, src)
            if flip is not None:  # a slot's entries, or a split layer's bottom rows (entry_flip), after the copy
                self._flip_all([e for e in (flip(il, i, expert, slot) for i in kinds) if e is not None], stream)

        put = getattr(self.stream, "put_on_engine", None) if engine else None
        return (put or self.stream.put)(work)

    @staticmethod
    def _flip_all(entries: list[tuple[int, int, int]], stream: int | None) -> None:
        """Point expert-table entries (tensor, byte offset, value) at their slot, on the copy stream after the
        copy (or at once). An expert's kinds' entries lie one table apart in the one tables tensor: they go in
        one strided write (a GPU's copy stream takes each write as an API call of its own)."""
        if not entries:
            return
        tensor, first = entries[0][0], entries[0][1]
        step = entries[1][1] - first if len(entries) > 1 else 8
        if step <= 0 or any(t != tensor or off != first + j * step for j, (t, off, _) in enumerate(entries)):
            for e in entries:  # not one strided run: each on its own
                GgmlCopyBackend._flip_all([e], stream)
            return
        v = (ctypes.c_int64 * len(entries))(*(e[2] for e in entries))  # read before the call returns
        t, n, at = _tensor_p(tensor), len(entries), ctypes.addressof(v)
        if n == 1:
            if stream:
                B.libggml_base.ggml_backend_tensor_set_async(stream, t, at, first, 8)
            else:
                B.libggml_base.ggml_backend_tensor_set(t, at, first, 8)
        elif stream:
            B.libggml_base.ggml_backend_tensor_set_2d_async(stream, t, at, first, 8, n, step, 8)
        else:
            B.libggml_base.ggml_backend_tensor_set_2d(t, at, first, 8, n, step, 8)

    def issue_chunk(self, il: int, expert: int, slot: int, i: int) -> Marker:
        """Put chunk ``i`` (expert tensor kind ``i``) of ``expert``'s copy on the stream; its marker."""
        return self.issue(il, expert, slot, range(i, i + 1))

    def ready(self, marker: Marker) -> bool:
        return self.stream.ready(marker)

    def wait_marker(self, marker: Marker) -> None:
        self.stream.wait(marker)

    def copy_now(self, il: int, expert: int, slot: int) -> None:
        """Copy every expert tensor kind of ``expert`` into ``slot`` and block until it has landed."""
        self.stream.wait(self.issue(il, expert, slot))

    def copy_chunk(self, il: int, expert: int, slot: int, i: int) -> None:
        """Copy expert tensor kind ``i`` of ``expert`` into ``slot`` and block until it has landed."""
        self.stream.wait(self.issue_chunk(il, expert, slot, i))

    def synchronize(self) -> None:
        """Block until every copy put on the stream has landed (never on the decode path)."""
        self.stream.synchronize()

    @property
    def n_chunks(self) -> int:
        """Chunks of one expert copy: its tensor kinds (the most any layer has)."""
        return max(len(p) for p in self.pairs.values())

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        h = CopyHandle(next(self._ids), il, expert, slot, Priority(priority))
        self._markers[h.id] = self.issue(il, expert, slot)
        return h

    def done(self, handle: CopyHandle) -> bool:
        m = self._markers.get(handle.id)
        if m is None and handle.id not in self._markers:
            return True  # seen landed before
        if not self.stream.ready(m):
            return False
        self._markers.pop(handle.id, None)
        return True

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        for h in handles:
            if h.id in self._markers:
                self.stream.wait(self._markers[h.id])
                self._markers.pop(h.id, None)

    def cancel(self, handle: CopyHandle) -> bool:
        return False

    def close(self) -> None:
        """Land what is in flight (a deferred copy must not write freed slots), then release the stream."""
        self.stream.close()


def measure_costs(slots: SlotTensors, copies: GgmlCopyBackend, n_threads: int = 1, link_s: float = 0.0) -> MissCosts:
    """The machine's copy and CPU speed for one expert, measured now (the ``auto`` miss policy's model).

    Copy: a few real copies of the first layer's expert 0 into slot 0 (rewritten by the first miss anyway),
    plus ``link_s`` per copy (the delay of a simulated slow link, ``copy_delay_s``).
    CPU: a streaming read of the same expert's host bytes split over ``n_threads`` threads (numpy's sums run
    without the GIL), the floor of ggml-cpu's matvec over them with as many threads. One thread would
    understate a many-core machine several times over (an H100 host: about 300 us per 12.6 MiB expert with
    16 threads, computed by llama.cpp).
    """
    il = next(iter(slots.pairs))
    nbytes = sum(p.nb2 for p in slots.pairs[il])
    t_copy = []
    for _ in range(5):
        t0 = time.perf_counter()
        copies.copy_now(il, 0, 0)  # blocks until landed, on any stream
        t_copy.append(time.perf_counter() - t0 + link_s)
    words = [np.ctypeslib.as_array((ctypes.c_uint8 * p.nb2).from_address(p.host_data)) for p in slots.pairs[il]]
    words = [v.view(np.uint64) if v.size % 8 == 0 else v for v in words]
    n = max(1, min(n_threads, 64))
    parts = [part for v in words for part in np.array_split(v, n) if part.size]
    t_cpu = []
    with ThreadPoolExecutor(max_workers=n) as pool:
        for _ in range(6):  # the first is a warm-up (threads start, pages fault in)
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            t_cpu.append(time.perf_counter() - t0)
    copy_s, cpu_s = sorted(t_copy)[2], sorted(t_cpu[1:])[2]  # medians, seconds per expert
    return MissCosts(copy_bytes_per_s=nbytes / max(copy_s, 1e-9), copy_latency_s=0.0,
                     cpu_bytes_per_s=nbytes / max(cpu_s, 1e-9))
