"""The CPU beside the link (patch 0015) through the engine: a layer's CPU part runs on a worker while the layer
waits for its copies in the wait hook, and ``auto`` splits the layer's misses between the two.

The interleavings are forced, not timed: ``GGMOE_HOST_ORDER`` makes the worker start only after the device part
has finished (device-first) or the device part only after the worker has finished (host-first). In both, the
logits equal stock's, on every fixture family and on both copy streams (the engine tier's conftest), and the
worker's counters show every job in the forced order.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.host_part import HOST_ORDER_ENV, HOST_SPIN_ENV, HOST_THREADS_ENV, host_part_stats
from ggmoe.inspect import inspect_model


def _run(path, cache: CacheConfig):
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, n_threads=2, run=cache)
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        return got, eng.cache_stats.total(), host_part_stats(eng.ctx_ptr), eng.miss_policy


@pytest.mark.parametrize("order,counter", [("device-first", "after_device"), ("host-first", "before_device")])
@pytest.mark.parametrize("spin", ["0", "250"])  # the hand-off sleeps at once, or spins first
def test_misses_split_between_link_and_cpu_give_stock_logits(arch_model, stock_logits, even_profile, monkeypatch,
                                                             order, counter, spin):
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    monkeypatch.setenv(HOST_THREADS_ENV, "1")
    monkeypatch.setenv(HOST_ORDER_ENV, order)
    monkeypatch.setenv(HOST_SPIN_ENV, spin)
    n_slots = (facts.n_expert_used + facts.n_expert) // 2
    got, st, hp, (in_effect, _) = _run(path, RunConfig(CacheConfig(n_slots=n_slots),
                                                       decode=DecodeConfig(miss_policy="auto", mode="sync",
                                                                           hw_profile=even_profile)))
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT, (arch, order)
    assert in_effect == "auto"
    assert st.host_computed > 0 and st.demand_copies > 0  # both servers took misses
    assert st.deferred_waits > 0  # calls that waited in the hook, after their CPU part had been handed over
    assert hp.jobs > 0 and getattr(hp, counter) == hp.jobs


def test_without_a_worker_the_sync_decode_waits_in_the_call(stock_logits, even_profile, monkeypatch):
    """No worker: the CPU part runs after the device part in the graph, so nothing is deferred, and ``auto``
    sends each miss to its sooner server alone."""
    from ggmoe.models import default_model_path

    model = default_model_path()
    monkeypatch.setenv(HOST_THREADS_ENV, "0")
    got, st, hp, _ = _run(model, RunConfig(CacheConfig(n_slots=4),
                                           decode=DecodeConfig(miss_policy="auto", mode="sync",
                                                               hw_profile=even_profile)))
    for a, b in zip(got, stock_logits(model), strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert st.deferred_waits == 0 and hp.jobs == 0


@pytest.mark.parametrize(("env", "raw"), [(HOST_THREADS_ENV, "-1"), (HOST_THREADS_ENV, "two"),
                                          (HOST_SPIN_ENV, "-5"), (HOST_SPIN_ENV, "100001"), (HOST_SPIN_ENV, "fast")])
def test_a_bad_thread_count_or_spin_is_one_clear_error(env, raw, monkeypatch):
    from ggmoe.base.errors import UsageError
    from ggmoe.models import default_model_path

    monkeypatch.setenv(HOST_THREADS_ENV, "1")
    monkeypatch.setenv(env, raw)
    with pytest.raises(UsageError, match=env):
        _run(default_model_path(), RunConfig(CacheConfig(n_slots=4),
                                             decode=DecodeConfig(miss_policy="cpu", mode="sync")))


def test_host_threads_from_the_config_win_over_the_environment(stock_logits, monkeypatch):
    """``CacheConfig.host_threads`` (``--host-threads``) is what runs; the environment only fills in a default."""
    from ggmoe.models import default_model_path

    model = default_model_path()
    monkeypatch.setenv(HOST_THREADS_ENV, "0")
    cfg = EngineConfig(model_path=model, n_ctx=256, n_batch=64, n_ubatch=4, n_threads=2,
                       run=RunConfig(CacheConfig(n_slots=4),
                                     decode=DecodeConfig(miss_policy="cpu", mode="sync", host_threads=1)))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        part = eng.pipeline.report()["host_part"]
    for a, b in zip(got, stock_logits(model), strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert part["threads"] == 1 and part["jobs"] > 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_host_threads_config_is_refused(bad):
    from ggmoe.base.errors import UsageError

    with pytest.raises(UsageError, match="host_threads"):
        RunConfig(CacheConfig(n_slots=4), decode=DecodeConfig(miss_policy="cpu", host_threads=bad))


@pytest.mark.immediate_copies("the replay's counts equal a run's only when copies land at once")
def test_a_run_beside_the_link_equals_its_replay(qwen3moe_model, even_profile, monkeypatch, tmp_path):
    """The engine's split of each layer's misses is the cache's own: replaying the run's trace through a cache
    with the same costs, beside the link, counts the same hits, CPU experts and copies per layer."""
    import json

    from click.testing import CliRunner

    from ggmoe.cache.hardware import load_profile
    from ggmoe.cli import main
    from ggmoe.simulate import replay
    from ggmoe.trace import load_trace

    monkeypatch.setenv(HOST_THREADS_ENV, "1")
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox", "-n", "16",
                                  "--cache-slots", "5", "--miss-policy", "auto", "--hw", even_profile,
                                  "--decode-mode", "sync", "--stats-json", str(stats), "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert d["host_part"]["beside_link"] and d["total"]["deferred_waits"] > 0
    sim = replay(load_trace(tr), 5, "lru", miss_policy="auto", costs=load_profile(even_profile).miss_costs(),
                 beside_link=True)
    keys = ("hits", "misses", "native_calls", "host_computed", "admission_copies", "demand_copies")
    for il, s in sim.layers.items():
        live = d["layers"][str(il)]
        assert tuple(getattr(s, k) for k in keys) == tuple(live[k] for k in keys), il
    total = sim.total()
    assert total.host_computed > 0 and total.demand_copies > 0  # both servers, in the replay as in the run


@pytest.mark.parametrize(("n_threads", "spin", "said"), [(2, 0, True), (1, 250, False)])
def test_the_hand_off_spins_where_the_threads_fit_the_cores_and_says_when_not(monkeypatch, n_threads, spin, said):
    """On two cores (the count is the test's), ``--host-threads 1`` beside one context thread spins; beside two it
    sleeps at every layer, and the run says so in its miss-policy note."""
    from ggmoe.engine import host_part
    from ggmoe.models import default_model_path

    monkeypatch.delenv(HOST_SPIN_ENV, raising=False)
    monkeypatch.setattr(host_part.os, "cpu_count", lambda: 2)
    cfg = EngineConfig(model_path=default_model_path(), n_ctx=128, n_threads=n_threads,
                       run=RunConfig(CacheConfig(n_slots=4, policy="on-demand"),
                                     decode=DecodeConfig(miss_policy="cpu", mode="sync", host_threads=1)))
    with Engine(cfg) as eng:
        eng.generate("hello", 4)
        hp = eng.report()["host_part"]
        note = eng.miss_policy[1] or ""
    assert hp["threads"] == 1 and hp["spin_us"] == spin and hp["jobs"] > 0
    assert ("hand-off sleeps" in note) == said, note
