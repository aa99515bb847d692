"""The gate hook: one event builder, two strategies, a list of observers.

Engine layer (ctypes allowed). Both strategies turn one MoE layer's routing of
one micro-batch into a ``RouteEvent`` with ``build_event`` and hand it to every
observer of the engine's ``Observers``; they read probabilities and MoE inputs
only when some observer asked for them (``HookRequest``).

- ``RouteOpHook``: the patched route op's callback (``llama_ggmoe_route_cb``),
  which also maps ids to cache slots through ``ggmoe.cache.ExpertCache``;
- ``CbEvalHook``: llama.cpp's ``cb_eval`` scheduler callback on a stock build
  (observe only; a Python call for every graph node, so a fallback).

A callback never raises into C: the exception is stored in ``error`` and the
engine re-raises it after ``llama_decode`` returns.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable, Iterator

import numpy as np

from ggmoe.base.errors import EngineError
from ggmoe.base.hook import HookRequest, RouteEvent, RouteObserver
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.inspect.gating import Gating, true_probs

_NAME_OFFSET = B.ggml_tensor.name.offset  # bytes from a ggml_tensor * to its name
_HOOK_NAME = re.compile(rb"^ffn_moe_(topk|probs|logits)-(\d+)$")
_I32_ARRAYS: dict[int, type[ctypes.Array]] = {}  # n -> c_int32 * n, made once (``c_int32 * n`` costs a lookup per call)


def _i32_array(n: int) -> type[ctypes.Array]:
    """The ctypes type of ``n`` int32s (the route callback's ids and slots)."""
    t = _I32_ARRAYS.get(n)
    if t is None:
        t = _I32_ARRAYS[n] = ctypes.c_int32 * n
    return t


class Observers:
    """The engine's route observers, in the order they were added; ``request`` is the union of theirs."""

    def __init__(self) -> None:
        # a tuple rebuilt on change: the hooks read it once per layer call without copying
        self.items: tuple[RouteObserver, ...] = ()
        self.request = HookRequest(probs=False, hidden=False)
        # called with the new request when it changes (the route op then attaches only what is read)
        self.on_change: Callable[[HookRequest], None] | None = None

    def add(self, obs: RouteObserver) -> None:
        if any(o is obs for o in self.items):
            raise ValueError("this observer is already attached")
        self.items = (*self.items, obs)
        self._refresh()

    def remove(self, obs: RouteObserver) -> None:
        self.items = tuple(o for o in self.items if o is not obs)
        self._refresh()

    def refresh(self) -> None:
        """The union again, after an observer changed its ``request`` in place."""
        self._refresh()

    def _refresh(self) -> None:
        before = self.request
        self.request = HookRequest(probs=any(o.request.probs for o in self.items),
                                   hidden=any(o.request.hidden for o in self.items))
        if self.on_change is not None and self.request != before:
            self.on_change(self.request)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self) -> Iterator[RouteObserver]:
        return iter(self.items)

    def emit(self, event: RouteEvent) -> None:
        for obs in self.items:
            obs.on_route(event)


def build_event(il: int, ids: np.ndarray, request: HookRequest, probs: Callable[[], np.ndarray | None],
                hidden: Callable[[], np.ndarray | None], scores: np.ndarray | None = None,
                gating: Gating | None = None) -> RouteEvent:
    """The one event builder: ids [n_tokens, k] int32 (a copy), probs/hidden read only when asked for,
    the in-graph predictor's scores (a copy) when the layer has one. The graph's probs become the router's
    probabilities by the model's ``gating`` (gpt-oss's are its logits: converted, and kept as ``logits``)."""
    graph_probs = probs() if request.probs else None
    logits = None
    if graph_probs is not None and gating is not None:
        graph_probs, logits = true_probs(gating, graph_probs)
    return RouteEvent(il=il, ids=ids, probs=graph_probs, hidden=hidden() if request.hidden else None,
                      scores=scores, logits=logits)


