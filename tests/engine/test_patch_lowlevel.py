"""The llama.cpp patch through its raw ctypes layer (``ggmoe.engine.patch``), on the CPU-only build.

For every fixture architecture: per-layer cache tensors hold copies of the
experts in a random permutation of slots (all experts, or fewer slots than
experts with on-demand loads from inside the route callback), the callback
maps ids to slots, and the logits must equal the stock path's exactly. Also:
the observe-only fallback when a micro-batch needs more experts than there are
slots, a graph rebuild when the cache configuration changes between decode
steps, the route op's view of ids/probs/input against the engine's own gate
hook, argument checks of ``llama_ggmoe_set_layer_cache``, callback errors, and
the "engine not patched" error.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ggmoe.base.errors import EngineNotPatchedError
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.ggml import llama_cpp
from tools.fixtures.make_fixtures import ARCH_SPECS, ARCHES, SHAPE, fixture_path, rewrite_gguf

# Expert tensor kinds, in llama_ggmoe_set_layer_cache's argument order.
KINDS = ("up", "gate", "down", "gate_up")

_rng = np.random.default_rng(1234)
PROMPT = [int(t) for t in _rng.integers(3, 250, size=20)]  # prefill tokens
DECODE = [int(t) for t in _rng.integers(3, 250, size=4)]  # one decode step each


@pytest.fixture(scope="module")
def P() -> _patched.PatchedLib:
    return _patched.symbols()


# --------------------------------------------------------------------------- helpers

def _array(ptr: int, ctype: type, shape: tuple[int, int]) -> np.ndarray:
    """A numpy view of a C array (no copy): valid only while C keeps it alive."""
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctype)), shape=shape)


def _tensor(P: _patched.PatchedLib, model_ptr: int, name: str):
    addr = P.llama_ggmoe_model_get_tensor(model_ptr, name.encode())
    return ctypes.cast(addr, B.ggml_tensor_p) if addr else None


class LayerCache:
    """Cache tensors [ne0, ne1, n_slots] of one MoE layer in a CPU buffer, plus its slot table."""

    def __init__(self, P: _patched.PatchedLib, model_ptr: int, il: int, n_slots: int) -> None:
        self.il = il
        self.n_slots = n_slots
        self.exps = {k: _tensor(P, model_ptr, f"blk.{il}.ffn_{k}_exps.weight") for k in KINDS}
        self.n_expert = int(self.exps["down"].contents.ne[2])
        params = B.ggml_init_params(mem_size=len(KINDS) * B.libggml_base.ggml_tensor_overhead(),
                                    mem_buffer=None, no_alloc=True)
        self._ctx = B.libggml_base.ggml_init(params)
        self.cache: dict[str, object] = {}
        for k, t in self.exps.items():
            if t is None:
                continue
            c = t.contents
            self.cache[k] = B.libggml_base.ggml_new_tensor_3d(self._ctx, c.type, c.ne[0], c.ne[1], n_slots)
        self._buf = B.libggml_base.ggml_backend_alloc_ctx_tensors_from_buft(
            self._ctx, B.libggml_cpu.ggml_backend_cpu_buffer_type())
        assert self._buf, "cache buffer allocation failed"
        B.libggml_base.ggml_backend_buffer_clear(self._buf, 0)  # as SlotTensors: an empty slot reads zeros
        self.slot_of = np.full(self.n_expert, -1, dtype=np.int32)  # [n_expert] slot holding the expert, -1: none
        self.expert_in = np.full(n_slots, -1, dtype=np.int32)  # [n_slots] expert in the slot, -1: empty
        self.loads = 0  # experts copied in

    def load(self, expert: int, slot: int) -> None:
        """Copy every kind of `expert` from the model's host tensors into `slot`."""
        for k, t in self.exps.items():
            if t is None:
                continue
            nbytes = t.contents.nb[2]  # bytes per expert
            raw = np.empty(nbytes, dtype=np.uint8)
            B.libggml_base.ggml_backend_tensor_get(t, raw.ctypes.data, expert * nbytes, nbytes)
            B.libggml_base.ggml_backend_tensor_set(self.cache[k], raw.ctypes.data, slot * nbytes, nbytes)
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot
        self.loads += 1

    def ensure(self, needed: np.ndarray, rng: np.random.Generator) -> None:
        """Make every expert in `needed` resident, evicting random slots that hold none of them."""
        missing = [int(e) for e in needed if self.slot_of[e] < 0]
        if not missing:
            return
        keep = set(int(e) for e in needed)
        free = [s for s in range(self.n_slots) if int(self.expert_in[s]) not in keep]
        assert len(free) >= len(missing), "the patch ran a micro-batch on a cache too small for it"
        for e, s in zip(missing, rng.permutation(free)[: len(missing)], strict=True):
            self.load(e, int(s))

    def register(self, P: _patched.PatchedLib, ctx_ptr: int) -> int:
        return P.llama_ggmoe_set_layer_cache(ctx_ptr, self.il, self.n_slots,
                                             *(self.cache.get(k) for k in KINDS))

    def free(self) -> None:
        B.libggml_base.ggml_backend_buffer_free(self._buf)
        B.libggml_base.ggml_free(self._ctx)


