"""The host path of the patch (0004) through its raw ctypes layer, on the CPU-only build.

A route callback may answer ``LLAMA_GGMOE_SLOT_HOST`` (-1) for a selected expert:
the device part then reads, for that entry, the layer's zero slot (a token's first
host entry) or another slot the token does not read (CUDA's ``mul_mat_id`` counts a
slot once per token), and its down product is masked to zero; a host-side
``mul_mat_id`` over the model's expert tensors computes exactly those entries
(ids -1, written as zeros, elsewhere); the two parts are added per entry before
the routing weights. x + 0 = x, so for any mix of slot and host answers the
logits must equal the stock path's bit for bit. The CPU build aborts on a slot
repeated within a token, as a GPU would, so every case here also checks that.
Controls show that the mask, not the zero slot's zeros, makes a host entry's
device row zero, and that host answers are refused where the host path is off.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_patch_lowlevel import (
    DECODE,
    PROMPT,
    LayerCache,
    _array,
    assert_same_logits,
    moe_layers,
    run_sequence,
)

from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from tools.fixtures.make_fixtures import ARCHES, fixture_path

SLOT_HOST = _patched.LLAMA_GGMOE_SLOT_HOST


def _zero_slot(cache: LayerCache, slot: int, fill: int = 0) -> None:
    """Fill `slot` of every kind of the layer's cache with the byte `fill` (0: the zero slot)."""
    for k, t in cache.exps.items():
        if t is None:
            continue
        nbytes = t.contents.nb[2]
        raw = np.full(nbytes, fill, dtype=np.uint8)
        B.libggml_base.ggml_backend_tensor_set(cache.cache[k], raw.ctypes.data, slot * nbytes, nbytes)
    old = cache.expert_in[slot]
    if old >= 0:
        cache.slot_of[old] = -1
    cache.expert_in[slot] = -1


class HostRouter:
    """Answers each selected expert with its slot, loading it first, or with the host path, at random.

    ``p_host`` is the share of misses served by the host (1.0: never load); ``host_hits`` also sends some
    resident experts to the host (a miss policy may decide so when a copy is still in flight).
    """

    def __init__(self, P, caches: dict[int, LayerCache], zero: dict[int, int], p_host: float, seed: int,
                 host_hits: bool = False) -> None:
        self.caches, self.zero = caches, zero
        self.p_host, self.host_hits = p_host, host_hits
        self.rng = np.random.default_rng(seed)
        self.n_host = self.n_slot = 0  # answers given
        self.error: BaseException | None = None
        self.c_cb = P.route_cb(self._cb)

    def _slot_for(self, cache: LayerCache, e: int, in_use: set[int]) -> int:
        if cache.slot_of[e] >= 0:
            return int(cache.slot_of[e])
        free = [s for s in range(cache.n_slots) if s != self.zero[cache.il] and int(cache.expert_in[s]) not in in_use]
        slot = int(self.rng.choice(free))
        cache.load(e, slot)
        return slot

    def _cb(self, user_data, il, n_tokens, n_expert_used, n_expert, n_embd, ids_p, probs_p, inp_p, slots_p,
            scores_p=None, n_scores=0):
        try:
            if not slots_p:
                return 0
            cache = self.caches[il]
            ids = _array(ids_p, ctypes.c_int32, (n_tokens, n_expert_used))
            answer: dict[int, int] = {}  # one answer per distinct expert, as a cache gives
            in_use: set[int] = set()
            for e in np.unique(ids).tolist():
                resident = cache.slot_of[e] >= 0
                to_host = (self.rng.random() < self.p_host) if (not resident or self.host_hits) else False
                if to_host:
                    answer[e] = SLOT_HOST
                else:
                    answer[e] = self._slot_for(cache, e, in_use)
                    in_use.add(e)
            slots = _array(slots_p, ctypes.c_int32, (n_tokens, n_expert_used))
            slots[:] = np.vectorize(answer.__getitem__, otypes=[np.int32])(ids)
            self.n_host += int(np.sum(slots == SLOT_HOST))
            self.n_slot += int(np.sum(slots != SLOT_HOST))
            return 0
        except BaseException as e:  # noqa: BLE001 - must not unwind through C
            self.error = e
            return 1


