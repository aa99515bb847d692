"""The Pythonic engine: tokenize, decode with the gate hook, generate.

Layers, bottom up: ``ggmoe.engine.ggml`` and ``ggmoe.engine.patch`` (raw
ctypes, C prototypes as comments); ``loader`` over llama-cpp-python's own
wrappers (``llama_cpp._internals``), ``hooks`` (the gate hook strategies and
observers), ``slot_tensors``, ``copies`` and ``runtime`` (the cache runtime's
device buffers, copies and owner); here the ``Engine``. Nothing
outside ``ggmoe/engine/`` touches ctypes.

The model's facts come first, from the bounded inspector: a file llama.cpp
would abort on is refused before llama.cpp sees it.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from llama_cpp import _internals

from ggmoe.base.context import decode_batch
from ggmoe.base.errors import EngineError, ModelFileError, UsageError
from ggmoe.base.hook import RouteObserver
from ggmoe.cache import CacheStats
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.hooks import CbEvalHook, Observers, RouteOpHook
from ggmoe.engine.loader import (
    LoadedModel,
    expert_placement,
    gpu_device_name,
    load_model,
    new_context,
    resolve_tiers,
)
from ggmoe.engine.log import llama_log
from ggmoe.engine.pipeline import CachePipeline
from ggmoe.engine.runtime import CacheRuntime
from ggmoe.inspect import ModelFacts, inspect_model

llama_cpp = B.llama_cpp

__all__ = ["Engine", "EngineConfig", "Generation", "Timings", "gpu_device_name"]


class _SigintGuard:
    """Holds Ctrl-C while llama.cpp computes; raises it as KeyboardInterrupt once the decode returned.

    A KeyboardInterrupt raised inside a ctypes callback would be swallowed by ctypes ("Exception ignored")
    and the route op would fail; so during a decode SIGINT only sets a flag. The handler is installed once
    (signal.signal is a syscall: about 7 us, too much per token) and behaves like Python's default outside
    a decode. If the program installed a SIGINT handler of its own, that one is left alone.
    """

    def __init__(self) -> None:
        self.in_decode = False
        self.pending = False
        self.installed = False

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.in_decode:
            self.pending = True
        else:
            signal.default_int_handler(signum, frame)

    def enter(self) -> None:
        if not self.installed:
            if threading.current_thread() is not threading.main_thread():
                return  # Python delivers signals to the main thread only
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                return  # somebody else handles Ctrl-C
            signal.signal(signal.SIGINT, self._on_sigint)
            self.installed = True
        self.in_decode = True

    def exit(self) -> None:
        self.in_decode = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


_sigint = _SigintGuard()


class _Sampler:
    """llama-cpp-python's sampler chain: greedy at temperature 0, else top-k/top-p/temp/dist."""

    def __init__(self, temp: float, seed: int, top_k: int = 40, top_p: float = 0.95) -> None:
        self.chain = _internals.LlamaSampler()
        if temp <= 0:
            self.chain.add_greedy()
        else:
            self.chain.add_top_k(top_k)
            self.chain.add_top_p(top_p, 1)
            self.chain.add_temp(temp)
            self.chain.add_dist(seed & 0xFFFFFFFF)

    def sample(self, ctx: _internals.LlamaContext) -> int:
        return int(self.chain.sample(ctx, -1))

    def close(self) -> None:
        self.chain.close()


# on_step(tokens fed, position of the first, whether it was the prefill)
StepCallback = Callable[[list[int], int, bool], None]

@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_ctx: int | None = None  # tokens; None: the model's training context
    n_batch: int = 512  # tokens per llama_decode call
    n_ubatch: int = 512  # tokens per micro-batch (one graph compute)
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 2)
    n_gpu_layers: int = -1  # dense layers on the GPU when there is one (-1: all)
    experts_on_host: bool = True  # expert tensors in host memory (pinned when a GPU exists)
    # with experts_on_host: only these MoE layers' experts (llama.cpp's --n-cpu-moe baseline); None: all
    host_expert_layers: tuple[int, ...] | None = None
    gate_hook: bool = True  # install the gate hook (False: stock compute, for baselines)
    hook_path: str = "auto"  # auto: the patched route op when available, else cb_eval | route | cb_eval
    run: RunConfig | None = None  # the expert cache and how it runs (needs the patched engine)
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
    stopped_on_ctx: bool = False  # generation stopped early because the context was full


