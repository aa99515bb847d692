"""The engine: llama.cpp through llama-cpp-python's low-level API, experts kept host-side.

Layers, bottom up:
- ``ggmoe._bindings`` (raw ctypes, C prototypes as comments);
- small owning wrappers here (``_Model``, ``_Context``, ``_Batch``, ``_Sampler``)
  that free what they allocate;
- the Pythonic ``Engine``: tokenize, decode (with the gate hook), generate.

Nothing above this module touches ctypes. The gate hook uses llama.cpp's
``cb_eval`` scheduler callback: it asks to stop only at ``ffn_moe_topk-{il}``
(one sync point per MoE layer) and, at ask time, remembers the
``ffn_moe_probs-{il}`` and ``ffn_moe_logits-{il}`` nodes of the same layer; both
are computed before the top-k and stay alive until the expert matmuls, so they
can be read at the top-k stop. The MoE input is ``src[1]`` of the router
matmul ``ffn_moe_logits = gate_inp @ cur``.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ggmoe.cache import CacheConfig, CacheStats
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.slots import CacheRuntime, RouteAdapter
from ggmoe.errors import EngineError, ModelFileError, UsageError
from ggmoe.hook import RouteEvent, RouteObserver
from ggmoe.inspect import inspect_model
from ggmoe.inspect.names import EXPERT_TENSOR_PATTERN

llama_cpp = B.llama_cpp


_OVERRIDDEN = re.compile(r"^tensor (\S+) \(.*\) buffer type overridden to ")
_NAME_OFFSET = B.ggml_tensor.name.offset  # bytes from a ggml_tensor * to its name
_HOOK_NAME = re.compile(rb"^ffn_moe_(topk|probs|logits)-(\d+)$")


# --------------------------------------------------------------------------- logging

class _LlamaLog:
    """Routes llama.cpp's log into a ring buffer (for error messages) and, if verbose, stderr."""

    def __init__(self) -> None:
        self.verbose = False
        self.lines: deque[str] = deque(maxlen=4096)  # recent lines: error messages, tests
        self.count = 0  # lines seen in all
        self._cb = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        s = text.decode("utf-8", errors="replace")
        self.lines.append(s)
        self.count += 1
        if self.verbose:
            import sys

            print(s, end="", file=sys.stderr, flush=True)

    def since(self, mark: int) -> list[str]:
        """Lines logged after ``count`` was ``mark`` (as many as the ring still holds)."""
        n = min(self.count - mark, len(self.lines))
        return list(self.lines)[len(self.lines) - n:] if n > 0 else []

    def last_error(self) -> str:
        errs = [ln.strip() for ln in self.lines if "error" in ln.lower() or "failed" in ln.lower()]
        return errs[-1] if errs else ""


_log: _LlamaLog | None = None


def _backend() -> _LlamaLog:
    global _log
    if _log is None:
        _log = _LlamaLog()
        llama_cpp.llama_backend_init()
    return _log


# --------------------------------------------------------------------------- devices

def gpu_device_name() -> str | None:
    """Name of the first GPU ggml sees, or None on a CPU-only build or machine."""
    _backend()
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    return B.libggml.ggml_backend_dev_name(dev).decode() if dev else None


def _host_expert_buft() -> int:
    """Buffer type for expert tensors: the GPU's pinned host memory if there is a GPU, else CPU."""
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    if dev:
        buft = B.libggml.ggml_backend_dev_host_buffer_type(dev)
        if buft:
            return buft
    return B.libggml_cpu.ggml_backend_cpu_buffer_type()


# --------------------------------------------------------------------------- owning wrappers