class HostSession:
    """An engine whose MoE layers have a cache with a zero slot and the host path on."""

    def __init__(self, P, path, n_slots: int | None = None, n_ubatch: int = 2, fill_zero: int = 0,
                 host_path: bool = True) -> None:
        self.P = P
        self.eng = Engine(EngineConfig(path, n_ctx=128, n_batch=64, n_ubatch=n_ubatch, n_threads=2))
        self.caches: dict[int, LayerCache] = {}
        self.zero: dict[int, int] = {}
        self.n_slots = n_slots
        self.fill_zero = fill_zero
        self.host_path = host_path

    def attach(self, p_host: float, seed: int = 0, host_hits: bool = False) -> HostRouter:
        ctx = self.eng.ctx_ptr
        for il in moe_layers(self.P, self.eng):
            probe = LayerCache(self.P, self.eng.model_ptr, il, 1)
            n_expert = probe.n_expert
            probe.free()
            n = self.n_slots or n_expert // 2 + 1
            c = LayerCache(self.P, self.eng.model_ptr, il, n)
            self.caches[il] = c
            self.zero[il] = n - 1
            _zero_slot(c, n - 1, self.fill_zero)
            assert c.register(self.P, ctx) == _patched.LLAMA_GGMOE_OK
            if self.host_path:
                assert self.P.llama_ggmoe_set_host_path(ctx, il, n - 1) == _patched.LLAMA_GGMOE_OK
        self.router = HostRouter(self.P, self.caches, self.zero, p_host, seed, host_hits)
        self.P.llama_ggmoe_set_route_cb(ctx, self.router.c_cb, None)
        return self.router

    def close(self) -> None:
        self.eng.close()
        for c in self.caches.values():
            c.free()


@pytest.fixture
def P():
    return _patched.symbols()


@pytest.fixture
def host_session(P):
    opened: list[HostSession] = []

    def open_(*args, **kwargs) -> HostSession:
        s = HostSession(P, *args, **kwargs)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()


CASES = [  # (share of misses computed on the host, resident experts sometimes sent to the host too)
    (0.5, False),
    (1.0, False),
    (0.5, True),
]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("p_host,host_hits", CASES)
def test_any_mix_of_slot_and_host_answers_gives_identical_logits(arch, p_host, host_hits, host_session):
    s = host_session(fixture_path(arch))
    ref = run_sequence(s.eng)
    router = s.attach(p_host, seed=5, host_hits=host_hits)
    got = run_sequence(s.eng)
    assert router.error is None, router.error
    assert s.P.llama_ggmoe_get_error(s.eng.ctx_ptr) == 0
    assert_same_logits(ref, got)
    assert router.n_host > 0  # the host path really ran
    if p_host < 1.0:
        assert router.n_slot > 0


def test_all_on_the_host_with_a_quantized_model(host_session):
    s = host_session(fixture_path("qwen3moe", expert_type="q8_0"))
    ref = run_sequence(s.eng)
    router = s.attach(p_host=1.0, seed=1, host_hits=True)
    assert_same_logits(ref, run_sequence(s.eng))
    assert router.error is None and router.n_slot == 0 and router.n_host > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "gptoss"])
def test_the_device_rows_of_host_entries_are_masked(arch, host_session):
    """A zero slot that is not zero, and free slots that are not either, leave the logits stock: every host
    entry's device product is masked (each token has several host entries here, so most read slots other
    than the zero slot). gpt-oss: the down bias, added after the mask, comes in once."""
    s = host_session(fixture_path(arch), fill_zero=0x3C)  # 0x3C3C as f16 is 1.06
    ref = run_sequence(s.eng)
    router = s.attach(p_host=1.0, seed=2)
    for c in s.caches.values():
        for slot in range(c.n_slots - 1):
            _zero_slot(c, slot, 0x3C)
    got = run_sequence(s.eng)
    assert router.error is None, router.error
    assert router.n_host > 0 and router.n_slot == 0
    assert_same_logits(ref, got)


def test_host_answers_are_refused_where_the_host_path_is_off(host_session):
    s = host_session(fixture_path("qwen3moe"), host_path=False)
    s.attach(p_host=1.0, seed=3)
    s.eng.reset()
    with pytest.raises(Exception, match="SLOT"):
        s.eng.decode(DECODE[:1], all_logits=True)


def test_micro_batches_above_the_host_limit_keep_slots_only(host_session):
    """A micro-batch of more than LLAMA_GGMOE_HOST_MAX_TOKENS tokens gets no host plane: host answers fail."""
    n = _patched.LLAMA_GGMOE_HOST_MAX_TOKENS
    assert len(PROMPT) > n
    s = host_session(fixture_path("qwen3moe"), n_slots=9, n_ubatch=64)  # 8 experts + the zero slot
    s.attach(p_host=1.0, seed=4)
    s.eng.reset()
    with pytest.raises(Exception, match="SLOT"):
        s.eng.decode(PROMPT, all_logits=True)