class Engine:
    """A loaded model with one sequence of KV cache, the gate hook and its observers."""

    def __init__(self, config: EngineConfig, observer: RouteObserver | None = None) -> None:
        path = Path(config.model_path)
        if not path.is_file():
            raise ModelFileError(f"model file not found: {path}")
        if (config.n_ctx is not None and config.n_ctx < 8) or config.n_batch < 1 or config.n_ubatch < 1:
            raise UsageError("n_ctx must be >= 8 and n_batch, n_ubatch >= 1")
        if config.n_threads < 1:
            raise UsageError("n_threads must be >= 1")
        self.config = config
        # The facts first: the bounded reader validates the file before llama.cpp sees it.
        self.facts: ModelFacts = inspect_model(path)
        llama_log().verbose = config.verbose
        self.patched = _patched.is_patched()
        kind = self._hook_kind(config)
        self.observers = Observers()
        # cb_eval (a stock build): the hook is the context's scheduler callback; route: the pipeline's
        self._hook: RouteOpHook | CbEvalHook | None = CbEvalHook(self.observers, self.facts.gating) if kind == "cb_eval" else None
        # route hook, cache runtime, decode mode, expert tables, controller, prefetcher (ggmoe.engine.pipeline)
        self.pipeline: CachePipeline | None = None
        self._model: LoadedModel | None = None
        self._ctx: _internals.LlamaContext | None = None
        self._batch: _internals.LlamaBatch | None = None
        try:
            if config.host_expert_layers is not None and config.run is not None:
                raise UsageError("the expert cache needs every layer's experts in host memory "
                                 "(host_expert_layers=None)")
            run, on_disk = resolve_tiers(config.run, self.facts)
            self._model = load_model(path, config.n_gpu_layers, config.experts_on_host, config.host_expert_layers,
                                     on_disk)
            self.n_ctx_train = int(self._model.model.n_ctx_train())  # tokens the model was trained on
            n_ctx = config.n_ctx or self.n_ctx_train
            # llama.cpp takes at most min(n_ctx, n_batch) tokens per llama_decode: the engine feeds that many
            self.n_batch = decode_batch(n_ctx, config.n_batch)  # tokens per llama_decode call
            self._ctx = new_context(self._model, n_ctx, self.n_batch, min(config.n_ubatch, self.n_batch),
                                    config.n_threads, self._hook.c_callback if kind == "cb_eval" else None)
            if kind == "route":
                self.pipeline = CachePipeline(self._model.ptr, self._ctx.ctx, self.facts, path, run,
                                              self.observers, config.n_threads, self.n_batch,
                                              min(config.n_ubatch, self.n_batch))
                self._hook = self.pipeline.hook
            self._batch = _internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
            # expert tensor name -> its buffer type's name (e.g. CPU, CUDA_Host), None on a stock build
            self.expert_buffers: dict[str, str] | None = expert_placement(self._model, self.facts)
            self.host_expert_tensors = self._check_placement()
        except BaseException:
            self.close()
            raise
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._model.model.vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model.ptr)
        self.n_layer = llama_cpp.llama_model_n_layer(self._model.ptr)
        self.n_ctx = self._ctx.n_ctx()
        self.n_past = 0  # tokens in the KV cache
        self.stopped_on_ctx = False  # the last stream() stopped because the context was full
        if observer is not None:
            self.add_observer(observer)

    def _hook_kind(self, config: EngineConfig) -> str | None:
        """Which gate hook strategy: the patched route op when available, else cb_eval; None without a hook."""
        if config.hook_path not in ("auto", "route", "cb_eval"):
            raise UsageError(f"hook_path must be auto, route or cb_eval, not {config.hook_path!r}")
        if config.run is not None and not config.experts_on_host:
            raise UsageError("the expert cache needs the experts in host memory (experts_on_host=True)")
        if config.run is not None and config.hook_path == "cb_eval":
            raise UsageError("the expert cache runs on the route op, not on cb_eval")
        if (config.run is not None or config.hook_path == "route") and not self.patched:
            _patched.symbols()  # raises EngineNotPatchedError with the fix in its message
        if config.run is not None and not config.gate_hook:
            raise UsageError("the expert cache needs the gate hook (gate_hook=True)")
        if not config.gate_hook:
            return None
        if config.hook_path == "cb_eval" or not self.patched:
            return "cb_eval"
        return "route"

    def _check_placement(self) -> tuple[str, ...]:
        """The expert tensors that sit in the host buffer type asked for; EngineError if any does not.

        Empty when the experts were not overridden or the placement is unknown (``expert_buffers`` None).
        """
        buft = self._model.expert_buft
        if buft is None or self.expert_buffers is None:
            return ()
        wanted = B.libggml_base.ggml_backend_buft_name(buft).decode()
        host = self.config.host_expert_layers
        checked = {n: b for n, b in self.expert_buffers.items()
                   if host is None or int(n.split(".")[1]) in host}  # "blk.{il}.ffn_*_exps.weight"
        # on disk the experts are llama.cpp's mapping of the file: the CPU buffer type's mapped buffers
        ok = {wanted, f"{wanted}_Mapped"} if self._model.override.on_disk else {wanted}
        misplaced = [n for n, b in checked.items() if b not in ok]
        if misplaced:
            raise EngineError(f"{len(misplaced)} expert tensors are not in {wanted} (e.g. {misplaced[0]} in "
                              f"{self.expert_buffers[misplaced[0]]})")
        return tuple(checked)

    @property
    def _runtime(self) -> CacheRuntime | None:
        """The cache runtime (slot tensors, copies, ``ExpertCache``), None without a cache."""
        return self.pipeline.runtime if self.pipeline is not None else None

    @property
    def prefetcher(self):
        """The cache's prefetcher (``ggmoe.control.prefetch.Prefetcher``), None when it does not prefetch."""
        return self.pipeline.prefetcher if self.pipeline is not None else None

    @property
    def _graph_predictor(self):
        """The mlp predictor's nets in the decode graph (``ggmoe.engine.graph_predictor``), or None."""
        return self.pipeline.graph_predictor if self.pipeline is not None else None

    @property
    def decode_mode(self) -> dict[str, object]:
        """The decode mode asked for, in effect and why (empty without a cache)."""
        return self.pipeline.describe() if self.pipeline is not None else {}

    def report(self) -> dict[str, object]:
        """The cache's record (``CachePipeline.report``: what ``--stats-json`` writes); empty without a cache."""
        return self.pipeline.report() if self.pipeline is not None else {}

    @property
    def cache_stats(self) -> CacheStats | None:
        """Hits, misses, bytes copied and waits per layer since load (None without a cache)."""
        return self._runtime.cache.stats if self._runtime is not None else None

    def reconfigure(self, run: RunConfig) -> None:
        """Replace the expert cache between decodes (``CachePipeline.reconfigure``: MoEpic's reconfiguration,
        other slot counts and top shares); the KV cache and the sequence stay. Needs a cache already."""
        if self.pipeline is None or self.pipeline.runtime is None:
            raise UsageError("reconfiguring needs an engine loaded with a cache")
        run.check_model(self.facts)  # a plan for another model fails before the old cache goes
        self.pipeline.reconfigure(run)
        self.config = dataclasses.replace(self.config, run=run)

    def record_hook_times(self, on: bool = True) -> None:
        """Start (or stop) recording the seconds of every route callback (one per layer call)."""
        if not isinstance(self._hook, RouteOpHook):
            raise UsageError("hook timings need the route op of the patched engine")
        self._hook.times = [] if on else None

    def set_routing_override(self, override: Callable[[int, int], list[int]] | None) -> None:
        """Benchmarks only: experts chosen by ``override(il, n_tokens)`` instead of the router's for the cache
        and the observers (tools/gpu's trace-replay routing); None restores the router's."""
        if self.pipeline is None:
            raise UsageError("a routing override needs the route op of the patched engine")
        self.pipeline.set_routing_override(override)

    @property
    def hook_times(self) -> np.ndarray:
        """Seconds per route callback since ``record_hook_times()`` [n_calls] float64."""
        times = self._hook.times if isinstance(self._hook, RouteOpHook) else None
        return np.asarray(times if times is not None else [], dtype=np.float64)

    @property
    def model_ptr(self) -> int:
        """The ``llama_model *`` (for the engine layer and its tests)."""
        return self._model.ptr

    @property
    def ctx_ptr(self) -> int:
        """The ``llama_context *`` (for the engine layer and its tests)."""
        return self._ctx.ctx

    @property
    def cache_slots(self) -> dict[int, int] | None:
        return self._runtime.cache.n_slots if self._runtime is not None else None

    @property
    def miss_policy(self) -> tuple[str, str | None] | None:
        """(the miss policy the cache runs, why ``auto`` became ``wait`` or None); None without a cache."""
        if self._runtime is None:
            return None
        return self._runtime.miss_policy, self._runtime.miss_policy_note

    # -- lifecycle
    def close(self) -> None:
        # The pipeline leaves the context first (prefetch worker, callback, tables, predictor); the context
        # goes before the slot tensors it computes with, and the model last. One ExitStack, registered last to
        # first: each step runs even when an earlier one raises.
        pipeline = self.__dict__.get("pipeline")
        with contextlib.ExitStack() as stack:
            for part in ("_model", "pipeline", "_ctx", "_batch"):
                obj = getattr(self, part, None)
                if obj is not None:
                    setattr(self, part, None)
                    stack.callback(obj.close)
            if getattr(self, "observers", None) is not None:
                stack.callback(setattr, self.observers, "on_change", None)  # nothing to tell a freed context
            if pipeline is not None:
                stack.callback(pipeline.detach)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- observers
    def add_observer(self, obs: RouteObserver) -> None:
        """Receive every MoE layer's routing from now on (beside the other observers)."""
        if self._hook is None:
            raise UsageError("this engine was created with gate_hook=False")
        self.observers.add(obs)

    def remove_observer(self, obs: RouteObserver) -> None:
        self.observers.remove(obs)

    @contextlib.contextmanager
    def observing(self, obs: RouteObserver) -> Iterator[RouteObserver]:
        """``with engine.observing(recorder):`` attaches ``obs`` for the block only."""
        self.add_observer(obs)
        try:
            yield obs
        finally:
            self.remove_observer(obs)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp loaded it (e.g. ``qwen3moe.expert_count``)."""
        return self._model.model.metadata().get(key)

    # -- text
    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:  # a surrogate-escaped argument that was not UTF-8
            raise UsageError(f"the text is not valid UTF-8 ({e.reason} at position {e.start})") from None
        return list(self._model.model.tokenize(data, add_bos, False))

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (a UTF-8 character may span several tokens)."""
        vocab = self._model.model.vocab
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._model.model.vocab, token))

    # -- compute
    def reset(self) -> None:
        """Forget the sequence (clear the KV cache)."""
        self._ctx.kv_cache_clear()
        self.n_past = 0

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence; return logits [n_tokens or 1, n_vocab] float32.

        Runs in chunks of ``n_batch`` tokens; the gate hook fires per micro-batch and MoE layer.
        Ctrl-C during a chunk is held until llama.cpp returns, then raised as KeyboardInterrupt.
        """
        if len(tokens) == 0:
            raise UsageError("nothing to decode")
        if self.n_past + len(tokens) > self.n_ctx:
            raise UsageError(f"context full: {self.n_past} + {len(tokens)} tokens > n_ctx {self.n_ctx}")
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} out of range [0, {self.n_vocab})")
        out = []
        for i in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[i : i + self.n_batch])
            if self.pipeline is not None:  # the one decode step: the pipeline around llama_decode
                with self.pipeline.step(chunk):
                    self._decode_chunk(chunk, all_logits)
            else:
                try:
                    self._decode_chunk(chunk, all_logits)
                finally:
                    self._raise_hook_error()
            self.n_past += len(chunk)
            if all_logits or i + self.n_batch >= len(tokens):
                out.append(self._logits(len(chunk) if all_logits else 1))
        return np.concatenate(out, axis=0) if all_logits else out[-1]

    def _decode_chunk(self, chunk: list[int], all_logits: bool) -> None:
        """One ``llama_decode`` of ``chunk`` after the sequence; llama.cpp's refusal as an ``EngineError`` with
        what it logged. Ctrl-C is held until llama.cpp returns."""
        self._batch.set_batch(chunk, self.n_past, all_logits)
        mark = llama_log().count
        _sigint.enter()
        try:
            self._ctx.decode(self._batch)
        except RuntimeError as e:  # llama_decode returned nonzero
            raise EngineError(f"{e}: {llama_log().error_since(mark) or 'no reason logged'}") from None
        finally:
            _sigint.exit()

    def _raise_hook_error(self) -> None:
        """Without a pipeline: re-raise what the cb_eval hook's observers stored (they never raise into C)."""
        err = self._hook.take_error(self._ctx.ctx) if self._hook is not None else None
        if err is not None:
            raise err

    def _logits(self, n_rows: int) -> np.ndarray:
        ptr = self._ctx.get_logits()
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
        self.stopped_on_ctx = False
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
                if self.n_past >= self.n_ctx:  # the KV cache is full: stop here instead of failing
                    self.stopped_on_ctx = True
                    return
                t0 = time.perf_counter()
                self.decode([tok])
                dt = time.perf_counter() - t0
                if on_step:
                    on_step([tok], self.n_past - 1, False)
        finally:
            sampler.close()

    def generate(self, prompt: str, max_tokens: int, temp: float = 0.0, seed: int = 0,
                 all_logits: bool = False, on_step: StepCallback | None = None,
                 on_text: Callable[[str], None] | None = None) -> Generation:
        """Generate from ``prompt``; ``on_text`` receives the text as it is produced (whole characters)."""
        if max_tokens < 1:
            raise UsageError("max_tokens must be at least 1")
        self.reset()
        prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise UsageError("the prompt is empty after tokenization")
        out: list[int] = []
        prefill_s, decode_s, eog = 0.0, 0.0, False
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
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
            if on_text is not None:
                piece = text.decode(self.token_bytes(tok))
                if piece:
                    on_text(piece)
        if on_text is not None:
            rest = text.decode(b"", final=True)
            if rest:
                on_text(rest)
        n_dec = max(len(out) - 1 + int(eog), 0)  # decode steps actually run after the prefill
        return Generation(
            text=self.detokenize(out),
            prompt_ids=tuple(prompt_ids),
            token_ids=tuple(out),
            stopped_on_eog=eog,
            timings=Timings(len(prompt_ids), prefill_s, n_dec, decode_s),
            stopped_on_ctx=self.stopped_on_ctx,
        )