class _Model:
    """Owns a ``llama_model *``."""

    def __init__(self, path: Path, n_gpu_layers: int, experts_on_host: bool) -> None:
        log = _backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        self._overrides = None  # kept alive: llama.cpp reads it during load
        if experts_on_host:
            self._overrides = (B.llama_model_tensor_buft_override * 2)()
            self._pattern = EXPERT_TENSOR_PATTERN.encode()
            self._overrides[0].pattern = self._pattern
            self._overrides[0].buft = _host_expert_buft()
            params.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
            # llama.cpp recommends no mmap for overridden tensors: they are copied anyway.
            params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        mark = log.count
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        # llama.cpp logs (at debug level) each tensor the override placed: keep their names.
        loaded = log.since(mark)
        self.host_expert_tensors = tuple(
            m.group(1) for m in (_OVERRIDDEN.match(ln) for ln in loaded) if m is not None)
        if not self.ptr:
            detail = log.last_error()
            raise ModelFileError(f"llama.cpp could not load {path}" + (f": {detail}" if detail else ""))
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None


class _Context:
    """Owns a ``llama_context *`` with the gate hook installed as ``cb_eval``."""

    def __init__(self, model: _Model, n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int,
                 cb_eval: Callable | None) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        self._cb = None
        if cb_eval is not None:
            self._cb = llama_cpp.ggml_backend_sched_eval_callback(cb_eval)
            params.cb_eval = self._cb
            params.cb_eval_user_data = None
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise EngineError(f"llama.cpp could not create a context (n_ctx={n_ctx}): {_backend().last_error()}")
        self.n_ctx = llama_cpp.llama_n_ctx(self.ptr)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None