class SlotRouter:
    """The route callback: ids -> cache slots (loading missing experts first), and a log of calls."""

    def __init__(self, P: _patched.PatchedLib, caches: dict[int, LayerCache], seed: int = 0) -> None:
        self.caches = caches
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[int, int, bool]] = []  # (il, n_tokens, slots requested)
        self.seen: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # (il, ids, probs, inp) copies
        self.capture = False
        self.result = 0  # what the callback returns
        self.bad_slot: str | None = None  # "range": an out-of-range slot; "repeat": one slot twice in a token
        self.error: BaseException | None = None
        self.c_cb = P.route_cb(self._cb)  # kept alive as long as the router

    def _cb(self, user_data, il, n_tokens, n_expert_used, n_expert, n_embd, ids_p, probs_p, inp_p, slots_p,
            scores_p=None, n_scores=0):
        try:
            self.calls.append((il, n_tokens, bool(slots_p)))
            ids = _array(ids_p, ctypes.c_int32, (n_tokens, n_expert_used))
            if self.capture:
                self.seen.append((il, ids.copy(), _array(probs_p, ctypes.c_float, (n_tokens, n_expert)).copy(),
                                  _array(inp_p, ctypes.c_float, (n_tokens, n_embd)).copy()))
            if slots_p:
                cache = self.caches[il]
                cache.ensure(np.unique(ids), self.rng)
                slots = _array(slots_p, ctypes.c_int32, (n_tokens, n_expert_used))
                slots[:] = cache.slot_of[ids]
                if self.bad_slot == "range":
                    slots[0, 0] = cache.n_slots
                elif self.bad_slot == "repeat":
                    slots[0, 1] = slots[0, 0]
            return self.result
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return 1


def moe_layers(P: _patched.PatchedLib, eng: Engine) -> list[int]:
    return [il for il in range(eng.n_layer) if _tensor(P, eng.model_ptr, f"blk.{il}.ffn_down_exps.weight")]


def make_caches(P: _patched.PatchedLib, eng: Engine, n_slots: int, seed: int) -> dict[int, LayerCache]:
    """A cache per MoE layer, filled with random experts in a random permutation of slots."""
    rng = np.random.default_rng(seed)
    caches = {}
    for il in moe_layers(P, eng):
        c = LayerCache(P, eng.model_ptr, il, n_slots)
        experts = rng.permutation(c.n_expert)[:n_slots]
        for slot, e in zip(rng.permutation(n_slots), experts, strict=True):
            c.load(int(e), int(slot))
        caches[il] = c
    return caches


