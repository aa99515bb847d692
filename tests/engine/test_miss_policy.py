"""Misses computed on the CPU (patch 0004's host path) through the engine: exact logits, counts, replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from test_cache_engine import EXACT, run_sequences

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cli import main
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from ggmoe.simulate import replay
from ggmoe.trace import load_trace


@pytest.mark.parametrize("miss_policy", ["cpu", "auto"])
@pytest.mark.parametrize("policy", ["lru", "on-demand"])
def test_logits_equal_stock_with_misses_on_the_cpu(arch_model, stock_logits, miss_policy, policy):
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    k, n = facts.n_expert_used, facts.n_expert
    for n_slots in sorted({k, (k + n) // 2, n}):
        # n_ubatch 4: prefill micro-batches of 4 tokens run on the cache, with the host path
        cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                           run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy),
                                         decode=DecodeConfig(miss_policy=miss_policy)))
        with Engine(cfg) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
            note = eng.miss_policy[1]
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, n_slots, policy, miss_policy)
        if miss_policy == "cpu" and (n_slots < n or policy == "on-demand"):
            assert st.host_computed >= st.misses > 0 and st.demand_copies == 0  # copies in flight too
        elif miss_policy == "cpu":  # a slot for every expert: the async decode warms them, the flag says why
            assert st.misses == st.host_computed == 0 and "no miss is left for the CPU" in note


@pytest.mark.parametrize("miss_policy", ["cpu", "auto"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cache_of_every_expert_is_warm_and_leaves_the_host_path_off(qwen3moe_model, stock_logits, miss_policy,
                                                                       mode):
    """A slot for every expert: either decode mode copies every expert in before the first token, so no miss is
    ever left for the CPU; the host path stays off (no graph split, no zero slot taking a slot), and the run says
    the flag had nothing to do."""
    facts = inspect_model(qwen3moe_model)
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=facts.n_expert),
                                     decode=DecodeConfig(miss_policy=miss_policy, mode=mode)))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
        in_effect, note = eng.miss_policy
    for a, b in zip(got, stock_logits(qwen3moe_model), strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert in_effect == "wait" and note.startswith(f"{miss_policy}: every expert has a slot, warmed")
    assert st.preloaded == facts.n_expert * len(facts.moe_layers)
    assert st.misses == st.host_computed == st.demand_copies == 0 and st.hits > 0


def test_cpu_misses_never_wait_for_a_slow_link(qwen3moe_model, stock_logits):
    """Copies take 20 ms each on a worker thread: the CPU computes the misses, nothing waits for them."""
    ref = stock_logits(qwen3moe_model)
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=4),
                                     decode=DecodeConfig(miss_policy="cpu"),
                                     copy_delay_s=0.02))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert st.host_computed > 0 and st.admission_copies > 0
    assert st.wait_s < 0.02 * st.admission_copies / 2  # far less than waiting for the admissions


@pytest.mark.immediate_copies("the replay's counts equal a run's only when copies land at once")
def test_run_stats_equal_replay_with_misses_on_the_cpu(qwen3moe_model, tmp_path):
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox", "-n", "16",
                                  "--cache-slots", "3", "--miss-policy", "cpu", "--stats-json", str(stats),
                                  "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert d["miss_policy"] == "cpu"
    sim = replay(load_trace(tr), 3, "lru", miss_policy="cpu")
    for il, s in sim.layers.items():
        live = d["layers"][str(il)]
        keys = ("hits", "misses", "native_calls", "host_computed", "admission_copies", "demand_copies")
        assert tuple(getattr(s, k) for k in keys) == tuple(live[k] for k in keys), il
    assert sum(s.host_computed for s in sim.layers.values()) > 0


@pytest.mark.parametrize("hw, on_cpu", [("egpu", True), ("slow-cpu", False)])
def test_auto_follows_the_hardware_profile(stock_logits, tmp_path, hw, on_cpu):
    """The embedded model's experts in the sync decode: a slow link (egpu) sends misses to the CPU; h100's link
    with a CPU at 0.5 GB/s (about 160 us an expert, a copy of its 3 tensors about 45 us) copies. (The async
    decode's choice: tests/engine/test_async_host_part.py.)"""
    import dataclasses

    from ggmoe.cache.hardware import load_profile, render_profile
    from ggmoe.models import default_model_path

    if hw == "slow-cpu":
        slow = tmp_path / "slow-cpu.toml"
        slow.write_text(render_profile(dataclasses.replace(load_profile("h100"), cpu_bytes_per_s=0.5e9), {}))
        hw = str(slow)
    model = default_model_path()
    ref = stock_logits(model)
    cfg = EngineConfig(model_path=model, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=4),
                                     decode=DecodeConfig(miss_policy="auto", hw_profile=hw, mode="sync")))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
        in_effect, note = eng.miss_policy
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert st.misses > 0
    assert (st.host_computed == st.misses) if on_cpu else (st.host_computed == 0)
    # a CPU that is never sooner than a copy: auto runs as wait, without the host path, and says why
    assert in_effect == ("auto" if on_cpu else "wait")
    assert (note is None) if on_cpu else ("sooner than the CPU" in note)


@pytest.mark.parametrize("case, why", [
    ("split", "split experts read what is not cached"),
])
def test_auto_chooses_wait_where_the_host_path_cannot_serve(arch_model, stock_logits, case, why):
    """auto on a slow link (egpu: the CPU is sooner) never errors out where the host path cannot serve the
    cache (MoEpic's split layers): it runs as wait and says why. (The async decode's host part serves an
    asked-for async decode: tests/engine/test_async_host_part.py.)"""
    arch, path = arch_model
    facts = inspect_model(path)
    theta = dict.fromkeys(facts.moe_layers, 0.5) if case == "split" else None
    decode = DecodeConfig(mode="async" if case == "async" else "auto", miss_policy="auto", hw_profile="egpu")
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=facts.n_expert_used, layer_theta=theta), decode=decode))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        in_effect, note = eng.miss_policy
        st = eng.cache_stats.total()
    for a, b in zip(got, stock_logits(path), strict=True):
        assert np.abs(a - b).max() <= EXACT, arch
    assert in_effect == "wait" and why in note and st.host_computed == 0
