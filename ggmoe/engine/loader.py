"""Loading through llama-cpp-python's own wrappers, plus what they lack.

``llama_cpp._internals`` owns the model, the context, the batch and the
sampler. ggmoe adds only: the ``tensor_buft_overrides`` array that puts every
routed expert tensor in host memory (the GPU's pinned host buffer type when
there is a GPU), the ``cb_eval`` slot of the context parameters, and the check
of where the expert tensors really landed, read from their buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llama_cpp import _internals

from ggmoe.base.errors import EngineError, ModelFileError
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.log import llama_log
from ggmoe.inspect import ModelFacts
from ggmoe.inspect.names import EXPERT_TENSOR_PATTERN, expert_pattern

llama_cpp = B.llama_cpp


def gpu_device() -> int | None:
    """The first GPU ggml sees (a ggml_backend_dev_t), or None on a CPU-only build or machine."""
    llama_log()
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    return dev or None


def gpu_device_name() -> str | None:
    """Name of the first GPU ggml sees, or None on a CPU-only build or machine."""
    dev = gpu_device()
    return B.libggml.ggml_backend_dev_name(dev).decode() if dev else None


def host_expert_buft() -> int:
    """Buffer type for expert tensors: the GPU's pinned host memory if there is a GPU, else CPU."""
    dev = gpu_device()
    if dev:
        buft = B.libggml.ggml_backend_dev_host_buffer_type(dev)
        if buft:
            return buft
    return B.libggml_cpu.ggml_backend_cpu_buffer_type()


class HostExpertOverride:
    """``llama_model_params.tensor_buft_overrides`` that puts every routed expert tensor in host memory.

    Keep the object alive until the model has loaded: llama.cpp reads the array (and the pattern string
    it points to) during ``llama_model_load_from_file``.
    """

    def __init__(self, layers: tuple[int, ...] | None = None, on_disk: bool = False) -> None:
        """``layers``: only these layers' experts go to host memory (llama.cpp's --n-cpu-moe); None: all.
        ``on_disk``: the experts stay in the file (a disk tier): the CPU buffer type over llama.cpp's mmap of
        the GGUF, read ahead by nobody (patch 0014); the host tier's pinned slots hold the ones in use."""
        self.on_disk = on_disk
        # the buffer type asked for the expert tensors
        self.buft = B.libggml_cpu.ggml_backend_cpu_buffer_type() if on_disk else host_expert_buft()
        self._pattern = (EXPERT_TENSOR_PATTERN if layers is None else expert_pattern(layers)).encode()
        # struct llama_model_tensor_buft_override[2]: the pattern, then the NULL terminator
        self._overrides = (B.llama_model_tensor_buft_override * 2)()
        self._overrides[0].pattern = self._pattern
        self._overrides[0].buft = self.buft

    def apply(self, params: llama_cpp.llama_model_params) -> None:
        """Point ``params.tensor_buft_overrides`` at the override list, and load without mmap.

        On a CPU-only build the override names the CPU buffer type, and llama.cpp then puts weights of
        the types it can repack (Q4_0, Q4_K, IQ4_NL... on AVX2/NEON) in its CPU_REPACK buffer, in an
        interleaved layout that slot copies and the host path cannot read; extra buffer types are turned
        off so every weight keeps the GGUF's layout (dense matmuls lose the repacked kernels' speed).
        """
        params.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        # llama.cpp copies overridden tensors anyway, so mmap would only double the page cache; on disk, the
        # experts are the mapping itself (CPU tensors from a mapping are not copied)
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if self.on_disk else llama_cpp.LLAMA_LOAD_MODE_NONE
        if self.buft == B.libggml_cpu.ggml_backend_cpu_buffer_type():
            params.use_extra_bufts = False


@dataclass
class LoadedModel:
    """A ``LlamaModel`` and the override llama.cpp read while loading it (kept alive with it)."""

    model: _internals.LlamaModel
    override: HostExpertOverride | None  # None: the expert tensors were not overridden

    @property
    def ptr(self) -> int:
        return self.model.model

    @property
    def expert_buft(self) -> int | None:
        """The buffer type asked for the expert tensors, None when not overridden."""
        return self.override.buft if self.override is not None else None

    def close(self) -> None:
        self.model.close()


