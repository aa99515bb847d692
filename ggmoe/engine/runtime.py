"""The engine's expert cache at run time: slot tensors, copy backend and ``ExpertCache``, on a context.

Engine layer (ctypes allowed). ``CacheRuntime`` allocates the slot tensors
(``ggmoe.engine.slot_tensors``) on the GPU when there is one, opens the copy
stream and the ggml copy backend over them (``ggmoe.engine.copies``), with the
priority queue in front when low-priority copies must not hold up demand
copies, builds the ``ExpertCache`` and registers the slot tensors with the
patched context. The route callback that drives the cache lives in
``ggmoe.engine.hooks``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ggmoe.base.errors import EngineError, UsageError
from ggmoe.cache import MonotonicClock, ThreadedCopyBackend
from ggmoe.cache.assemble import CacheSpec, assemble_cache
from ggmoe.cache.copy import LinkStreamCopyBackend, StreamCopyBackend
from ggmoe.cache.decode_mode import ModeEstimate, weigh_modes
from ggmoe.cache.host_tier import HostTier
from ggmoe.cache.miss import MissCosts, check_miss_policy, effective_miss_policy, without_host_path_when_full
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.policies.base import releases
from ggmoe.cache.split import LayerSplit, model_split
from ggmoe.cache.tier_copy import TieredCopyBackend
from ggmoe.cache.tiers import tier_sizes
from ggmoe.control.prefetch import default_n_prefetch
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.copies import GgmlCopyBackend, measure_costs
from ggmoe.engine.disk import FileDiskReader, HostSlots, expert_extents
from ggmoe.engine.host_part import host_spin_note, host_spin_us, host_threads, set_host_threads
from ggmoe.engine.slot_tensors import SlotTensors
from ggmoe.engine.streams import open_stream
from ggmoe.inspect.facts import ModelFacts
from ggmoe.inspect.names import CACHED_KINDS


@dataclass(frozen=True)
class DiskTier:
    """The experts stay in ``path``; every cached layer has ``host_slots`` pinned host slots above it."""

    path: Path
    host_slots: int


def _device_bufts() -> tuple[int, int | None, int | None]:
    """(buffer type for slots, copy backend, its device): the GPU's when there is one, else CPU and none."""
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    if dev:
        backend = B.libggml.ggml_backend_dev_init(dev, None)
        if not backend:
            raise EngineError("could not create a copy stream on the GPU")
        return B.libggml.ggml_backend_dev_buffer_type(dev), backend, dev
    return B.libggml_cpu.ggml_backend_cpu_buffer_type(), None, None


def use_copy_queue(ggml: GgmlCopyBackend, config: RunConfig, miss_policy: str) -> bool:
    """Whether copies go through the priority queue (``StreamCopyBackend``): on an asynchronous stream (a
    GPU's, or the CPU build's deferred one), when there are low-priority copies (prefetches, or admissions of
    the host path) that a demand copy must not wait behind. Otherwise every copy is a demand copy and the
    plain stream does (no worker thread)."""
    return ggml.stream.name != "immediate" and config.copy_delay_s is None and (
        config.prefetch is not None or miss_policy != "wait")