def _view(ptr: int, ctype: type, shape: tuple[int, int]) -> np.ndarray:
    """A numpy view (no copy) of a dense C array."""
    n = shape[0] * shape[1]
    return np.ctypeslib.as_array((ctype * n).from_address(ptr)).reshape(shape)


class RouteOpHook:
    """The patched route op's callback: ids -> slots through the cache, events to the observers."""

    kind = "route"

    def __init__(self, observers: Observers | None = None, gating: Gating | None = None) -> None:
        self.observers = observers if observers is not None else Observers()
        self.gating = gating  # the model's: turns the graph's probs into probabilities (build_event)
        self.cache = None  # ggmoe.cache.ExpertCache, set when the engine has a cache
        self.error: BaseException | None = None
        self.times: list[float] | None = None  # seconds per callback, when benchmarking
        # Benchmarks only (tools/gpu, "trace-replay routing"): (il, n_tokens) -> the selected experts to
        # use instead of the router's, flat [n_tokens * n_expert_used]; the cache and the observers see
        # these. Never set by ggmoe itself.
        self.routing_override: Callable[[int, int], list[int]] | None = None
        # called after the cache answered a layer (the async decode's tables: a later micro-batch of the same
        # llama_decode may read through them, so slot changes go to the device now, while it is synchronized)
        self.after_route: Callable[[], None] | None = None
        self.c_callback = _patched.route_cb(self._route)  # kept alive as long as the context
        self.c_wait = _patched.wait_cb(self._wait)  # the wait hook, installed while the cache defers its waits
        # the op's recorded error code (reading clears it), the C function bound by install: the pipeline calls
        # it directly after every decode, and this hook's Python runs only when an error was recorded
        self.error_code: Callable[[int], int] | None = None

    def install(self, ctx_ptr: int) -> None:
        """The callback on every MoE layer of ``ctx_ptr``; the route op then takes the router probabilities and
        the MoE input only while an observer reads them (on a GPU each is a copy to the host per layer)."""
        P = _patched.symbols()
        P.llama_ggmoe_set_route_cb(ctx_ptr, self.c_callback, None)
        self.error_code = P.llama_ggmoe_get_error

        def inputs(request: HookRequest) -> None:
            P.llama_ggmoe_set_route_inputs(ctx_ptr, request.probs, request.hidden)

        self.observers.on_change = inputs
        inputs(self.observers.request)

    def uninstall(self, ctx_ptr: int) -> None:
        """Take the callbacks (route and wait) off the context (before it is freed)."""
        self.observers.on_change = None
        P = _patched.symbols()
        P.llama_ggmoe_set_route_cb(ctx_ptr, _patched.route_cb(), None)
        P.llama_ggmoe_set_wait_cb(ctx_ptr, _patched.wait_cb(), None)

    def install_wait(self, ctx_ptr: int, on: bool) -> None:
        """The wait hook on (the cache's calls with CPU entries wait for their copies there, while the CPU part
        runs) or off."""
        cb = self.c_wait if on else _patched.wait_cb()
        _patched.symbols().llama_ggmoe_set_wait_cb(ctx_ptr, cb, None)

    def _wait(self, user_data: int, il: int) -> int:
        try:
            cache = self.cache
            if cache is not None and self.error is None:
                cache.finish_wait(il)
            return 0
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return 1

    def take_error(self, ctx_ptr: int) -> BaseException | None:
        """The stored exception, else the op's own recorded error; both cleared."""
        return self.error_from(self.error_code(ctx_ptr) if self.error_code is not None else 0)

    def error_from(self, code: int) -> BaseException | None:
        """The stored exception (cleared), else the error of the op's ``code`` (0: none)."""
        err, self.error = self.error, None
        if err is None and code != 0:
            err = EngineError(f"the route op failed: {_patched.ERROR_NAMES.get(code, code)}")
        return err

    def _route(self, user_data: int, il: int, n_tokens: int, n_expert_used: int, n_expert: int, n_embd: int,
               ids_p: int, probs_p: int, inp_p: int, slots_p: int | None, scores_p: int | None = None,
               n_scores: int = 0) -> int:
        # Hot path: once per MoE layer per micro-batch. Plain ctypes arrays and lists; numpy only when an
        # observer is attached.
        t0 = time.perf_counter() if self.times is not None else 0.0
        try:
            if self.error is not None:
                return 1
            arr = _i32_array(n_tokens * n_expert_used)
            ids = arr.from_address(ids_p)  # dense [n_tokens][n_expert_used]
            if self.routing_override is not None:
                ids = arr(*self.routing_override(il, n_tokens))
            cache = self.cache
            if cache is not None and il in cache.tables:
                if slots_p:
                    arr.from_address(slots_p)[:] = cache.route_flat(il, ids[:])
                    if self.after_route is not None:
                        self.after_route()
                else:
                    cache.observe(il, ids[:])
            elif slots_p:
                raise EngineError(f"layer {il} asked for slots but has no cache")
            observers = self.observers
            if observers.items:
                ids_np = np.frombuffer(ids, dtype=np.int32).reshape(n_tokens, n_expert_used).copy()
                scores = _view(scores_p, ctypes.c_float, (n_tokens, n_scores)).copy() if scores_p else None
                # probs_p / inp_p are NULL when no observer read them at graph build (llama_ggmoe_set_route_inputs)
                observers.emit(build_event(
                    il, ids_np, observers.request,
                    lambda: _view(probs_p, ctypes.c_float, (n_tokens, n_expert)).copy() if probs_p else None,
                    lambda: _view(inp_p, ctypes.c_float, (n_tokens, n_embd)).copy() if inp_p else None, scores,
                    self.gating))
            if self.times is not None:
                self.times.append(time.perf_counter() - t0)
            return 0
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return 1