def test_set_host_path_checks_its_arguments(P, host_session):
    s = host_session(fixture_path("deepseek2"))
    ctx = s.eng.ctx_ptr
    E = _patched
    assert P.llama_ggmoe_set_host_path(ctx, 1, 0) == E.LLAMA_GGMOE_ERR_HOST  # no cache on the layer yet
    s.attach(p_host=0.5)
    n = s.caches[1].n_slots
    assert P.llama_ggmoe_set_host_path(ctx, 1, n - 1) == E.LLAMA_GGMOE_OK
    assert P.llama_ggmoe_set_host_path(ctx, 1, -1) == E.LLAMA_GGMOE_OK  # off
    assert P.llama_ggmoe_set_host_path(ctx, 1, n) == E.LLAMA_GGMOE_ERR_SLOT
    assert P.llama_ggmoe_set_host_path(ctx, 1, -2) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_host_path(ctx, 0, 0) == E.LLAMA_GGMOE_ERR_NOT_MOE  # deepseek2's dense lead layer
    assert P.llama_ggmoe_set_host_path(ctx, s.eng.n_layer, 0) == E.LLAMA_GGMOE_ERR_LAYER
    assert P.llama_ggmoe_set_host_path(None, 1, 0) == E.LLAMA_GGMOE_ERR_ARG


ORDERS = [  # (worker order, the counter that shows it)
    (1, "after_device"),  # the worker starts a layer's host part only once its device part has finished
    (2, "before_device"),  # the device part starts only once the host part has finished
]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("order,counter", ORDERS)
@pytest.mark.parametrize("spin_us", [0, 250])  # the hand-off sleeps at once, or spins first (patch 0018)
def test_the_host_part_on_its_own_threads_gives_identical_logits_in_either_order(arch, order, counter, spin_us,
                                                                                  host_session):
    """Patch 0015: the host part as a job of a worker thread, beside the device part of the same layer. Both
    forced interleavings give stock's logits, and every job ran in the forced one: the two parts share no
    state but the join. Half the misses go to the host, so each layer has device and host entries. With a spin
    the waiting side (the worker for its job, the join for the job) reads the state without the lock first:
    the same logits and the same order."""
    from ggmoe.engine.host_part import host_part_stats

    s = host_session(fixture_path(arch))
    ref = run_sequence(s.eng)
    router = s.attach(p_host=0.5, seed=7, host_hits=True)
    assert s.P.llama_ggmoe_set_host_spin(s.eng.ctx_ptr, spin_us) == _patched.LLAMA_GGMOE_OK
    assert s.P.llama_ggmoe_set_host_threads(s.eng.ctx_ptr, 2, order) == _patched.LLAMA_GGMOE_OK
    got = run_sequence(s.eng)
    assert router.error is None, router.error
    assert s.P.llama_ggmoe_get_error(s.eng.ctx_ptr) == 0
    assert_same_logits(ref, got)
    stats = host_part_stats(s.eng.ctx_ptr)
    assert stats.jobs > 0 and router.n_slot > 0
    assert getattr(stats, counter) == stats.jobs


def test_a_worker_with_nothing_for_the_cpu_hands_over_nothing(host_session):
    """Every expert answered with a slot: each layer's micro-batch is skipped, no job runs."""
    from ggmoe.engine.host_part import host_part_stats

    s = host_session(fixture_path("qwen2moe"))
    ref = run_sequence(s.eng)
    router = s.attach(p_host=0.0, seed=8)
    assert s.P.llama_ggmoe_set_host_threads(s.eng.ctx_ptr, 2, 0) == _patched.LLAMA_GGMOE_OK
    assert_same_logits(ref, run_sequence(s.eng))
    stats = host_part_stats(s.eng.ctx_ptr)
    assert router.n_host == 0 and stats.jobs == 0 and stats.skipped > 0


def test_set_host_threads_checks_its_arguments(P, host_session):
    s = host_session(fixture_path("qwen3moe"))
    ctx = s.eng.ctx_ptr
    E = _patched
    assert P.llama_ggmoe_set_host_threads(ctx, -1, 0) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_host_threads(ctx, 2, 3) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_host_threads(None, 2, 0) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_host_threads(ctx, 2, 0) == E.LLAMA_GGMOE_OK
    assert P.llama_ggmoe_set_host_threads(ctx, 0, 0) == E.LLAMA_GGMOE_OK  # stopped again
    for bad in (-1, 100_001):
        assert P.llama_ggmoe_set_host_spin(ctx, bad) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_host_spin(None, 0) == E.LLAMA_GGMOE_ERR_ARG
    assert P.llama_ggmoe_set_host_spin(ctx, 250) == E.LLAMA_GGMOE_OK  # no worker yet: kept for the next one
    assert P.llama_ggmoe_set_host_threads(ctx, 2, 0) == E.LLAMA_GGMOE_OK
    assert P.llama_ggmoe_set_host_spin(ctx, 0) == E.LLAMA_GGMOE_OK  # the running worker's, from its next wait
    assert P.llama_ggmoe_set_host_threads(ctx, 0, 0) == E.LLAMA_GGMOE_OK
