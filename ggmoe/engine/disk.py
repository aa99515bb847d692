"""The disk tier's reads: whole experts from the GGUF file into the host tier's pinned slots.

Engine layer (ctypes allowed). ``HostSlots`` allocates every cached layer's host tier: one tensor
``[ne0, ne1, n_host]`` per expert tensor kind on the GPU's pinned host buffer type (the CPU's on a CPU-only
build), the layout of the model's own expert tensors. ``FileDiskReader`` implements
``ggmoe.cache.host_tier.DiskReader``: a few worker threads each read one expert's kinds with ``O_DIRECT``
(page-aligned reads into an aligned bounce buffer, then one memcpy into the slot), so the reads bypass the
page cache and several are in flight at once. Where the filesystem refuses ``O_DIRECT`` it reads through the
page cache and drops the pages it read (``POSIX_FADV_DONTNEED``). A short read, an I/O error or a file that
changed since the engine opened it (size, mtime, inode) raises ``DiskTierError``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ggmoe.base.errors import DiskTierError
from ggmoe.cache.copy import Marker
from ggmoe.engine import ggml as B
from ggmoe.engine.arena import TensorArena
from ggmoe.inspect.names import CACHED_KINDS, expert_weight_name
from ggmoe.inspect.reader import read_header

ALIGN = 4096  # bytes: O_DIRECT's offset, length and buffer alignment (a page; every block size divides it)
READ_THREADS = 4  # expert reads in flight at once (NVMe queues want several)


@dataclass(frozen=True)
class ExpertExtent:
    """Where one kind of one layer's experts lie in the file and in the host tier."""

    file: str  # the GGUF (shard) holding the tensor
    offset: int  # absolute byte offset of expert 0's data in that file
    nb2: int  # bytes of one expert
    host: int  # address of host slot 0 of this kind
    kind: str


class HostSlots:
    """Every cached layer's host tier slots, one tensor per expert tensor kind, on ``buft``."""

    def __init__(self, model_ptr: int, layers: tuple[int, ...], n_host: int, buft: int) -> None:
        from ggmoe.engine import patch as _patched

        get = _patched.symbols().llama_ggmoe_model_get_tensor
        self.arena = TensorArena(len(layers) * len(CACHED_KINDS), "the host tier")
        self.tensors: dict[int, dict[str, int]] = {}
        try:
            for il in layers:
                self.tensors[il] = {}
                for kind in CACHED_KINDS:
                    src = get(model_ptr, expert_weight_name(il, kind).encode())
                    if not src:
                        continue
                    h = ctypes.cast(src, B.ggml_tensor_p).contents
                    self.tensors[il][kind] = self.arena.new_tensor(h.type, h.ne[0], h.ne[1], n_host,
                                                                   f"ggmoe_host.{il}.{kind}")
            self.nbytes = self.arena.allocate(buft)  # bytes
        except BaseException:
            self.arena.close()
            raise

    def data(self, il: int, kind: str) -> int:
        """Address of host slot 0 of ``kind`` in layer ``il``."""
        return ctypes.cast(self.tensors[il][kind], B.ggml_tensor_p).contents.data

    def close(self) -> None:
        self.arena.close()