class CbEvalHook:
    """llama.cpp's ``cb_eval``: stops only at ``ffn_moe_topk-{il}`` and reads that layer's tensors there.

    At ask time it remembers ``ffn_moe_probs-{il}`` and ``ffn_moe_logits-{il}`` (whose ``src[1]`` is the MoE
    input): both are computed before the top-k and stay alive until the expert matmuls.
    """

    kind = "cb_eval"

    def __init__(self, observers: Observers | None = None, gating: Gating | None = None) -> None:
        self.observers = observers if observers is not None else Observers()
        self.gating = gating  # the model's (build_event)
        self.error: BaseException | None = None
        self._probs: dict[int, int] = {}  # il -> address of ffn_moe_probs-{il}
        self._logits: dict[int, int] = {}  # il -> address of ffn_moe_logits-{il}
        self.c_callback = B.llama_cpp.ggml_backend_sched_eval_callback(self)  # kept alive with the context

    error_code = None  # no op: nothing recorded in C

    def take_error(self, ctx_ptr: int) -> BaseException | None:
        return self.error_from(0)

    def error_from(self, code: int) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def __call__(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        # Called for every graph node with ask=True: keep that path to a name read and a prefix test
        # (about 1 us); only the three ffn_moe_* names of a layer go further.
        try:
            if not self.observers.items or self.error is not None:
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
            topk = ctypes.cast(t_ptr, B.ggml_tensor_p).contents
            self.observers.emit(self._event(topk, il))
            return True
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return True

    def _event(self, topk: B.ggml_tensor, il: int) -> RouteEvent:
        n_used, n_tokens = topk.ne[0], topk.ne[1]
        probs_at, logits_at = self._probs.pop(il, None), self._logits.pop(il, None)

        def probs() -> np.ndarray | None:
            if probs_at is None:
                return None
            p = ctypes.cast(probs_at, B.ggml_tensor_p).contents
            return _read_2d(p, np.float32, n_tokens, p.ne[0])

        def hidden() -> np.ndarray | None:
            if logits_at is None:
                return None
            inp = ctypes.cast(logits_at, B.ggml_tensor_p).contents.src[1].contents
            return _read_2d(inp, np.float32, n_tokens, inp.ne[0])

        return build_event(il, _read_2d(topk, np.int32, n_tokens, n_used), self.observers.request, probs, hidden,
                           gating=self.gating)


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
