"""Engine side of the expert cache: slot tensors, the ggml copy backend, the cache runtime.

Engine layer (ctypes allowed). ``SlotTensors`` allocates, for every MoE layer,
one cache tensor ``[ne0, ne1, n_slots]`` per expert tensor kind with ggml's
allocator on the layer's device buffer type. ``GgmlCopyBackend`` implements
``ggmoe.cache.CopyBackend`` with ggml's backend API: on a GPU a second backend
instance of the device gives its own stream for async copies from pinned host
memory; on a CPU-only build a copy is a plain ``tensor_set`` (memcpy), which
exercises the same path. ``CacheRuntime`` wires them to an ``ExpertCache`` and
registers the slot tensors with the patched context. The route callback that
drives the cache lives in ``ggmoe.engine.hooks``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ggmoe.cache import CacheConfig, CopyHandle, ExpertCache, MonotonicClock, Priority, ThreadedCopyBackend
from ggmoe.cache.copy import StreamCopyBackend, bottom_buffer
from ggmoe.cache.miss import MissCosts, check_miss_policy, effective_miss_policy
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.split import KindSplit, LayerSplit, Run, model_split
from ggmoe.control.prefetch import default_n_prefetch
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.arena import TensorArena
from ggmoe.engine.streams import CopyStream, open_stream
from ggmoe.errors import EngineError
from ggmoe.inspect.facts import ModelFacts
from ggmoe.inspect.names import CACHED_KINDS, expert_weight_name


@dataclass(frozen=True)
class _Pair:
    """One kind of one layer: where experts live on the host and their slot tensor."""

    host: int  # ggml_tensor * of the model's expert tensor [ne0, ne1, n_expert]
    host_data: int  # its data pointer (host memory)
    cache: int  # ggml_tensor * of the slot tensor [ne0, ne1, n_slots]
    nb2: int  # bytes of one expert slice (same in both)
    split: KindSplit | None = None  # a split layer's kind: the slot tensor holds top segments, packed
    bottom: int = 0  # ggml_tensor * of a split layer's bottom buffers, packed bottoms of this kind (0: none)

    @property
    def slot_bytes(self) -> int:
        """Bytes from one slot to the next in the slot tensor: a whole expert, or a top segment."""
        return self.split.top_bytes if self.split is not None else self.nb2

    def writes(self, expert: int, slot: int) -> list[tuple[int, int, Run]]:
        """What a copy of ``expert`` into ``slot`` writes: (tensor, byte offset of the expert there, run) for each
        2-D piece; a negative ``slot`` names a bottom buffer (``ggmoe.cache.copy.bottom_target``)."""
        if self.split is None:
            return [(self.cache, slot * self.nb2, Run(0, 0, self.nb2, 1, self.nb2, self.nb2))]
        b = bottom_buffer(slot)
        if b is None:
            return [(self.cache, slot * self.split.top_bytes, self.split.top)]
        return [(self.bottom, b * self.split.bottom_bytes, r) for r in self.split.bottom]


class SlotTensors:
    """Owns the ggml context and backend buffer of every layer's slot tensors."""

    def __init__(self, model_ptr: int, n_slots: dict[int, int], buft: int, zero_slot: bool = False,
                 split: dict[int, LayerSplit] | None = None, n_bottom: int = 0) -> None:
        """``zero_slot``: one more slot per layer, after the others, filled with zeros (the host path's).
        ``split``: layers whose slots hold top segments (MoEpic); their slot tensors are ``[ne0, ne1, m]`` with
        m whole experts' bytes enough for every top (``registered``), and ``n_bottom`` packed bottom buffers each."""
        split = split or {}
        P = _patched.load()
        self.buft = buft  # the slots' buffer type (the expert tables go on the same device)
        self.pairs: dict[int, list[_Pair]] = {}
        found: dict[int, dict[str, int]] = {}
        for il in n_slots:
            found[il] = {k: P.llama_ggmoe_model_get_tensor(model_ptr, expert_weight_name(il, k).encode())
                         for k in CACHED_KINDS}
            found[il] = {k: v for k, v in found[il].items() if v}
            if not found[il]:
                raise EngineError(f"layer {il} has no expert tensors")
        n_bottom = n_bottom if split else 0
        self.arena = TensorArena(sum(len(v) for v in found.values()) * (2 if n_bottom else 1), "the expert cache")
        # slots the context is told each layer has: a split layer's slot tensors hold its tops in whole experts'
        # room (the tensors are the tables' template, so they keep the expert's shape)
        self.registered: dict[int, int] = {}
        try:
            self.tensors: dict[int, dict[str, int]] = {}
            bottoms: dict[int, dict[str, int]] = {}
            for il, kinds in found.items():
                self.tensors[il], bottoms[il] = {}, {}
                ks = {k.kind: k for k in split[il].kinds} if il in split else {}
                n = n_slots[il] + int(zero_slot)
                if ks:  # tops packed: enough whole experts' bytes for n_slots tops of the largest share
                    n = max(1, max(-(-n_slots[il] * ks[k].top_bytes // ks[k].nb2) for k in kinds))
                self.registered[il] = n
                for kind, host_ptr in kinds.items():
                    h = ctypes.cast(host_ptr, B.ggml_tensor_p).contents
                    self.tensors[il][kind] = self.arena.new_tensor(h.type, h.ne[0], h.ne[1], n,
                                                                   f"ggmoe_slots.{il}.{kind}")
                    if ks and n_bottom:  # packed bottoms, in whole experts' room (a tensor of the expert's shape)
                        nb = max(1, -(-n_bottom * ks[kind].bottom_bytes // ks[kind].nb2))
                        bottoms[il][kind] = self.arena.new_tensor(h.type, h.ne[0], h.ne[1], nb,
                                                                  f"ggmoe_bottoms.{il}.{kind}")
            self.nbytes = self.arena.allocate(buft)  # bytes
            for il, kinds in found.items():
                ks = {k.kind: k for k in split[il].kinds} if il in split else {}
                self.pairs[il] = [self._pair(host_ptr, self.tensors[il][kind], ks.get(kind),
                                             bottoms[il].get(kind, 0)) for kind, host_ptr in kinds.items()]
        except BaseException:
            self.close()
            raise
        if zero_slot:
            for il, pairs in self.pairs.items():
                for p in pairs:  # the zero slot: entries the CPU computes read it on the device (x + 0 = x)
                    zeros = (ctypes.c_uint8 * p.nb2)()
                    B.libggml_base.ggml_backend_tensor_set(ctypes.cast(p.cache, B.ggml_tensor_p), zeros,
                                                           n_slots[il] * p.nb2, p.nb2)

    @staticmethod
    def _pair(host_ptr: int, cache_ptr: int, split: KindSplit | None = None, bottom: int = 0) -> _Pair:
        h = ctypes.cast(host_ptr, B.ggml_tensor_p).contents
        if not h.buffer or not B.libggml_base.ggml_backend_buffer_is_host(h.buffer) or not h.data:
            raise EngineError(f"expert tensor {h.name.decode()} is not in host memory; "
                              "load the model with experts_on_host=True")
        return _Pair(host=host_ptr, host_data=h.data, cache=cache_ptr, nb2=h.nb[2], split=split, bottom=bottom)

    def bytes_per_expert(self) -> dict[int, int]:
        return {il: sum(p.nb2 for p in pairs) for il, pairs in self.pairs.items()}

    def close(self) -> None:
        self.arena.close()


class GgmlCopyBackend:
    """The engine's copies: ggml's backend API on a copy stream (``ggmoe.engine.streams``).

    ``submit`` puts the copy of every expert tensor kind on the stream and returns at once; ``done`` asks the
    stream's readiness query (on a GPU an event recorded after the copy, queried without blocking), so a copy
    is seen as landed only when it has, on every stream: immediate (the CPU build's memcpy), deferred (the
    CPU build behaving like a GPU) or events (a GPU). ``wait`` blocks (the sync decode's demand copies).
    Copies, once put, cannot be cancelled.
    """

    def __init__(self, slots: SlotTensors, stream: CopyStream) -> None:
        self.pairs = slots.pairs
        self.stream = stream
        self._ids = itertools.count()
        self._markers: dict[int, object] = {}  # handle id -> its stream marker, until seen landed
        # the async decode's stride prefetch: (il, kind index, expert, slot) -> (table tensor, byte offset, entry
        # value) of the expert-table entry to point at the slot once that kind's copy landed, written on the
        # stream right after it (stream order: a kernel that reads the entry then finds the copy landed); None
        # for no such write (split layers, or not the async decode)
        self.flip: Callable[[int, int, int, int], tuple[int, int, int] | None] | None = None

    @property
    def backend(self) -> int | None:
        """The GPU backend the copies are issued on (None on a CPU-only build)."""
        return self.stream.handle

    def _write(self, p: _Pair, expert: int, slot: int, stream: int | None) -> None:
        """One expert tensor kind of ``expert`` into ``slot`` (a whole expert, a split layer's top, or for a
        negative slot its bottom into a bottom buffer): on ``stream`` (async) or at once."""
        src = p.host_data + expert * p.nb2
        for tensor, at, r in p.writes(expert, slot):
            if r.size == 0 or r.n == 0:
                continue  # θ = 0: an empty top
            t = ctypes.cast(tensor, B.ggml_tensor_p)
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

    def issue(self, il: int, expert: int, slot: int, chunks: range | None = None) -> object:
        """Put expert tensor kinds ``chunks`` (default: all) of ``expert``'s copy into ``slot`` on the stream;
        returns the stream's marker for them."""
        pairs = self.pairs[il]
        kinds = [i for i in (chunks if chunks is not None else range(len(pairs))) if i < len(pairs)]
        flip = self.flip

        def work(stream: int | None) -> None:
            for i in kinds:
                self._write(pairs[i], expert, slot, stream)
                if flip is not None and slot >= 0:
                    self._flip(flip(il, i, expert, slot), stream)

        return self.stream.put(work)

    @staticmethod
    def _flip(entry: tuple[int, int, int] | None, stream: int | None) -> None:
        """Point an expert-table entry at its slot, on the copy stream after the copy (or at once)."""
        if entry is None:
            return
        tensor, offset, value = entry
        v = ctypes.c_int64(value)  # read before the call returns (a pageable source is staged by then)
        t = ctypes.cast(tensor, B.ggml_tensor_p)
        if stream:
            B.libggml_base.ggml_backend_tensor_set_async(stream, t, ctypes.addressof(v), offset, 8)
        else:
            B.libggml_base.ggml_backend_tensor_set(t, ctypes.addressof(v), offset, 8)

    def issue_chunk(self, il: int, expert: int, slot: int, i: int) -> object:
        """Put chunk ``i`` (expert tensor kind ``i``) of ``expert``'s copy on the stream; its marker."""
        return self.issue(il, expert, slot, range(i, i + 1))

    def ready(self, marker: object) -> bool:
        return self.stream.ready(marker)

    def wait_marker(self, marker: object) -> None:
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


def _device_bufts() -> tuple[int, int | None, int | None]:
    """(buffer type for slots, copy backend, its device): the GPU's when there is one, else CPU and none."""
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    if dev:
        backend = B.libggml.ggml_backend_dev_init(dev, None)
        if not backend:
            raise EngineError("could not create a copy stream on the GPU")
        return B.libggml.ggml_backend_dev_buffer_type(dev), backend, dev
    return B.libggml_cpu.ggml_backend_cpu_buffer_type(), None, None


def use_copy_queue(ggml: GgmlCopyBackend, config: CacheConfig, miss_policy: str) -> bool:
    """Whether copies go through the priority queue (``StreamCopyBackend``): on an asynchronous stream (a
    GPU's, or the CPU build's deferred one), when there are low-priority copies (prefetches, or admissions of
    the host path) that a demand copy must not wait behind. Otherwise every copy is a demand copy and the
    plain stream does (no worker thread)."""
    return ggml.stream.name != "immediate" and config.copy_delay_s is None and (
        config.prefetch is not None or miss_policy != "wait")


class CacheRuntime:
    """Slot tensors + copy backend + ``ExpertCache``, registered with the context layer by layer."""

    def __init__(self, model_ptr: int, ctx_ptr: int, config: CacheConfig, moe_layers: tuple[int, ...],
                 n_expert: int, n_expert_used: int, bytes_per_expert: dict[int, int],
                 n_threads: int | None = None, split: dict[int, LayerSplit] | None = None) -> None:
        """``split``: the layers whose slots hold top segments (MoEpic, from the config's top shares)."""
        self.split = split or {}
        slot_bytes = {il: self.split[il].top_bytes if il in self.split else bytes_per_expert[il] for il in moe_layers}
        n_slots = config.slots(slot_bytes, n_expert, n_expert_used)
        # bottom buffers of a split layer: as many as the prefetcher queues per layer (MoEpic's y)
        pre = config.prefetch
        self.n_bottom = (getattr(pre, "n_prefetch", None) or default_n_prefetch(n_expert_used, n_expert)) \
            if self.split and pre is not None else 0
        policy = POLICIES.get(config.policy)(n_expert, list(moe_layers), **dict(config.policy_options or {}))
        self.copies: GgmlCopyBackend | ThreadedCopyBackend | None = None
        self._ggml: GgmlCopyBackend | None = None
        self.slots: SlotTensors | None = None
        asked = check_miss_policy(config.miss_policy)
        if self.split and asked != "wait":
            raise EngineError("split experts read what is not cached from host memory through the expert "
                              f"table: --miss-policy {asked} (the host path) cannot serve them; use wait")
        try:
            self._allocate(model_ptr, n_slots, config, zero_slot=asked == "cpu")
            costs = self._costs(config, n_threads or os.cpu_count() or 1) if asked == "auto" else None
            # what runs: auto becomes wait when the CPU is never sooner than a copy (the host path only costs)
            self.miss_policy, self.miss_policy_note = effective_miss_policy(asked, costs,
                                                                            self.slots.bytes_per_expert())
            host_path = self.miss_policy != "wait"
            if host_path and asked == "auto":  # the host path reads a zero slot: allocate again with it
                self._allocate(model_ptr, n_slots, config, zero_slot=True)
            if use_copy_queue(self._ggml, config, self.miss_policy):
                self.copies = StreamCopyBackend(self._ggml)
        except BaseException:
            self.close()
            raise
        self.cache = ExpertCache(n_expert, n_expert_used, n_slots, policy, self.copies, clock=MonotonicClock(),
                                 bytes_per_expert=self.slots.bytes_per_expert(), miss_policy=self.miss_policy,
                                 costs=costs, split=self.split, n_bottom=self.n_bottom)
        P = _patched.load()
        for il, n in n_slots.items():
            t = self.slots.tensors[il]
            rc = P.llama_ggmoe_set_layer_cache(ctx_ptr, il, self.slots.registered[il],
                                               *(t.get(k) for k in CACHED_KINDS))
            if rc == _patched.LLAMA_GGMOE_OK and host_path:
                rc = P.llama_ggmoe_set_host_path(ctx_ptr, il, n)
                if rc == _patched.LLAMA_GGMOE_ERR_HOST:
                    self.close()
                    raise EngineError(f"layer {il} has {n} cache slots: the host path needs at least 2 (one "
                                      "holds zeros); use more slots or --miss-policy wait")
            if rc != _patched.LLAMA_GGMOE_OK:
                self.close()
                raise EngineError(f"configuring the cache of layer {il} failed: {_patched.ERROR_NAMES.get(rc, rc)}")

    def _allocate(self, model_ptr: int, n_slots: dict[int, int], config: CacheConfig, zero_slot: bool) -> None:
        """(Re)create the slot tensors and the copy backend over them (the GPU's copy stream when there is one,
        else the CPU build's stream that ``GGMOE_COPY_STREAM`` names)."""
        self.close()
        buft, backend, device = _device_bufts()
        try:
            if config.copy_delay_s is not None and backend:
                raise EngineError("copy_delay_s simulates a slow link on a CPU-only build; a GPU has a real one")
            stream = open_stream(backend, device)
        except BaseException:
            if backend:
                B.libggml_base.ggml_backend_free(backend)
            raise
        try:
            self.slots = SlotTensors(model_ptr, n_slots, buft, zero_slot=zero_slot, split=self.split,
                                     n_bottom=self.n_bottom)
        except BaseException:
            stream.close()
            raise
        self.copies = self._ggml = GgmlCopyBackend(self.slots, stream)
        self._link_s = 0.0  # s per expert copy that the simulated link adds (copy_delay_s per chunk)
        if config.copy_delay_s is not None:
            ggml = self.copies
            self._link_s = config.copy_delay_s * ggml.n_chunks
            self.copies = ThreadedCopyBackend(ggml.copy_now, config.copy_delay_s, chunks=ggml.n_chunks,
                                              copy_chunk=ggml.copy_chunk)

    def _costs(self, config: CacheConfig, n_threads: int) -> MissCosts:
        """The auto policy's cost model: the hardware profile's, or measured now on the slots."""
        if config.hw_profile is not None:
            from ggmoe.cache.hardware import load_profile

            return load_profile(config.hw_profile).miss_costs()
        return measure_costs(self.slots, self._ggml, n_threads, self._link_s)

    @property
    def stream(self) -> GgmlCopyBackend:
        """The ggml copies under the queue (the GPU's copy stream; memcpy on a CPU-only build)."""
        return self._ggml

    @classmethod
    def for_model(cls, model_ptr: int, ctx_ptr: int, config: CacheConfig, facts: ModelFacts,
                  n_threads: int | None = None) -> CacheRuntime:
        """The runtime for a loaded model, its layers and bytes per expert from the GGUF's facts; ``n_threads``:
        the CPU threads llama.cpp computes with (the auto policy's CPU cost; None: every core)."""
        bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
        return cls(model_ptr, ctx_ptr, config, facts.moe_layers, facts.n_expert, facts.n_expert_used, bpe,
                   n_threads, split=model_split(facts, config.layer_theta))

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
            self.copies = None
        if self._ggml is not None:  # the stream under a queue (closing twice is harmless)
            self._ggml.close()
            self._ggml = None
        if self.slots is not None:
            self.slots.close()
            self.slots = None
