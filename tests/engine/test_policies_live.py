"""Every eviction policy but Belady, live on the qwen3moe fixture: stock logits, and stats equal to replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from test_cache_engine import EXACT, _slot_counts, run_sequences

from ggmoe.base.errors import UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.policies.static import Static
from ggmoe.cli import main
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from ggmoe.simulate import replay
from ggmoe.trace import load_trace


@POLICIES.register("test-static-live")
class StaticLive(Static):
    """static with fixed made-up counts (the engine builds a policy from its name alone)."""

    def __init__(self, n_expert, layers):
        super().__init__(n_expert, layers, counts={il: [(5 * e + il) % n_expert for e in range(n_expert)]
                                                   for il in layers})


# every live-capable policy; static through its bound variant
LIVE = [n for n in POLICIES.names()
        if not POLICIES.get(n).needs_future and not n.startswith("test-") and n != "static"] + ["test-static-live"]


@pytest.mark.parametrize("policy", LIVE)
def test_logits_equal_stock_path(qwen3moe_model, stock_logits, policy):
    facts = inspect_model(qwen3moe_model)
    ref = stock_logits(qwen3moe_model)
    for n_slots in _slot_counts(facts):
        cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4,
                           run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy)))
        with Engine(cfg) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (n_slots, policy)
        assert st.calls > st.native_calls  # the cache path really ran
        if n_slots == facts.n_expert_used:
            assert st.misses > 0  # small enough that the policy had to choose victims


@pytest.mark.parametrize("policy", LIVE)
def test_run_stats_equal_replay_of_its_own_trace(qwen3moe_model, tmp_path, policy):
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox", "-n", "16",
                                  "--cache-slots", "3", "--policy", policy, "--stats-json", str(stats),
                                  "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    sim = replay(load_trace(tr), 3, policy)
    assert sum(s.misses for s in sim.layers.values()) > 0
    for il, s in sim.layers.items():
        live = d["layers"][str(il)]
        assert (s.hits, s.misses, s.native_calls) == (live["hits"], live["misses"], live["native_calls"]), il


def test_belady_refuses_to_run_live(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=facts.n_expert_used, policy="belady")))
    with Engine(cfg) as eng, pytest.raises(UsageError, match="simulator"):
        for t in eng.tokenize("The quick brown fox jumps over the lazy dog"):
            eng.decode([t])