def run_sequence(eng: Engine, before_step: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Prefill PROMPT (all logits) then decode DECODE one token at a time; logits of every step."""
    eng.reset()
    out = []
    for i, tokens in enumerate([PROMPT] + [[t] for t in DECODE]):
        if before_step is not None:
            before_step(i)
        out.append(eng.decode(tokens, all_logits=True))
    return out


def assert_same_logits(ref: list[np.ndarray], got: list[np.ndarray]) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.shape == b.shape
        assert np.array_equal(a, b), f"step {i}: max |diff| {np.abs(a - b).max()}"


def merged_gate_up_copy(src: Path, dst: Path) -> Path:
    """Copy of a GGUF model whose ffn_gate_exps and ffn_up_exps are merged into ffn_gate_up_exps."""

    def merged(tensors: dict):
        for name, t in tensors.items():
            if ".ffn_up_exps." in name:
                continue
            data = np.asarray(t.data)
            if ".ffn_gate_exps." in name:
                up = np.asarray(tensors[name.replace("ffn_gate_exps", "ffn_up_exps")].data)
                # numpy [n_expert, n_ff, n_embd]: gate rows first, then up (llama.cpp splits gate_up that way)
                data = np.concatenate([data, up], axis=1)
                name = name.replace("ffn_gate_exps", "ffn_gate_up_exps")
            yield name, data, t.tensor_type

    return rewrite_gguf(src, dst, tensors=merged)


@pytest.fixture(scope="module")
def merged_deepseek2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return merged_gate_up_copy(fixture_path("deepseek2"), tmp_path_factory.mktemp("merged") / "ds2-gate-up.gguf")


def _model_path(variant: str, merged: Path) -> Path:
    if variant == "deepseek2-gate_up":
        return merged
    arch, _, expert_type = variant.partition(":")
    return fixture_path(arch, expert_type=expert_type or "f16")


VARIANTS = [*ARCHES, "qwen3moe:q8_0", "mixtral:f32", "deepseek2-gate_up"]


class Session:
    """An engine with caches and a router; frees caches only after the context is gone."""

    def __init__(self, P: _patched.PatchedLib, path: Path, n_ubatch: int = 64) -> None:
        self.P = P
        self.eng = Engine(EngineConfig(path, n_ctx=128, n_batch=64, n_ubatch=n_ubatch, n_threads=2))
        self.caches: dict[int, LayerCache] = {}
        self.router: SlotRouter | None = None

    def attach(self, n_slots: int, seed: int = 0) -> SlotRouter:
        self.caches = make_caches(self.P, self.eng, n_slots, seed)
        for c in self.caches.values():
            assert c.register(self.P, self.eng.ctx_ptr) == _patched.LLAMA_GGMOE_OK
        self.router = SlotRouter(self.P, self.caches, seed)
        self.P.llama_ggmoe_set_route_cb(self.eng.ctx_ptr, self.router.c_cb, None)
        return self.router

    def check_clean(self) -> None:
        assert self.router is None or self.router.error is None, self.router.error
        assert self.P.llama_ggmoe_get_error(self.eng.ctx_ptr) == 0

    def close(self) -> None:
        self.eng.close()
        for c in self.caches.values():
            c.free()


@pytest.fixture
def session(P: _patched.PatchedLib) -> Iterator[Callable[..., Session]]:
    opened: list[Session] = []

    def open_(path: Path, n_ubatch: int = 64) -> Session:
        s = Session(P, path, n_ubatch)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()


# --------------------------------------------------------------------------- logits equal the stock path

@pytest.mark.parametrize("variant", VARIANTS)
def test_all_experts_cached_gives_identical_logits(variant, session, merged_deepseek2):
    s = session(_model_path(variant, merged_deepseek2))
    ref = run_sequence(s.eng)
    n_expert = int(s.eng.meta(f"{s.eng.meta('general.architecture')}.expert_count"))
    router = s.attach(n_slots=n_expert, seed=7)
    got = run_sequence(s.eng)
    s.check_clean()
    assert_same_logits(ref, got)
    # min(20 tokens * k, n_expert) <= n_slots: even the prefill ran on the cache
    assert router.calls and all(with_slots for _, _, with_slots in router.calls)
    assert {il for il, _, _ in router.calls} == set(s.caches)
    assert sum(c.loads for c in s.caches.values()) == n_expert * len(s.caches)  # the initial fill only


@pytest.mark.parametrize("variant", VARIANTS)
def test_fewer_slots_than_experts_gives_identical_logits(variant, session, merged_deepseek2):
    """Prefill falls back to the host experts (observe only); decode steps load experts on demand."""
    s = session(_model_path(variant, merged_deepseek2))
    ref = run_sequence(s.eng)
    n_expert = int(s.eng.meta(f"{s.eng.meta('general.architecture')}.expert_count"))
    n_slots = n_expert // 2
    router = s.attach(n_slots=n_slots, seed=3)
    got = run_sequence(s.eng)
    s.check_clean()
    assert_same_logits(ref, got)
    prefill = [c for c in router.calls if c[1] == len(PROMPT)]
    decode = [c for c in router.calls if c[1] == 1]
    assert len(prefill) == len(s.caches) and not any(w for _, _, w in prefill)  # 20*k > n_slots: native path
    assert len(decode) == len(s.caches) * len(DECODE) and all(w for _, _, w in decode)
    assert sum(c.loads for c in s.caches.values()) > n_slots * len(s.caches)  # some on-demand loads happened


def test_the_expert_matmuls_really_read_the_cache(P, session):
    """Control: with slots pointing at the wrong experts the logits change, so equality above is not vacuous."""
    s = session(fixture_path("qwen3moe"))
    ref = run_sequence(s.eng)
    s.attach(n_slots=8, seed=2)
    for c in s.caches.values():  # swap the contents of slots 0 and 1 behind the router's back
        e0, e1 = int(c.expert_in[0]), int(c.expert_in[1])
        c.load(e1, 0)
        c.load(e0, 1)
        c.slot_of[e0], c.slot_of[e1] = 0, 1
    got = run_sequence(s.eng)
    s.check_clean()
    assert not np.array_equal(ref[0], got[0])


@pytest.mark.parametrize("arch", ARCHES)
def test_small_micro_batches_run_prefill_on_the_cache(arch, session):
    """With n_ubatch 2, min(2*k, n_expert) <= n_slots: every micro-batch uses the cache, loading as it goes."""
    s = session(fixture_path(arch), n_ubatch=2)
    ref = run_sequence(s.eng)
    router = s.attach(n_slots=4, seed=11)
    got = run_sequence(s.eng)
    s.check_clean()
    assert_same_logits(ref, got)
    assert all(w for _, _, w in router.calls)
    assert {n for _, n, _ in router.calls} == {1, 2}


def test_cache_config_change_rebuilds_the_graph(P, session):
    """Decode steps have the same shape, so a stale graph would be reused: the config generation prevents it."""
    s = session(fixture_path("qwen3moe"))
    ref = run_sequence(s.eng)
    router = s.attach(n_slots=8, seed=5)
    used_cache: list[bool] = []  # per step: did every layer run on its cache

    def before(step: int) -> None:
        if step == 2:  # drop every layer's cache: the route op turns observe-only
            for il in s.caches:
                assert P.llama_ggmoe_set_layer_cache(s.eng.ctx_ptr, il, 0, None, None, None, None) == 0
        if step == 4:  # and back
            for c in s.caches.values():
                assert c.register(P, s.eng.ctx_ptr) == 0
        if step > 0:
            used_cache.append(all(w for _, _, w in router.calls) and bool(router.calls))
        router.calls.clear()

    got = run_sequence(s.eng, before)
    used_cache.append(all(w for _, _, w in router.calls) and bool(router.calls))
    s.check_clean()
    assert_same_logits(ref, got)
    assert used_cache == [True, True, False, False, True]


def test_removing_the_callback_restores_the_stock_graph(P, session):
    s = session(fixture_path("mixtral"))
    ref = run_sequence(s.eng)
    router = s.attach(n_slots=8)
    run_sequence(s.eng)
    P.llama_ggmoe_set_route_cb(s.eng.ctx_ptr, P.route_cb(), None)  # route_cb(): NULL
    router.calls.clear()
    got = run_sequence(s.eng)
    assert not router.calls
    s.check_clean()
    assert_same_logits(ref, got)


# --------------------------------------------------------------------------- what the route op reports

class TensorTap:
    """A cb_eval callback that reads each MoE layer's ids, probs and router input from the stock graph.

    ``ffn_moe_topk-{il}`` is a strided view [n_expert_used, n_tokens] of the argsort; the router input is
    ``src[1]`` of ``ffn_moe_logits-{il}`` (``gate_inp @ cur``).
    """

    _NAME = re.compile(r"^ffn_moe_(topk|probs|logits)-(\d+)$")

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], np.ndarray] = {}
        self.error: BaseException | None = None
        self.c_cb = llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        try:
            t = ctypes.cast(t_ptr, B.ggml_tensor_p).contents
            m = self._NAME.match(t.name.decode())
            if m is None:
                return False
            if ask:
                return True
            kind, il = m.group(1), int(m.group(2))
            if kind == "logits":
                kind, t = "inp", t.src[1].contents
            dtype = np.int32 if kind == "topk" else np.float32
            self.seen[(kind, il)] = _read_2d(t, dtype)
            return True
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return True


def _read_2d(t: B.ggml_tensor, dtype: type) -> np.ndarray:
    """Dense copy [ne1, ne0] of a 2-D ggml tensor, honouring its byte strides nb[0], nb[1]."""
    tp = ctypes.pointer(t)
    raw = np.empty(B.libggml_base.ggml_nbytes(tp), dtype=np.uint8)
    B.libggml_base.ggml_backend_tensor_get(tp, raw.ctypes.data, 0, raw.nbytes)
    return np.ndarray(shape=(t.ne[1], t.ne[0]), dtype=dtype, buffer=raw, strides=(t.nb[1], t.nb[0])).copy()


def _raw_decode(ctx_ptr: int, tokens: list[int]) -> int:
    """llama_decode of one sequence's next tokens (positions follow the KV cache), bypassing the Engine."""
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    return llama_cpp.llama_decode(ctx_ptr, llama_cpp.llama_batch_get_one(arr, len(tokens)))


@pytest.mark.parametrize("arch", ARCHES)
def test_route_op_reports_what_the_stock_graph_computes(arch, P, session):
    """ids, probs and MoE input given to the callback equal the graph's own tensors, read through cb_eval."""
    s = session(fixture_path(arch))
    tap = TensorTap()
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads = 64, 64, 64, 2
    params.cb_eval, params.cb_eval_user_data = tap.c_cb, None
    ctx = llama_cpp.llama_init_from_model(s.eng.model_ptr, params)
    assert ctx
    try:
        router = SlotRouter(P, {})
        router.capture = True
        P.llama_ggmoe_set_route_cb(ctx, router.c_cb, None)  # no caches: observe only
        assert _raw_decode(ctx, PROMPT) == 0
        assert P.llama_ggmoe_get_error(ctx) == 0
    finally:
        llama_cpp.llama_free(ctx)
    assert tap.error is None and router.error is None
    moe = moe_layers(P, s.eng)
    assert sorted(il for il, *_ in router.seen) == moe
    for il, ids, probs, inp in router.seen:
        # the last layer runs only the output token (llama.cpp drops the others before its FFN), except in
        # gpt-oss, whose graph drops them only for masked next-token embeddings
        n_tokens = 1 if il == s.eng.n_layer - 1 and arch != "gptoss" else len(PROMPT)
        k = ARCH_SPECS[arch].n_expert_used or SHAPE.n_expert_used  # llama4 routes top-1
        assert ids.shape == (n_tokens, k) and probs.shape == (n_tokens, 8) and inp.shape == (n_tokens, 64)
        assert np.array_equal(ids, tap.seen[("topk", il)])
        assert np.array_equal(probs, tap.seen[("probs", il)])
        assert np.array_equal(inp, tap.seen[("inp", il)])


# --------------------------------------------------------------------------- argument checks and errors

def test_set_layer_cache_checks_its_arguments(P, session, merged_deepseek2):
    s = session(fixture_path("deepseek2"))
    ctx = s.eng.ctx_ptr
    good = LayerCache(P, s.eng.model_ptr, 1, 4)
    s.caches[1] = good  # freed after the context
    up, gate, down = (good.cache[k] for k in ("up", "gate", "down"))
    E = _patched
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, 4, up, gate, down, None) == E.LLAMA_GGMOE_OK
    assert P.llama_ggmoe_set_layer_cache(ctx, -1, 4, up, gate, down, None) == E.LLAMA_GGMOE_ERR_LAYER
    assert P.llama_ggmoe_set_layer_cache(ctx, s.eng.n_layer, 4, up, gate, down, None) == E.LLAMA_GGMOE_ERR_LAYER
    assert P.llama_ggmoe_set_layer_cache(ctx, 0, 4, up, gate, down, None) == E.LLAMA_GGMOE_ERR_NOT_MOE  # dense lead
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, -1, up, gate, down, None) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_layer_cache(None, 1, 4, up, gate, down, None) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, 4, up, gate, None, None) == E.LLAMA_GGMOE_ERR_TENSOR
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, 4, up, gate, down, down) == E.LLAMA_GGMOE_ERR_TENSOR
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, 3, up, gate, down, None) == E.LLAMA_GGMOE_ERR_SHAPE
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, 4, down, gate, up, None) == E.LLAMA_GGMOE_ERR_SHAPE  # ne0/ne1 swapped

    params = B.ggml_init_params(mem_size=4 * B.libggml_base.ggml_tensor_overhead(), mem_buffer=None, no_alloc=True)
    gctx = B.libggml_base.ggml_init(params)
    try:
        c = up.contents
        wrong_type = B.libggml_base.ggml_new_tensor_3d(gctx, B.GGML_TYPE_F32, c.ne[0], c.ne[1], 4)
        unallocated = B.libggml_base.ggml_new_tensor_3d(gctx, c.type, c.ne[0], c.ne[1], 4)
        assert P.llama_ggmoe_set_layer_cache(ctx, 1, 4, wrong_type, gate, down, None) == E.LLAMA_GGMOE_ERR_TYPE
        assert P.llama_ggmoe_set_layer_cache(ctx, 1, 4, unallocated, gate, down, None) == E.LLAMA_GGMOE_ERR_ALLOC
    finally:
        B.libggml_base.ggml_free(gctx)
    assert P.llama_ggmoe_set_layer_cache(ctx, 1, 0, None, None, None, None) == E.LLAMA_GGMOE_OK

    m = session(merged_deepseek2)
    merged = LayerCache(P, m.eng.model_ptr, 1, 4)
    m.caches[1] = merged
    assert set(merged.cache) == {"down", "gate_up"}
    assert merged.register(P, m.eng.ctx_ptr) == E.LLAMA_GGMOE_OK
    assert P.llama_ggmoe_set_layer_cache(m.eng.ctx_ptr, 1, 4, None, None, merged.cache["down"], None) == \
        E.LLAMA_GGMOE_ERR_TENSOR


