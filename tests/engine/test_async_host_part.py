"""The async decode's host part (patch 0016): the CPU beside in-graph fills, with no route op on the decode path.

Between tokens the cache names, per layer, the experts the CPU computes whenever no slot holds them
(``ExpertCache.cpu_of``). Their table entries are 0, which the device part's matmuls skip (a zero row) and a
fill never takes; the layer's flags tell the graph's host part, a ``mul_mat_id`` over the model's own expert
tensors, to compute exactly those entries. The two parts are added before the routing weights, so the logits
equal stock's, on every fixture family and both copy streams (the engine tier's conftest), with the host part
in the main graph or on a worker in either forced order (``GGMOE_HOST_ORDER``).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.host_part import HOST_ORDER_ENV, HOST_THREADS_ENV, host_part_stats
from ggmoe.inspect import inspect_model


def _engine(path, run: RunConfig) -> Engine:
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, n_threads=2, run=run))


def _check_tables(eng: Engine) -> int:
    """Every table entry of a CPU expert that no slot holds is 0, exactly where the layer's flags say the host
    part computes it; the experts in slots are never flagged. Returns the flagged experts."""
    flagged = 0
    for il, lt in eng.pipeline.tables.layers.items():
        cpu = eng.pipeline.runtime.cache.cpu_of.get(il)
        for e in range(len(lt.flags)):
            want = bool(cpu is not None and cpu[e] and not lt.is_mapped[e])
            assert bool(lt.flags[e]) == want, (il, e)
            assert all((int(v[0, e]) == 0) == want for v in lt.views), (il, e)
            flagged += want
    return flagged


@pytest.mark.parametrize("threads,order,counter", [
    ("0", "free", None),
    ("1", "device-first", "after_device"),
    ("1", "host-first", "before_device"),
])
def test_every_miss_on_the_cpu_gives_stock_logits(arch_model, stock_logits, monkeypatch, threads, order, counter):
    """``--miss-policy cpu --decode-mode async``: every expert no slot holds is computed by the graph's host
    part; nothing is read in place or filled, and the misses are admitted for later tokens."""
    arch, path = arch_model
    facts = inspect_model(path)
    monkeypatch.setenv(HOST_THREADS_ENV, threads)
    monkeypatch.setenv(HOST_ORDER_ENV, order)
    n_slots = (facts.n_expert_used + facts.n_expert) // 2
    with _engine(path, RunConfig(CacheConfig(n_slots=n_slots), decode=DecodeConfig(miss_policy="cpu",
                                                                                   mode="async"))) as eng:
        got = run_sequences(eng)
        st, hp = eng.cache_stats.total(), host_part_stats(eng.ctx_ptr)
        assert eng.pipeline.decode_mode.mode == "async"
        assert _check_tables(eng) > 0
    for a, b in zip(got, stock_logits(path), strict=True):
        assert np.abs(a - b).max() <= EXACT, (arch, order)
    assert st.host_computed > 0 and st.host_reads == 0 and st.fills == 0
    if counter is not None:
        assert hp.jobs > 0 and getattr(hp, counter) == hp.jobs
    else:
        assert hp.jobs == 0


def test_fills_and_the_cpu_in_one_layer_give_stock_logits(qwen3moe_model, stock_logits, monkeypatch):
    """A layer whose flags name half of its experts: the graph fills the others' misses and its host part
    computes the flagged ones, both in the same calls. ``auto`` flags all or none of a layer's experts, so the
    half is set by hand: the graph's mechanism does not depend on the share."""
    import ggmoe.engine.pipeline as pipeline

    def half(policy, costs, bpe, n_slots, n_expert, k, counts=None, keeps=True):  # the odd experts of every layer
        return {il: [e % 2 == 1 for e in range(n_expert)] for il in n_slots}

    monkeypatch.setattr(pipeline, "async_cpu_masks", half)
    facts = inspect_model(qwen3moe_model)
    run = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 1), decode=DecodeConfig(miss_policy="cpu", mode="async"))
    with _engine(qwen3moe_model, run) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
        assert 0 < _check_tables(eng)
    for a, b in zip(got, stock_logits(qwen3moe_model), strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert st.host_computed > 0 and st.fills > 0  # (a micro-batch of a prompt reads its misses in place)


@pytest.mark.parametrize("cpu_faster, want", [(True, "all"), (False, "none")])
def test_auto_gives_a_layer_to_the_cheaper_server(qwen3moe_model, stock_logits, tmp_path, cpu_faster, want):
    """``auto`` in the async decode: every expert of a layer to the CPU where a miss is sooner there (its share
    of the graph split counted) than read over the link, else none; the logits are stock's either way."""
    import dataclasses

    from ggmoe.cache.hardware import load_profile, render_profile

    base = load_profile("h100")
    rate = base.zero_copy_bytes_per_s * (4.0 if cpu_faster else 0.25)
    prof = tmp_path / "p.toml"
    prof.write_text(render_profile(dataclasses.replace(base, cpu_bytes_per_s=rate, cpu_latency_s=0.0, hook_s=0.0, gpu_launch_s=0.0,
                                                       cpu_type_bytes_per_s=()), {}))
    facts = inspect_model(qwen3moe_model)
    run = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 1),
                    decode=DecodeConfig(miss_policy="auto", mode="async", hw_profile=str(prof)))
    with _engine(qwen3moe_model, run) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
        report = eng.pipeline.report()
    for a, b in zip(got, stock_logits(qwen3moe_model), strict=True):
        assert np.abs(a - b).max() <= EXACT
    shares = report["host_part"]["async_cpu_experts"] if "host_part" in report else {}
    if want == "all":
        assert set(shares.values()) == {facts.n_expert} and len(shares) == len(facts.moe_layers)
        assert st.host_computed > 0 and st.fills == 0
    else:
        assert not any(shares.values()) and st.host_computed == 0 and st.fills > 0