def load_model(path: Path, n_gpu_layers: int, experts_on_host: bool,
               host_layers: tuple[int, ...] | None = None, on_disk: bool = False) -> LoadedModel:
    """Load the GGUF with the experts (of ``host_layers``, None: all) in host memory, or left in the file
    (``on_disk``: the disk tier); ModelFileError with llama.cpp's reason on failure."""
    log = llama_log()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    override = HostExpertOverride(host_layers, on_disk) if experts_on_host else None
    if override is not None:
        override.apply(params)
    mark = log.count
    try:
        with no_read_ahead(on_disk):
            model = _internals.LlamaModel(path_model=str(path), params=params, verbose=log.verbose)
    except ValueError:
        detail = log.error_since(mark)
        raise ModelFileError(f"llama.cpp could not load {path}" + (f": {detail}" if detail else "")) from None
    return LoadedModel(model, override)


@contextlib.contextmanager
def no_read_ahead(on: bool) -> Iterator[None]:
    """While ``on``: a model loaded with mmap is not read ahead (patch 0014), so a model larger than RAM loads
    without reading its whole file into the page cache."""
    if not on:
        yield
        return
    was = _patched.symbols().llama_ggmoe_set_mmap_prefetch(False)
    try:
        yield
    finally:
        _patched.symbols().llama_ggmoe_set_mmap_prefetch(was)


def resolve_tiers(run: RunConfig | None, facts: ModelFacts) -> tuple[RunConfig | None, bool]:
    """(the run with its host budget resolved, whether the experts stay on disk), before the model loads.

    The auto budget (``host_ram`` None) is read once, here, from the memory available now: a disk tier keeps
    it (the runtime sizes the host tier from it); a model that fits keeps None (no host tier)."""
    if run is None:
        return None, False
    from ggmoe.cache.tiers import tier_sizes

    tiers = tier_sizes(facts, 0, run.tiers.host_ram)
    if not tiers.disk:
        return run, False
    if run.tiers.auto_tiers and gpu_device() is None:
        return _cpu_tiers(run, facts, tiers.host_ram), True
    return dataclasses.replace(run, tiers=dataclasses.replace(run.tiers, host_ram=tiers.host_ram)), True


def _cpu_tiers(run: RunConfig, facts: ModelFacts, budget: int) -> RunConfig:
    """No cache size given, on a CPU-only build: the GPU tier's slots are host memory too, so the budget goes to
    them (every expert computed from a slot, a hit copied nowhere) and the host tier keeps a staging area of
    2 x n_expert_used slots: a token's reads and the predicted reads of the layers ahead pass through it."""
    from ggmoe.base.errors import UsageError

    slot = facts.expert_bytes_per_slot
    k = facts.n_expert_used
    host = min(2 * k, facts.n_expert - 1)
    gpu = min(budget // slot - host, facts.n_expert - 1) if slot else k
    if gpu < k:
        raise UsageError(f"the host budget of {budget} bytes gives {budget // slot} slots per layer: a model on "
                         f"disk needs at least {k + host} (n_expert_used for the computing tier, {host} to "
                         "stage reads) on a CPU-only build")
    return dataclasses.replace(run, cache=dataclasses.replace(run.cache, n_slots=int(gpu)),
                               tiers=dataclasses.replace(run.tiers, host_ram=host * slot))


def new_context(model: LoadedModel, n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int,
                cb_eval: object | None) -> _internals.LlamaContext:
    """A one-sequence context; ``cb_eval`` is a ``ggml_backend_sched_eval_callback`` or None."""
    log = llama_log()
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch
    params.n_seq_max = 1
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.no_perf = True
    if cb_eval is not None:
        params.cb_eval = cb_eval
        params.cb_eval_user_data = None
    mark = log.count
    try:
        return _internals.LlamaContext(model=model.model, params=params, verbose=log.verbose)
    except ValueError:
        raise EngineError(f"llama.cpp could not create a context (n_ctx={n_ctx}): "
                          f"{log.error_since(mark) or 'no reason logged'}") from None


def expert_placement(model: LoadedModel, facts: ModelFacts) -> dict[str, str] | None:
    """Buffer type name of every routed expert weight the cache holds, read from the tensor's buffer (patched engine).

    None: unknown. A stock build's API cannot look a model's tensors up by name (the patch adds
    ``llama_ggmoe_model_get_tensor``), and ggmoe does not guess placement from log lines.
    """
    if not _patched.is_patched():
        return None
    get = _patched.symbols().llama_ggmoe_model_get_tensor
    out = {}
    for layer in facts.layers:
        for t in layer.cached:
            addr = get(model.ptr, t.name.encode())
            if not addr:
                raise EngineError(f"llama.cpp has no tensor {t.name} although the GGUF declares it")
            buf = ctypes.cast(addr, B.ggml_tensor_p).contents.buffer
            buft = B.libggml_base.ggml_backend_buffer_get_type(buf) if buf else None
            out[t.name] = B.libggml_base.ggml_backend_buft_name(buft).decode() if buft else "none"
    return out