def test_callback_errors_are_kept_and_cleared(P, session):
    s = session(fixture_path("qwen3moe"))
    ctx = s.eng.ctx_ptr
    router = s.attach(n_slots=8)
    s.eng.reset()
    router.result = 7
    assert _raw_decode(ctx, PROMPT) == 0
    assert P.llama_ggmoe_get_error(ctx) == 7
    assert P.llama_ggmoe_get_error(ctx) == 0  # read clears it

    router.result = 0
    # out of range: it would read outside the cache tensor; repeated within a token: CUDA's mul_mat_id counts
    # a slot once per token (it aborts or drops the row). The op refuses both and answers slots 0..n_expert_used-1
    for bad in ("range", "repeat"):
        router.bad_slot = bad
        assert _raw_decode(ctx, [DECODE[0]]) == 0
        assert P.llama_ggmoe_get_error(ctx) == _patched.LLAMA_GGMOE_ERR_SLOT, bad

    router.bad_slot = None
    run_sequence(s.eng)
    s.check_clean()


# --------------------------------------------------------------------------- the binding module

def test_unpatched_library_raises_engine_not_patched(P):
    unpatched = ctypes.CDLL(str(B.LIB_DIR / "libggml-base.so"))  # a real library without the symbols
    with pytest.raises(EngineNotPatchedError, match=r"not patched.*ggmoe engine build --install"):
        _patched.bind(unpatched)
    assert _patched.is_patched()
    assert set(_patched.SYMBOLS) == {
        "llama_ggmoe_model_get_tensor", "llama_ggmoe_set_route_cb", "llama_ggmoe_get_error",
        "llama_ggmoe_set_layer_cache", "llama_ggmoe_set_host_path", "llama_ggmoe_set_route_inputs",
        "llama_ggmoe_set_predictor", "llama_ggmoe_set_layer_table", "llama_ggmoe_set_table_mode",
        "llama_ggmoe_set_forced_routing", "llama_ggmoe_set_mailbox", "llama_ggmoe_set_layer_fill",
        "llama_ggmoe_set_layer_table_host", "llama_ggmoe_set_layer_identity",
        "llama_ggmoe_set_mmap_prefetch", "llama_ggmoe_set_host_threads", "llama_ggmoe_set_host_spin",
        "llama_ggmoe_get_host_stats",
        "llama_ggmoe_set_wait_cb",
    }


def test_mmap_prefetch_switch_returns_the_previous_setting(P):
    assert P.llama_ggmoe_set_mmap_prefetch(False) is True  # llama.cpp's default: read the file ahead
    try:
        assert P.llama_ggmoe_set_mmap_prefetch(False) is False
    finally:
        assert P.llama_ggmoe_set_mmap_prefetch(True) is False
