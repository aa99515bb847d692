"""Engine side of the expert cache: slot tensors, expert copies, the route callback.

Engine layer (ctypes allowed). ``SlotTensors`` allocates, for every MoE layer,
one cache tensor ``[ne0, ne1, n_slots]`` per expert tensor kind with ggml's
allocator on the layer's device buffer type. ``GgmlLoader`` copies expert
slices of the host tensors into slots through ggml's backend API: on a GPU a
second backend instance of the device gives its own stream for async copies
from pinned host memory; on a CPU-only build it is a plain ``tensor_set``
(memcpy), which exercises the same path. ``RouteAdapter`` is the C route
callback: it maps ids to slots through ``ggmoe.cache.ExpertCache`` and hands
``RouteEvent`` to the observer; it never raises into C.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ggmoe.cache import CacheConfig, ExpertCache
from ggmoe.cache.policies import POLICIES
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.errors import EngineError
from ggmoe.inspect.names import CACHED_KINDS, expert_weight_name


@dataclass(frozen=True)
class _Pair:
    """One kind of one layer: where experts live on the host and their slot tensor."""

    host: int  # ggml_tensor * of the model's expert tensor [ne0, ne1, n_expert]
    host_data: int  # its data pointer (host memory)
    cache: int  # ggml_tensor * of the slot tensor [ne0, ne1, n_slots]
    nb2: int  # bytes of one expert slice (same in both)


class SlotTensors:
    """Owns the ggml context and backend buffer of every layer's slot tensors."""

    def __init__(self, model_ptr: int, n_slots: dict[int, int], buft: int) -> None:
        P = _patched.load()
        self.pairs: dict[int, list[_Pair]] = {}
        found: dict[int, dict[str, int]] = {}
        for il in n_slots:
            found[il] = {k: P.llama_ggmoe_model_get_tensor(model_ptr, expert_weight_name(il, k).encode())
                         for k in CACHED_KINDS}
            found[il] = {k: v for k, v in found[il].items() if v}
            if not found[il]:
                raise EngineError(f"layer {il} has no expert tensors")
        n_tensors = sum(len(v) for v in found.values())
        params = B.ggml_init_params(mem_size=(n_tensors + 1) * B.libggml_base.ggml_tensor_overhead(),
                                    mem_buffer=None, no_alloc=True)
        self.ctx = B.libggml_base.ggml_init(params)
        self.buffer = None
        if not self.ctx:
            raise EngineError("ggml_init failed for the cache tensors")
        self.tensors: dict[int, dict[str, int]] = {}
        for il, kinds in found.items():
            self.tensors[il] = {}
            for kind, host_ptr in kinds.items():
                h = ctypes.cast(host_ptr, B.ggml_tensor_p).contents
                t = B.libggml_base.ggml_new_tensor_3d(self.ctx, h.type, h.ne[0], h.ne[1], n_slots[il])
                B.libggml_base.ggml_set_name(t, f"ggmoe_slots.{il}.{kind}".encode())
                self.tensors[il][kind] = ctypes.cast(t, ctypes.c_void_p).value
        self.buffer = B.libggml_base.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft)
        if not self.buffer:
            self.close()
            raise EngineError("could not allocate the expert cache (out of device memory?)")
        self.nbytes = B.libggml_base.ggml_backend_buffer_get_size(self.buffer)  # bytes
        for il, kinds in found.items():
            self.pairs[il] = [self._pair(host_ptr, self.tensors[il][kind]) for kind, host_ptr in kinds.items()]

    @staticmethod
    def _pair(host_ptr: int, cache_ptr: int) -> _Pair:
        h = ctypes.cast(host_ptr, B.ggml_tensor_p).contents
        if not h.buffer or not B.libggml_base.ggml_backend_buffer_is_host(h.buffer) or not h.data:
            raise EngineError(f"expert tensor {h.name.decode()} is not in host memory; "
                              "load the model with experts_on_host=True")
        return _Pair(host=host_ptr, host_data=h.data, cache=cache_ptr, nb2=h.nb[2])

    def bytes_per_expert(self) -> dict[int, int]:
        return {il: sum(p.nb2 for p in pairs) for il, pairs in self.pairs.items()}

    def close(self) -> None:
        if self.buffer:
            B.libggml_base.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            B.libggml_base.ggml_free(self.ctx)
            self.ctx = None


class GgmlLoader:
    """Copies experts into slots; async on a copy backend when given one, else synchronous."""

    def __init__(self, slots: SlotTensors, copy_backend: int | None = None) -> None:
        self.pairs = slots.pairs
        self.backend = copy_backend
        self._pending: set[int] = set()  # layers with copies in flight

    def load(self, il: int, expert: int, slot: int) -> None:
        for p in self.pairs[il]:
            src = p.host_data + expert * p.nb2
            t = ctypes.cast(p.cache, B.ggml_tensor_p)
            if self.backend:
                B.libggml_base.ggml_backend_tensor_set_async(self.backend, t, src, slot * p.nb2, p.nb2)
            else:
                B.libggml_base.ggml_backend_tensor_set(t, src, slot * p.nb2, p.nb2)
        if self.backend:
            self._pending.add(il)

    def wait(self, il: int) -> None:
        # One stream: synchronizing it lands every copy issued so far, this layer's included.
        if self.backend and self._pending:
            B.libggml_base.ggml_backend_synchronize(self.backend)
            self._pending.clear()

    def close(self) -> None:
        if self.backend:
            B.libggml_base.ggml_backend_free(self.backend)
            self.backend = None


def _device_bufts() -> tuple[int, int | None]:
    """(buffer type for slots, copy backend): the GPU's when there is one, else CPU and none."""
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    if dev:
        backend = B.libggml.ggml_backend_dev_init(dev, None)
        if not backend:
            raise EngineError("could not create a copy stream on the GPU")
        return B.libggml.ggml_backend_dev_buffer_type(dev), backend
    return B.libggml_cpu.ggml_backend_cpu_buffer_type(), None


class CacheRuntime:
    """Slot tensors + loader + ``ExpertCache``, registered with the context layer by layer."""

    def __init__(self, model_ptr: int, ctx_ptr: int, config: CacheConfig, moe_layers: tuple[int, ...],
                 n_expert: int, n_expert_used: int, bytes_per_expert: dict[int, int]) -> None:
        n_slots = config.slots({il: bytes_per_expert[il] for il in moe_layers}, n_expert, n_expert_used)
        policy = POLICIES.get(config.policy)(n_expert, list(moe_layers))
        buft, backend = _device_bufts()
        self.loader: GgmlLoader | None = None
        try:
            self.slots = SlotTensors(model_ptr, n_slots, buft)
        except BaseException:
            if backend:
                B.libggml_base.ggml_backend_free(backend)
            raise
        self.loader = GgmlLoader(self.slots, backend)
        self.cache = ExpertCache(n_expert, n_expert_used, n_slots, policy, self.loader,
                                 bytes_per_expert=self.slots.bytes_per_expert())
        P = _patched.load()
        for il, n in n_slots.items():
            t = self.slots.tensors[il]
            rc = P.llama_ggmoe_set_layer_cache(ctx_ptr, il, n, *(t.get(k) for k in CACHED_KINDS))
            if rc != _patched.LLAMA_GGMOE_OK:
                self.close()
                raise EngineError(f"llama_ggmoe_set_layer_cache(layer {il}) failed: "
                                  f"{_patched.ERROR_NAMES.get(rc, rc)}")

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self.slots.close()