def expert_extents(path: Path, slots: HostSlots) -> dict[int, list[ExpertExtent]]:
    """Each cached layer's extents, in ``CACHED_KINDS`` order (the kinds the layer has)."""
    header = read_header(path)
    by_name = {t.name: t for t in header.tensors}
    out: dict[int, list[ExpertExtent]] = {}
    for il, kinds in slots.tensors.items():
        out[il] = []
        for kind in kinds:
            t = by_name[expert_weight_name(il, kind)]
            n_expert = t.shape[2] if len(t.shape) > 2 else 1
            out[il].append(ExpertExtent(t.file, t.data_offset, t.nbytes // n_expert, slots.data(il, kind), kind))
    return out


class _File:
    """One GGUF file opened for the disk tier's reads, and the identity it had when opened."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            self.direct = True
        except OSError:  # tmpfs and some overlays refuse O_DIRECT: the page cache, dropped after each read
            self.fd = os.open(path, os.O_RDONLY)
            self.direct = False
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.size = st.st_size

    def check(self) -> None:
        """DiskTierError when the file at the path is no longer the one opened (rewritten, truncated, replaced)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise DiskTierError(f"the model file {self.path} is gone ({e.strerror}) while ggmoe reads experts "
                                "from it; restart with the file in place") from None
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self.identity:
            raise DiskTierError(f"the model file {self.path} changed while ggmoe reads experts from it (size, "
                                "time or inode differ from when it was loaded); restart to load it again")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileDiskReader:
    """Reads whole experts from the model file into host slots on a few worker threads."""

    def __init__(self, extents: dict[int, list[ExpertExtent]], threads: int = READ_THREADS) -> None:
        self.extents = extents
        self.files = {e.file: None for ext in extents.values() for e in ext}
        self.files = {f: _File(f) for f in self.files}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ggmoe-disk")
        self._local = threading.local()
        self.bytes_read = 0  # bytes the reads asked the disk for (aligned), every thread

    def check(self) -> None:
        """Every model file still the one opened (between tokens: before a graph reads the file in place)."""
        for f in self.files.values():
            f.check()

    def submit(self, il: int, expert: int, slot: int) -> Future:
        return self._pool.submit(self._read_expert, il, expert, slot)

    def done(self, marker: Marker) -> bool:
        assert isinstance(marker, Future)
        if not marker.done():
            return False
        marker.result()  # raises the read's error
        return True

    def wait(self, marker: Marker) -> None:
        assert isinstance(marker, Future)
        marker.result()

    def _buffer(self, size: int) -> tuple[mmap.mmap, int]:
        """This thread's page-aligned bounce buffer of at least ``size`` bytes, and its address."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = mmap.mmap(-1, size)
            self._local.buf = buf
            self._local.addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        return buf, self._local.addr

    def _read_expert(self, il: int, expert: int, slot: int) -> None:
        for ext in self.extents[il]:
            self._read_kind(ext, expert, slot)

    def _read_kind(self, ext: ExpertExtent, expert: int, slot: int) -> None:
        f = self.files[ext.file]
        f.check()
        start = ext.offset + expert * ext.nb2  # bytes, in the file
        lo = start - start % ALIGN
        hi = min(-(-(start + ext.nb2) // ALIGN) * ALIGN, -(-f.size // ALIGN) * ALIGN)
        buf, addr = self._buffer(hi - lo)
        want = min(hi, f.size) - lo  # bytes the file has in the aligned range
        try:
            got = os.preadv(f.fd, [memoryview(buf)[:hi - lo]], lo)
        except OSError as e:
            raise DiskTierError(f"reading expert {expert} ({ext.kind}) from {f.path} failed: {e.strerror}") from None
        if got < min(want, start + ext.nb2 - lo):
            raise DiskTierError(f"short read of expert {expert} ({ext.kind}) from {f.path}: {got} of {want} bytes "
                                f"at offset {lo}; the file is cut short")
        if not f.direct:
            os.posix_fadvise(f.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
        ctypes.memmove(ext.host + slot * ext.nb2, addr + (start - lo), ext.nb2)
        self.bytes_read += hi - lo

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for f in self.files.values():
            f.close()


def disk_points(path: Path, repeat: int, seed: int = 0) -> tuple[list[tuple[int, float]], bool]:
    """Timed reads of ``path`` as the disk tier reads it (``O_DIRECT``, page-aligned, at random offsets):
    ``repeat`` reads of each size from 64 KiB to 16 MiB that the file holds, as (bytes, seconds), and whether
    they bypassed the page cache (else each read's pages are dropped first)."""
    f = _File(str(path))
    rng = random.Random(seed)
    buf = mmap.mmap(-1, 16 << 20)
    points: list[tuple[int, float]] = []
    try:
        sizes = [s for s in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20) if s <= f.size - f.size % ALIGN]
        for size in sizes or [ALIGN]:
            for _ in range(repeat):
                at = rng.randrange(0, max(f.size - size, 0) // ALIGN + 1) * ALIGN
                if not f.direct:
                    os.posix_fadvise(f.fd, at, size, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                got = os.preadv(f.fd, [memoryview(buf)[:size]], at)
                points.append((got, time.perf_counter() - t0))
    finally:
        f.close()
        buf.close()
    return points, f.direct