class CacheRuntime:
    """Slot tensors + copy backend + ``ExpertCache``, registered with the context layer by layer."""

    def __init__(self, model_ptr: int, ctx_ptr: int, config: RunConfig, moe_layers: tuple[int, ...],
                 n_expert: int, n_expert_used: int, bytes_per_expert: dict[int, int],
                 n_threads: int | None = None, split: dict[int, LayerSplit] | None = None,
                 disk: DiskTier | None = None) -> None:
        """``split``: the layers whose slots hold top segments (MoEpic, from the config's top shares).
        ``disk``: the experts stay in the model file; the copies read them through a host tier."""
        self.split = split or {}
        self.host_slots: HostSlots | None = None
        self.tier: HostTier | None = None
        self.disk = disk
        self.source = None  # (il, kind index, expert) -> the address a copy or a table reads it from (disk tier)
        if disk is not None:
            self._check_disk(config)
        slot_bytes = {il: self.split[il].top_bytes if il in self.split else bytes_per_expert[il] for il in moe_layers}
        n_slots = config.cache.slots(slot_bytes, n_expert, n_expert_used)
        # bottom buffers of a split layer: as many as the prefetcher queues per layer (MoEpic's y)
        pre = config.prefetch
        self.n_bottom = (pre.n_prefetch or default_n_prefetch(n_expert_used, n_expert)) \
            if self.split and pre is not None else 0
        policy = POLICIES.get(config.cache.policy)(n_expert, list(moe_layers), **dict(config.cache.policy_options or {}))
        self.copies: GgmlCopyBackend | ThreadedCopyBackend | None = None
        self._ggml: GgmlCopyBackend | None = None
        self.slots: SlotTensors | None = None
        asked = check_miss_policy(config.decode.miss_policy)
        asked, full_note = without_host_path_when_full(asked, n_slots, n_expert, keeps=not releases(policy))
        if disk is not None and asked == "auto":
            asked, full_note = "wait", ("auto runs as wait: under a disk tier most experts are not in host memory "
                                        "for the CPU to compute")
        if self.split and asked != "wait":
            raise EngineError("split experts read what is not cached from host memory through the expert "
                              f"table: --miss-policy {asked} (the host path) cannot serve them; use wait")
        try:
            self._allocate(model_ptr, n_slots, config, zero_slot=asked == "cpu")
            costs = self._choose_miss_policy(config, asked, n_threads or os.cpu_count() or 1, n_expert_used,
                                             full_note)
            host_path = self.miss_policy != "wait"
            if host_path and asked == "auto":  # the host path reads a zero slot: allocate again with it
                self._allocate(model_ptr, n_slots, config, zero_slot=True)
            if use_copy_queue(self._ggml, config, self.miss_policy):
                self.copies = StreamCopyBackend(self._ggml)
            if disk is not None:
                self._attach_disk(model_ptr, moe_layers, n_expert, bytes_per_expert, disk)
        except BaseException:
            self.close()
            raise
        try:  # a refusal below frees the slots and the copy stream (a server retrying would leak GPU memory)
            self.cache = assemble_cache(CacheSpec(n_expert, n_expert_used, n_slots, policy, self.copies,
                                                   clock=MonotonicClock(),
                                                   bytes_per_expert=self.slots.bytes_per_expert(),
                                                   miss_policy=self.miss_policy, costs=costs, split=self.split,
                                                   n_bottom=self.n_bottom))
            self._register(ctx_ptr, n_slots, host_path)
            if host_path:
                set_host_threads(ctx_ptr, self.host_threads, self._host_order, self.host_spin_us)
        except BaseException:
            self.unregister(ctx_ptr, n_slots)
            self.close()
            raise

    def _choose_miss_policy(self, config: RunConfig, asked: str, n_threads: int, n_expert_used: int,
                            full_note: str | None) -> MissCosts | None:
        """The miss policy that runs (``auto`` becomes ``wait`` where the host path would only cost) and where
        the host part runs; the costs ``auto`` weighs, None for the other policies."""
        costs = self._costs(config, n_threads) if asked == "auto" else None
        self._measured = costs if config.decode.hw_profile is None else None  # measured here (mode_estimate's too)
        # the host part on a worker beside the device part (patch 0015): the CPU then serves misses while the
        # link copies others, and auto splits them between the two
        self.host_threads, self._host_order = host_threads(n_threads, self.on_gpu, config.decode.host_threads)
        self.host_spin_us = 0  # the hand-off's spin, where a host path runs (below)
        self.miss_policy, self.miss_policy_note = effective_miss_policy(
            asked, costs, self.slots.bytes_per_expert(), n_expert_used if self.host_threads else None)
        self.miss_policy_note = self.miss_policy_note or full_note
        if self.miss_policy == "wait":
            self.host_threads = 0
            if config.decode.host_threads is not None:  # said once, with why the host path is off
                why = self.miss_policy_note or "the miss policy is wait"
                self.miss_policy_note = f"{why}; --host-threads {config.decode.host_threads} does nothing without a host path"
        else:
            self.host_spin_us = host_spin_us(n_threads, self.host_threads, self.on_gpu)
            note = host_spin_note(n_threads, self.host_threads, self.on_gpu, config.decode.host_threads,
                                  self.host_spin_us)
            if note:
                self.miss_policy_note = f"{self.miss_policy_note}; {note}" if self.miss_policy_note else note
        return costs

    def _check_disk(self, config: RunConfig) -> None:
        """What a disk tier cannot serve, refused before anything is allocated."""
        if self.split:
            raise UsageError("split experts (top share θ < 1) read their bottoms from host memory: they need "
                             "every expert in RAM (a larger --host-ram, or no --layer-theta)")
        if config.decode.miss_policy == "cpu":
            raise UsageError("--miss-policy cpu computes misses from host memory, and with a disk tier (--host-ram "
                             "below the experts' size) most experts are not there: use --miss-policy wait")

    def _attach_disk(self, model_ptr: int, layers: tuple[int, ...], n_expert: int, bytes_per_expert: dict[int, int],
                     disk: DiskTier) -> None:
        """The host tier's pinned slots, the file's reader and the host tier, and the copies through them: a
        copy reads its expert from the host tier (read from disk first when it is not there)."""
        from ggmoe.engine.loader import host_expert_buft

        self.host_slots = HostSlots(model_ptr, layers, disk.host_slots, host_expert_buft())
        extents = expert_extents(disk.path, self.host_slots)
        self.tier = HostTier(layers, n_expert, disk.host_slots, bytes_per_expert, FileDiskReader(extents))
        tier = self.tier
        ggml_pairs = self._ggml.pairs

        def source(il: int, kind: int, expert: int) -> int:
            slot = tier.readable(il, expert)
            if slot >= 0:
                ext = extents[il][kind]
                return ext.host + slot * ext.nb2
            p = ggml_pairs[il][kind]
            return p.host_data + expert * p.nb2  # the file in place (llama.cpp's mapping)

        self._ggml.source = self.source = source
        self.copies = TieredCopyBackend(self.copies, self.tier)

    def _register(self, ctx_ptr: int, n_slots: dict[int, int], host_path: bool) -> None:
        """Hand every layer's slot tensors (and the host path) to the context; raises on a refusal."""
        P = _patched.symbols()
        for il, n in n_slots.items():
            t = self.slots.tensors[il]
            rc = P.llama_ggmoe_set_layer_cache(ctx_ptr, il, self.slots.registered[il],
                                               *(t.get(k) for k in CACHED_KINDS))
            if rc == _patched.LLAMA_GGMOE_OK and host_path:
                rc = P.llama_ggmoe_set_host_path(ctx_ptr, il, n)
                if rc == _patched.LLAMA_GGMOE_ERR_HOST:
                    raise EngineError(f"layer {il} has {n} cache slots: the host path needs at least 2 (one "
                                      "holds zeros); use more slots or --miss-policy wait")
            if rc != _patched.LLAMA_GGMOE_OK:
                raise EngineError(f"configuring the cache of layer {il} failed: {_patched.ERROR_NAMES.get(rc, rc)}")

    @staticmethod
    def unregister(ctx_ptr: int, layers: Iterable[int]) -> None:
        """Take ``layers``' slot tensors off the context, before they are freed: a context left pointing at
        freed tensors builds its next graph over them (on a GPU an illegal address; a refusal of a later layer
        left the earlier ones registered)."""
        P = _patched.symbols()
        for il in layers:
            P.llama_ggmoe_set_layer_cache(ctx_ptr, il, 0, None, None, None, None)
        P.llama_ggmoe_set_host_threads(ctx_ptr, 0, 0)  # the worker's thread, stopped with its cache

    def _allocate(self, model_ptr: int, n_slots: dict[int, int], config: RunConfig, zero_slot: bool) -> None:
        """(Re)create the slot tensors and the copy backend over them (the GPU's copy stream when there is one,
        else the CPU build's stream that ``GGMOE_COPY_STREAM`` names)."""
        self.close()
        buft, backend, device = _device_bufts()
        self.on_gpu = bool(backend)
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
            self.copies = LinkStreamCopyBackend(ggml, config.copy_delay_s)

    def mode_estimate(self, config: RunConfig, n_threads: int) -> ModeEstimate:
        """``auto``'s weighing of the two decode modes (estimates): the copy cost measured
        here (or the profile's), the route op's sync per layer and the misses' reads in place from the profile,
        else the h100 profile's measured sync on a GPU (the CPU build's reads in place and its route op's
        split cost nothing a GPU's would: its own callback, in both modes)."""
        from ggmoe.cache import parts as P
        from ggmoe.cache.hardware import load_profile

        cache, nb = self.cache, self.slots.bytes_per_expert()
        counts = {il: [int(x) for x in c] for il, c in (config.decode.routing_counts or {}).items()}  # plain ints
        shape = (nb, cache.n_slots, cache.n_expert, cache.n_expert_used)
        if config.decode.hw_profile is not None:
            prof = load_profile(config.decode.hw_profile)
            return weigh_modes(*shape, prof.copy_s, prof.hook_s, prof.zero_copy_s, f"profile {config.decode.hw_profile}",
                               counts, fills=config.decode.fills)
        costs = self._measured or measure_costs(self.slots, self._ggml, n_threads, self._link_s)
        if self._ggml.backend:  # a GPU: the misses read over the link at the copies' speed, a sync per layer
            return weigh_modes(*shape, costs.copy_s, P.HOOK_S, costs.copy_s, "copies measured here; a sync per "
                               "layer as measured on an H100, reads in place at the copies' speed", counts,
                               fills=config.decode.fills)
        return weigh_modes(*shape, costs.copy_s, 0.0, None, "copies measured here; the CPU build reads in place "
                           "from the memory it computes from", counts, fills=config.decode.fills)

    def _costs(self, config: RunConfig, n_threads: int) -> MissCosts:
        """The auto policy's cost model: the hardware profile's, or measured now on the slots."""
        if config.decode.hw_profile is not None:
            from ggmoe.cache.hardware import load_profile

            return load_profile(config.decode.hw_profile).miss_costs()
        return measure_costs(self.slots, self._ggml, n_threads, self._link_s)

    @property
    def stream(self) -> GgmlCopyBackend:
        """The ggml copies under the queue (the GPU's copy stream; memcpy on a CPU-only build)."""
        return self._ggml

    @classmethod
    def for_model(cls, model_ptr: int, ctx_ptr: int, config: RunConfig, facts: ModelFacts,
                  n_threads: int | None = None, model_path: Path | None = None) -> CacheRuntime:
        """The runtime for a loaded model, its layers and bytes per expert from the GGUF's facts; ``n_threads``:
        the CPU threads llama.cpp computes with (the auto policy's CPU cost; None: every core)."""
        bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
        disk = None
        if config.tiers.host_ram is not None and model_path is not None:
            tiers = tier_sizes(facts, 0, config.tiers.host_ram)
            disk = DiskTier(model_path, tiers.host_slots) if tiers.disk else None
        return cls(model_ptr, ctx_ptr, config, facts.moe_layers, facts.n_expert, facts.n_expert_used, bpe,
                   n_threads, split=model_split(facts, config.cache.layer_theta), disk=disk)

    def quiesce(self) -> None:
        """Land every copy in flight and stop the copy queue's worker, keeping the slot tensors: before the model
        is freed, whose host experts the copies read (a copy landing later read freed memory: the deferred
        stream crashed ``ggmoe.load``'s README example at exit; a GPU's copy engine would read it too)."""
        copies = self.copies
        if isinstance(copies, TieredCopyBackend):  # the disk reads land first, then the copies under them
            copies.tier.close()
            copies = copies.inner
        if copies is not None and copies is not self._ggml:  # a queue's worker; the stream stays
            copies.close()
        if self._ggml is not None:  # open until close(): closing it here would free a GPU's copy backend, and
            self._ggml.stream.synchronize()  # a later synchronize would assert on NULL

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
        if self.host_slots is not None:  # after the copies and reads that use it
            self.host_slots.close()
            self.host_slots = None