class _Batch:
    """Owns a ``llama_batch`` of up to ``capacity`` tokens for one sequence."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.batch = llama_cpp.llama_batch_init(capacity, 0, 1)

    def fill(self, tokens: Sequence[int], pos0: int, all_logits: bool) -> None:
        b = self.batch
        n = len(tokens)
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == n - 1

    def close(self) -> None:
        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None


class _Sampler:
    """Owns a llama.cpp sampler chain: greedy at temperature 0, else top-k/top-p/temp/dist."""

    def __init__(self, temp: float, seed: int, top_k: int = 40, top_p: float = 0.95) -> None:
        self.ptr = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        if temp <= 0:
            add(self.ptr, llama_cpp.llama_sampler_init_greedy())
        else:
            add(self.ptr, llama_cpp.llama_sampler_init_top_k(top_k))
            add(self.ptr, llama_cpp.llama_sampler_init_top_p(top_p, 1))
            add(self.ptr, llama_cpp.llama_sampler_init_temp(temp))
            add(self.ptr, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def sample(self, ctx: _Context) -> int:
        return int(llama_cpp.llama_sampler_sample(self.ptr, ctx.ptr, -1))

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None


# --------------------------------------------------------------------------- gate hook (ctypes side)

class _GateHook:
    """The ``cb_eval`` callback: turns ggml tensors into ``RouteEvent`` for an observer.

    Never raises into C: an exception is stored and re-raised by ``Engine`` after
    ``llama_decode`` returns.
    """

    def __init__(self) -> None:
        self.observer: RouteObserver | None = None
        self.error: BaseException | None = None
        self._probs: dict[int, int] = {}  # il -> address of ffn_moe_probs-{il}
        self._logits: dict[int, int] = {}  # il -> address of ffn_moe_logits-{il}

    def __call__(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        # Called for every graph node with ask=True: keep that path to a name read and a
        # prefix test (about 1 us); only the three ffn_moe_* names of a layer go further.
        try:
            if self.observer is None or self.error is not None:
                return False
            name = ctypes.string_at(t_ptr + _NAME_OFFSET)
            if not name.startswith(b"ffn_moe_"):
                return False
            m = _HOOK_NAME.match(name)
            if m is None:
                return False
            kind, il = m.group(1), int(m.group(2))
            if ask:
                if kind == b"topk":
                    return True
                (self._probs if kind == b"probs" else self._logits)[il] = t_ptr
                return False
            t = ctypes.cast(t_ptr, B.ggml_tensor_p).contents
            self.observer.on_route(self._event(t, il))
            return True
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return True

    def _event(self, topk: B.ggml_tensor, il: int) -> RouteEvent:
        req = self.observer.request
        n_used, n_tokens = topk.ne[0], topk.ne[1]
        ids = _read_2d(topk, np.int32, n_tokens, n_used)
        probs = hidden = None
        if req.probs and il in self._probs:
            p = ctypes.cast(self._probs[il], B.ggml_tensor_p).contents
            probs = _read_2d(p, np.float32, n_tokens, p.ne[0])
        if req.hidden and il in self._logits:
            lg = ctypes.cast(self._logits[il], B.ggml_tensor_p).contents
            inp = lg.src[1].contents
            hidden = _read_2d(inp, np.float32, n_tokens, inp.ne[0])
        self._probs.pop(il, None)
        self._logits.pop(il, None)
        return RouteEvent(il=il, ids=ids, probs=probs, hidden=hidden)


def _read_2d(t: B.ggml_tensor, dtype: type, rows: int, cols: int) -> np.ndarray:
    """Dense copy [rows, cols] of a 2-D ggml tensor, honouring its byte strides nb[0], nb[1]."""
    tp = ctypes.pointer(t)
    nbytes = B.libggml_base.ggml_nbytes(tp)
    raw = np.empty(nbytes, dtype=np.uint8)
    B.libggml_base.ggml_backend_tensor_get(tp, raw.ctypes.data, 0, nbytes)
    dt = np.dtype(dtype)
    if t.type != {np.dtype(np.float32): B.GGML_TYPE_F32, np.dtype(np.int32): B.GGML_TYPE_I32}[dt]:
        raise EngineError(f"hook tensor {t.name.decode()} has ggml type {t.type}, expected {dt}")
    view = np.ndarray(shape=(rows, cols), dtype=dt, buffer=raw, offset=0, strides=(t.nb[1], t.nb[0]))
    return view.copy()


# --------------------------------------------------------------------------- the Pythonic API

# on_step(tokens fed, position of the first, whether it was the prefill)
StepCallback = Callable[[list[int], int, bool], None]

@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_ctx: int = 1024  # tokens
    n_batch: int = 512  # tokens per llama_decode call
    n_ubatch: int = 512  # tokens per micro-batch (one graph compute)
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 2)
    n_gpu_layers: int = -1  # dense layers on the GPU when there is one (-1: all)
    experts_on_host: bool = True  # expert tensors in host memory (pinned when a GPU exists)
    gate_hook: bool = True  # install the gate hook (False: stock compute, for baselines)
    hook_path: str = "auto"  # auto: the patched route op when available, else cb_eval | route | cb_eval
    cache: CacheConfig | None = None  # the expert cache (needs the patched engine)
    verbose: bool = False


@dataclass(frozen=True)
class Timings:
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated tokens, EOG excluded
    stopped_on_eog: bool
    timings: Timings


class Engine:
    """A loaded model with one sequence of KV cache and an optional gate-hook observer."""

    def __init__(self, config: EngineConfig, observer: RouteObserver | None = None) -> None:
        path = Path(config.model_path)
        if not path.is_file():
            raise ModelFileError(f"model file not found: {path}")
        if config.n_ctx < 8 or config.n_batch < 1 or config.n_ubatch < 1:
            raise UsageError("n_ctx must be >= 8 and n_batch, n_ubatch >= 1")
        _backend().verbose = config.verbose
        self.config = config
        # The patched engine's route op is the gate hook; a stock build falls back to cb_eval.
        self.patched = _patched.is_patched()
        if config.cache is not None and not self.patched:
            _patched.load()  # raises EngineNotPatchedError with the fix in its message
        if config.cache is not None and not config.experts_on_host:
            raise UsageError("the expert cache needs the experts in host memory (experts_on_host=True)")
        if config.hook_path not in ("auto", "route", "cb_eval"):
            raise UsageError(f"hook_path must be auto, route or cb_eval, not {config.hook_path!r}")
        if config.hook_path == "route" and not self.patched:
            _patched.load()
        if config.hook_path == "cb_eval" and config.cache is not None:
            raise UsageError("the expert cache runs on the route op, not on cb_eval")
        use_route = config.gate_hook and self.patched and config.hook_path != "cb_eval"
        self._hook = _GateHook()
        self._route = RouteAdapter() if use_route else None
        self._runtime: CacheRuntime | None = None
        self._model = _Model(path, config.n_gpu_layers, config.experts_on_host)
        try:
            self._ctx = _Context(self._model, config.n_ctx, config.n_batch, min(config.n_ubatch, config.n_batch),
                                 config.n_threads, self._hook if config.gate_hook and not use_route else None)
            if self._route is not None:
                _patched.load().llama_ggmoe_set_route_cb(self._ctx.ptr, self._route.c_callback, None)
            if config.cache is not None:
                self._runtime = self._make_cache(path, config.cache)
                self._route.cache = self._runtime.cache
        except BaseException:
            self.close()
            raise
        self._batch = _Batch(config.n_batch)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._model.vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model.ptr)
        self.n_layer = llama_cpp.llama_model_n_layer(self._model.ptr)
        self.n_ctx = self._ctx.n_ctx
        self.n_past = 0  # tokens in the KV cache
        self.observer = observer
        # expert tensors llama.cpp placed in the host buffer type, as it logged them
        self.host_expert_tensors: tuple[str, ...] = self._model.host_expert_tensors

    def _make_cache(self, path: Path, cache: CacheConfig) -> CacheRuntime:
        facts = inspect_model(path)
        bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
        return CacheRuntime(self._model.ptr, self._ctx.ptr, cache, facts.moe_layers, facts.n_expert,
                            facts.n_expert_used, bpe)

    @property
    def cache_stats(self) -> CacheStats | None:
        """Hits, misses, bytes copied and waits per layer since load (None without a cache)."""
        return self._runtime.cache.stats if self._runtime is not None else None

    def record_hook_times(self, on: bool = True) -> None:
        """Start (or stop) recording the seconds of every route callback (one per layer call)."""
        if self._route is None:
            raise UsageError("hook timings need the route op of the patched engine")
        self._route.times = [] if on else None

    @property
    def hook_times(self) -> np.ndarray:
        """Seconds per route callback since ``record_hook_times()`` [n_calls] float64."""
        times = self._route.times if self._route is not None else None
        return np.asarray(times if times is not None else [], dtype=np.float64)

    @property
    def cache_slots(self) -> dict[int, int] | None:
        return self._runtime.cache.n_slots if self._runtime is not None else None

    # -- lifecycle
    def close(self) -> None:
        # The context goes before the slot tensors it computes with.
        for part in ("_batch", "_ctx", "_runtime", "_model"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()
                setattr(self, part, None)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def observer(self) -> RouteObserver | None:
        return self._route.observer if self._route is not None else self._hook.observer

    @observer.setter
    def observer(self, obs: RouteObserver | None) -> None:
        if obs is not None and not self.config.gate_hook:
            raise UsageError("this engine was created with gate_hook=False")
        if self._route is not None:
            self._route.observer = obs
        else:
            self._hook.observer = obs

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp loaded it (e.g. ``qwen3moe.expert_count``)."""
        return self._model.meta(key)

    # -- text
    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._model.vocab, data, len(data), buf, cap, add_bos, False)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._model.vocab, data, len(data), buf, cap, add_bos, False)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))

    # -- compute
    def reset(self) -> None:
        """Forget the sequence (clear the KV cache)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx.ptr), True)
        self.n_past = 0

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence; return logits [n_tokens or 1, n_vocab] float32.

        Runs in chunks of ``n_batch`` tokens; the gate hook fires per micro-batch and MoE layer.
        """
        if len(tokens) == 0:
            raise UsageError("nothing to decode")
        if self.n_past + len(tokens) > self.n_ctx:
            raise UsageError(f"context full: {self.n_past} + {len(tokens)} tokens > n_ctx {self.n_ctx}")
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} out of range [0, {self.n_vocab})")
        out = []
        for i in range(0, len(tokens), self.config.n_batch):
            chunk = tokens[i : i + self.config.n_batch]
            self._batch.fill(chunk, self.n_past, all_logits)
            rc = llama_cpp.llama_decode(self._ctx.ptr, self._batch.batch)
            self._raise_hook_error()
            if rc != 0:
                raise EngineError(f"llama_decode failed with code {rc}: {_backend().last_error()}")
            self.n_past += len(chunk)
            if all_logits or i + self.config.n_batch >= len(tokens):
                out.append(self._logits(len(chunk) if all_logits else 1))
        return np.concatenate(out, axis=0) if all_logits else out[-1]

    def _raise_hook_error(self) -> None:
        """Re-raise what a callback stored during llama_decode (they never raise into C)."""
        err, self._hook.error = self._hook.error, None
        if self._route is not None:
            err, self._route.error = err or self._route.error, None
            code = _patched.load().llama_ggmoe_get_error(self._ctx.ptr)
            if err is None and code != 0:
                err = EngineError(f"the route op failed: {_patched.ERROR_NAMES.get(code, code)}")
        if err is not None:
            raise err

    def _logits(self, n_rows: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits(self._ctx.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab)).copy()

    # -- generation
    def stream(self, prompt_ids: Sequence[int], max_tokens: int, temp: float = 0.0, seed: int = 0,
               forced: Sequence[int] | None = None, all_logits: bool = False,
               on_step: StepCallback | None = None) -> Iterator[tuple[int, float]]:
        """Prefill ``prompt_ids`` then yield (token, seconds of the decode that produced it).

        The first item's seconds is the prefill time; the last token is not fed back.
        With ``forced`` tokens (teacher forcing) those are fed instead of sampled ones.
        ``all_logits`` makes the prefill compute every token's output: llama.cpp
        otherwise runs the last layer only for the tokens whose logits are wanted, so
        its MoE routes just those (traces want all). ``on_step(tokens, pos0, prefill)``
        runs after every decode, while the gate hook's events of that step are fresh.
        """
        sampler = _Sampler(temp, seed)
        try:
            t0 = time.perf_counter()
            pos0 = self.n_past
            self.decode(prompt_ids, all_logits=all_logits)
            dt = time.perf_counter() - t0
            if on_step:
                on_step(list(prompt_ids), pos0, True)
            for i in range(max_tokens):
                tok = int(forced[i]) if forced is not None else sampler.sample(self._ctx)
                yield tok, dt
                if (forced is None and self.is_eog(tok)) or i == max_tokens - 1:
                    return
                t0 = time.perf_counter()
                self.decode([tok])
                dt = time.perf_counter() - t0
                if on_step:
                    on_step([tok], self.n_past - 1, False)
        finally:
            sampler.close()

    def generate(self, prompt: str, max_tokens: int, temp: float = 0.0, seed: int = 0,
                 all_logits: bool = False, on_step: StepCallback | None = None) -> Generation:
        if max_tokens < 1:
            raise UsageError("max_tokens must be at least 1")
        self.reset()
        prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise UsageError("the prompt is empty after tokenization")
        out: list[int] = []
        prefill_s, decode_s, eog = 0.0, 0.0, False
        for i, (tok, dt) in enumerate(self.stream(prompt_ids, max_tokens, temp, seed, all_logits=all_logits,
                                                  on_step=on_step)):
            if i == 0:
                prefill_s = dt
            else:
                decode_s += dt
            if self.is_eog(tok):
                eog = True
                break
            out.append(tok)
        n_dec = max(len(out) - 1 + int(eog), 0)  # decode steps actually run after the prefill
        return Generation(
            text=self.detokenize(out),
            prompt_ids=tuple(prompt_ids),
            token_ids=tuple(out),
            stopped_on_eog=eog,
            timings=Timings(len(prompt_ids), prefill_s, n_dec, decode_s),
        )