def test_a_slot_for_every_expert_builds_no_host_part(stock_logits):
    """With a slot for every expert nothing is flagged: the graph has no host part to pay for."""
    from ggmoe.models import default_model_path

    model = default_model_path()
    facts = inspect_model(model)
    run = RunConfig(CacheConfig(n_slots=facts.n_expert), decode=DecodeConfig(miss_policy="cpu", mode="async"))
    with _engine(model, run) as eng:
        got = run_sequences(eng)
        assert eng.pipeline.runtime.cache.cpu_of == {}
        assert _check_tables(eng) == 0
    for a, b in zip(got, stock_logits(model), strict=True):
        assert np.abs(a - b).max() <= EXACT


@pytest.mark.parametrize("cpu_faster, mode", [(True, "sync"), (False, "async")])
def test_auto_keeps_the_sync_host_path_only_where_the_async_host_part_would_work(qwen3moe_model, tmp_path,
                                                                                 cpu_faster, mode):
    """``--decode-mode auto --miss-policy auto``: where the CPU is the cheaper server the host path stays in the
    sync decode, which splits each call's misses; where the link is, the async decode's host part would take no
    layer, so nothing holds the decode in sync, and the run says why the CPU computes nothing."""
    import dataclasses

    from ggmoe.cache.hardware import load_profile, render_profile

    base = load_profile("h100")
    rate = base.zero_copy_bytes_per_s * (4.0 if cpu_faster else 0.25)
    prof = tmp_path / "p.toml"
    prof.write_text(render_profile(dataclasses.replace(base, cpu_bytes_per_s=rate, cpu_latency_s=0.0, hook_s=0.0,
                                                       gpu_launch_s=0.0, cpu_type_bytes_per_s=()), {}))
    facts = inspect_model(qwen3moe_model)
    run = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 1),
                    decode=DecodeConfig(miss_policy="auto", mode="auto", hw_profile=str(prof)))
    with _engine(qwen3moe_model, run) as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == mode
        in_effect, note = eng.miss_policy
        if mode == "async":
            assert eng.pipeline.runtime.cache.cpu_of == {} and "host part takes no layer" in note
