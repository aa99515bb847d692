"""The expert cache on the CPU build: logits equal the stock path's, stats equal a replay."""

from __future__ import annotations

import ctypes
import json
import random

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.base.errors import EngineNotPatchedError, UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.policies import POLICIES, Policy
from ggmoe.cli import main
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.inspect import inspect_model
from ggmoe.simulate import replay
from ggmoe.trace import load_trace

TEXTS = ("The quick brown fox jumps over the lazy dog again and again",
         "def add(a, b):\n    return a + b\n")
N_DECODE = 6  # decode steps per sequence
EXACT = 0.0  # logits must be bit-identical: same kernels, same weights, only their addresses differ


@POLICIES.register("test-random")
class RandomVictim(Policy):
    """Stress policy: a random resident expert, from a fixed seed."""

    def __init__(self, n_expert, layers):
        super().__init__(n_expert, layers)
        self.rng = random.Random(1234)

    def victim(self, il, candidates, clock):
        return self.rng.choice(candidates)


def run_sequences(eng: Engine) -> list[np.ndarray]:
    """Two sequences: prefill with all logits, then teacher-forced decode steps."""
    out = []
    for text in TEXTS:
        eng.reset()
        ids = eng.tokenize(text)
        out.append(eng.decode(ids, all_logits=True))
        for t in ids[1 : 1 + N_DECODE]:
            out.append(eng.decode([t]))
    return out


def zero_slots(eng: Engine) -> None:
    """Fill every slot tensor of the engine's cache with zeros (its experts then compute nothing)."""
    for kinds in eng._runtime.slots.tensors.values():
        for ptr in kinds.values():
            t = ctypes.cast(ptr, B.ggml_tensor_p)
            n = B.libggml_base.ggml_nbytes(t)
            zeros = np.zeros(n, dtype=np.uint8)
            B.libggml_base.ggml_backend_tensor_set(t, zeros.ctypes.data, 0, n)


def _slot_counts(facts) -> list[int]:
    k, n = facts.n_expert_used, facts.n_expert
    return sorted({k, k + 1, (k + n) // 2, n})


def test_engine_is_patched():
    assert _patched.is_patched(), "the installed engine lacks the ggmoe patches: run `ggmoe engine build --install`"


@pytest.mark.parametrize("policy", ["lru", "on-demand", "test-random"])
def test_logits_equal_stock_path(arch_model, stock_logits, policy):
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    for n_slots in _slot_counts(facts):
        # n_ubatch 4: prefills split into micro-batches, some on the cache, some native
        cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                           run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy)))
        with Engine(cfg) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, n_slots, policy)
        assert st.calls > st.native_calls  # the cache path really ran
        if policy == "on-demand":
            assert st.hits == 0
        if n_slots == facts.n_expert and policy == "lru":
            assert st.misses <= facts.n_expert * len(facts.moe_layers)  # only cold misses


def test_slots_really_feed_the_matmuls(qwen3moe_model):
    """Zeroing the slot tensors must change the logits: the cache is not bypassed."""
    facts = inspect_model(qwen3moe_model)
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256, run=RunConfig(CacheConfig(n_slots=facts.n_expert)))
    with Engine(cfg) as eng:
        ids = eng.tokenize("hello there")
        before = eng.decode(ids)
        zero_slots(eng)
        eng.reset()
        after = eng.decode(ids)  # every expert is a hit now, read from the zeroed slots
    assert np.abs(after - before).max() > 1e-3


def test_too_few_slots_is_a_clear_error(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    with pytest.raises(UsageError, match="n_expert_used"):
        Engine(EngineConfig(model_path=qwen3moe_model, run=RunConfig(CacheConfig(n_slots=facts.n_expert_used - 1))))
    with pytest.raises(UsageError, match="slots per layer"):
        Engine(EngineConfig(model_path=qwen3moe_model, run=RunConfig(CacheConfig(vram_bytes=10))))


def test_unpatched_engine_is_a_clear_error(qwen3moe_model, monkeypatch):
    lib = ctypes.CDLL(None)  # this process: it has no llama_ggmoe_* symbols
    monkeypatch.setattr(_patched, "_loaded", None)
    monkeypatch.setattr(_patched, "_libllama", lambda: lib)
    assert not _patched.is_patched()
    with pytest.raises(EngineNotPatchedError, match="not patched"):
        Engine(EngineConfig(model_path=qwen3moe_model, run=RunConfig(CacheConfig(n_slots=4))))
    # without a cache the stock cb_eval hook still works
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)) as eng:
        assert not eng.patched
        eng.decode(eng.tokenize("hi"))


def test_run_stats_equal_replay_of_its_own_trace(qwen3moe_model, tmp_path):
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox", "-n", "16",
                                  "--cache-slots", "2", "--policy", "lru", "--stats-json", str(stats),
                                  "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert set(d["layers"]) == {str(il) for il in inspect_model(qwen3moe_model).moe_layers}
    assert all(0.0 <= v["hit_rate"] <= 1.0 for v in d["layers"].values())
    sim = replay(load_trace(tr), 2, "lru")
    for il, s in sim.layers.items():
        live = d["layers"][str(il)]
        assert (s.hits, s.misses, s.native_calls) == (live["hits"], live["misses"], live["native_calls"])


@pytest.mark.parametrize("args, message", [
    (["--policy", "lru"], "needs a cache size"),
    (["--cache-slots", "2", "--vram", "1GiB"], "not both"),
    (["--vram", "lots"], "bad size"),
    (["--cache-slots", "2", "--policy", "nope"], "unknown policy"),
    (["--stats-json", "x.json"], "needs a cache"),
])
def test_cache_flag_errors(qwen3moe_model, args, message):
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "hi", "-n", "2", *args])
    assert r.exit_code == 2 and message in r.output, r.output


@pytest.mark.parametrize("n_slots, policy", [(4, "lru"), (8, "on-demand"), (16, "test-random"), (32, "lru")])
def test_embedded_model_logits_equal_stock_path(stock_logits, n_slots, policy):
    from ggmoe.models import default_model_path

    path = default_model_path()
    assert path is not None, "the embedded model is missing from the package"
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy)))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    for a, b in zip(got, stock_logits(path), strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert st.calls > st.native_calls and st.misses + st.preloaded > 0  # a cache of every expert: preloaded


def test_embedded_model_run_stats_equal_replay(tmp_path):
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, ["run", "-p", "def main():\n    ", "-n", "24", "--cache-slots", "4",
                                  "--policy", "lru", "--stats-json", str(stats), "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert len(d["layers"]) == 8 and 0.0 < d["total"]["hit_rate"] < 1.0
    sim = replay(load_trace(tr), 4, "lru")
    for il, s in sim.layers.items():
        live = d["layers"][str(il)]
        assert (s.hits, s.misses, s.native_calls) == (live["hits"], live["misses"], live["native_calls"])


@pytest.mark.parametrize("policy", ["lru", "on-demand"])
def test_logits_equal_stock_path_with_copies_on_a_worker_thread(qwen3moe_model, stock_logits, policy):
    """Copies run on a worker thread after a delay: the cache must wait for them before a layer reads."""
    facts = inspect_model(qwen3moe_model)
    ref = stock_logits(qwen3moe_model)
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=facts.n_expert_used + 1, policy=policy),
                                     decode=DecodeConfig(mode="sync"),
                                     copy_delay_s=0.001))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert st.misses > 0 and st.wait_s > 0.001 * st.misses * 0.5  # the waits were real
