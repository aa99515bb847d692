"""Stride prefetching on the async decode (patch 0010's mailbox, ``ggmoe.engine.stride``).

What the GPU relies on, proved on the CPU build under both copy streams: the mailbox hands the host exactly
what the route op would have (ids and MoE input rows, per decode token and layer) while the graph runs; the
logits stay bit-identical to stock with prefetches landing into a running graph; an expert-table entry never
points at a slot whose copy has not landed (read off the device tables after every token, each copy's
landing asked of the stream); and the prefetcher runs on the mailbox, not in the layers.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.base.errors import UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.planner import PlannerConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path
from tools.fixtures.random_predictor import random_predictor_file

pytestmark = pytest.mark.engine


def _engine(path, n_slots, predictor, mode="async", stride=1, in_graph=True) -> Engine:
    cache = RunConfig(CacheConfig(n_slots=n_slots, policy="lru"),
                      decode=DecodeConfig(mode=mode),
                      prefetch=PrefetchConfig(str(predictor), stride=stride, in_graph=in_graph))
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=cache))


def _spy(eng) -> list:
    """What the prefetcher's predictor is fed per decode token and layer: (il, ids, MoE input rows)."""
    pf, got = eng.prefetcher, []
    observe = pf._observe

    def spy(event, target, calls):
        got.append((event.il, event.ids.copy(), event.hidden.copy()))
        observe(event, target, calls)

    pf._observe = spy
    return got


def test_mailbox_hands_the_predictor_what_the_route_op_would(tmp_path, monkeypatch):
    from ggmoe.cache.cache import ExpertCache
    from ggmoe.control import prefetch

    # every token read, as the route op sees every token (not only those a prefetch has room or use for)
    monkeypatch.setattr(prefetch, "IDLE_SKIP_MAX", 0)
    monkeypatch.setattr(ExpertCache, "has_free_slot", lambda self: True)
    # nor turned off by its budget: the balance of used and wasted prefetches depends on when copies land, and a
    # prefetcher whose budget reaches 0 leaves the mailbox unread (one token fewer, now and then)
    monkeypatch.setattr(prefetch.Prefetcher, "_budget", lambda self: None)
    model = default_model_path()
    pred = random_predictor_file(model, tmp_path / "p.npz", kind="mlp", stride=1, hidden=32, seed=3)
    fed = {}
    for mode in ("sync", "async"):
        with _engine(model, 8, pred, mode=mode, in_graph=False) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == mode
            fed[mode] = _spy(eng)
            eng.generate("The mailbox test", 10)
            if mode == "async":
                assert eng.prefetcher.via_mailbox and eng.prefetcher.free_only
    assert len(fed["async"]) == len(fed["sync"]) > 0
    for (il_a, ids_a, h_a), (il_b, ids_b, h_b) in zip(fed["async"], fed["sync"], strict=True):
        assert il_a == il_b
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(h_a, h_b)  # the MLP reads the same input in both decodes


@pytest.mark.parametrize("predictor", ["reuse", "mlp"])
def test_stride_prefetch_logits_equal_stock(arch_model, stock_logits, tmp_path, predictor, monkeypatch):
    # lockstep: the reader keeps pace with the decode, so that every layer's prefetch is issued before its layer
    # starts whatever the machine's load (a reader behind the device issues none)
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    pred = (random_predictor_file(path, tmp_path / "p.npz", kind="mlp", stride=1, hidden=16, seed=1)
            if predictor == "mlp" else predictor)
    if predictor == "mlp" and arch == "llama4":  # its experts read a weighted input: the mailbox has ids only
        with pytest.raises(UsageError, match="ids only"):
            _engine(path, facts.n_expert_used + 1, pred)
        return
    for n_slots in sorted({facts.n_expert_used + 1, facts.n_expert // 2}):
        with _engine(path, n_slots, pred) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == "async", (arch, eng.decode_mode)
            got = run_sequences(eng)
            st = eng.cache_stats.total()
            assert eng.pipeline.stride.tokens > 0
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, n_slots, predictor)
        assert st.prefetch_issued > 0, (arch, n_slots)


def _device_tables(eng) -> np.ndarray:
    tables = eng.pipeline.tables
    out = np.zeros_like(tables.flat)
    t = ctypes.cast(tables.all, B.ggml_tensor_p)
    B.libggml_base.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


def _check_entries(eng, device: np.ndarray) -> int:
    """Every device entry points at its expert's host tensor, or at the slot that holds that expert whose copy
    has landed (asked of the stream after the tables were read: landing only goes one way). Returns the
    entries that point at slots."""
    tables, cache = eng.pipeline.tables, eng.pipeline.runtime.cache
    stream = eng.pipeline.runtime.stream
    at_slot = 0
    for il, lt in tables.layers.items():
        table = cache.tables[il]
        for k, off in enumerate(lt.offsets):
            n = len(lt.host[k])
            for e in range(n):
                v = int(device[off + e])
                if v == int(lt.host[k][e]):
                    continue
                slot, rem = divmod(v - lt.slot_data[k], lt.slot_bytes[k])
                assert rem == 0 and 0 <= slot < table.n_slots, (il, k, e, "points at no slot")
                assert table.expert_in_list[slot] == e, (il, k, e, slot, "a slot of another expert")
                h = table.copy[slot]
                assert h is None or stream.done(h), (il, k, e, slot, "a slot whose copy has not landed")
                at_slot += 1
    return at_slot


def test_entries_never_point_at_a_slot_before_its_copy_landed(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert_used + 2, "reuse") as eng:
        ids = eng.tokenize("The quick brown fox jumps over the lazy dog again and again")
        eng.decode(ids[:4])
        seen = 0
        for t in ids[4:] * 3:
            eng.decode([t])
            seen += _check_entries(eng, _device_tables(eng))
        assert seen > 0  # the check looked at slots, not only at host entries
        assert eng.cache_stats.total().prefetch_issued > 0


def test_auto_weighs_the_modes_for_a_prefetch_and_async_refuses_a_predictor_of_probabilities(qwen3moe_model,
                                                                                             monkeypatch):
    from ggmoe.cache.decode_mode import ModeEstimate
    from ggmoe.engine.runtime import CacheRuntime
    from ggmoe.predict.simple import Reuse

    with _engine(qwen3moe_model, 5, "reuse", mode="auto") as eng:  # the CPU build: reads in place cost nothing
        assert eng.decode_mode["decode_mode_in_effect"] == "async" and eng.pipeline.stride is not None
        assert "estimates" in eng.decode_mode["decode_mode_reason"]
    # a machine whose estimates favour the sync decode: auto takes it, with the prefetch on the route op
    monkeypatch.setattr(CacheRuntime, "mode_estimate", lambda self, cfg, n: ModeEstimate(1e-3, 2e-3, "forced"))
    with _engine(qwen3moe_model, 5, "reuse", mode="auto") as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "sync" and eng.pipeline.stride is None
        assert "forced" in eng.decode_mode["decode_mode_reason"]
    monkeypatch.setattr(Reuse, "needs_probs", True)  # as expert-map's (which needs training traces)
    with _engine(qwen3moe_model, 5, "reuse", mode="auto") as eng:
        assert "router probabilities" in eng.decode_mode["decode_mode_reason"]
    with pytest.raises(UsageError, match="router probabilities"):
        _engine(qwen3moe_model, 5, "reuse", mode="async")


def test_lockstep_the_reader_handles_every_layer_before_its_matmuls(qwen3moe_model, stock_logits, monkeypatch):
    """GGMOE_MAILBOX_LOCKSTEP=1 (benchmarks): each layer waits for the reader's acknowledgement, so every layer
    is read while its decode runs, as a host that keeps pace with a GPU would; the logits stay exact."""
    facts = inspect_model(qwen3moe_model)
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    with _engine(qwen3moe_model, facts.n_expert_used + 2, "reuse") as eng:
        got = run_sequences(eng)
        reader = eng.pipeline.stride
        assert eng.decode_mode["prefetch"]["lockstep"] is True
        assert reader.tokens > 0 and reader.layer_reads == reader.tokens * len(facts.moe_layers)
    for a, b in zip(got, stock_logits(qwen3moe_model), strict=True):
        assert np.abs(a - b).max() <= EXACT


@pytest.mark.parametrize("value", ["2", "yes"])
def test_a_bad_lockstep_value_is_refused(qwen3moe_model, monkeypatch, value):
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", value)
    with pytest.raises(UsageError, match="GGMOE_MAILBOX_LOCKSTEP"):
        _engine(qwen3moe_model, 4, "reuse")


# -- the planner between tokens (ggmoe.control.planner): a cross-token mlp fed from the mailbox


def _planned(path, n_slots, planner, mode="async", predictor=None) -> Engine:
    cache = RunConfig(CacheConfig(n_slots=n_slots, policy="lru"),
                      decode=DecodeConfig(mode=mode),
                      planner=PlannerConfig(str(planner)),
                      prefetch=PrefetchConfig(predictor, stride=1) if predictor else None)
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=cache))


def test_the_mailbox_hands_the_planner_what_the_route_op_would(tmp_path):
    model = default_model_path()
    planner = random_predictor_file(model, tmp_path / "t.npz", kind="mlp", hidden=32, seed=4, mode="token")
    fed = {}
    for mode in ("sync", "async"):
        with _planned(model, 8, planner, mode=mode) as eng:
            pl, got = eng.pipeline.planner, []
            observe = pl.observe

            def spy(il, ids, probs, hidden, got=got, observe=observe):
                got.append((il, np.asarray(ids).copy(), hidden.copy()))
                observe(il, ids, probs, hidden)

            pl.observe = spy
            eng.generate("The planner test", 10)
            assert eng.decode_mode["decode_mode_in_effect"] == mode
            assert eng.decode_mode["planner"]["runs_on"] == ("controller" if mode == "async" else "route op")
            fed[mode] = got
    assert len(fed["async"]) == len(fed["sync"]) > 0
    for (il_a, ids_a, h_a), (il_b, ids_b, h_b) in zip(fed["async"], fed["sync"], strict=True):
        assert il_a == il_b
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(h_a, h_b)  # the mailbox's row is the route op's MoE input


@pytest.mark.parametrize("predictor", [None, "reuse"])
def test_a_token_mode_planner_keeps_the_async_decode_exact(arch_model, stock_logits, tmp_path, predictor):
    arch, path = arch_model
    facts = inspect_model(path)
    planner = random_predictor_file(path, tmp_path / "t.npz", kind="mlp", hidden=16, seed=2, mode="token")
    if arch == "llama4":  # its experts read a weighted input: the mailbox has ids only
        with pytest.raises(UsageError, match="planner 'mlp' reads the MoE input.*ids only"):
            _planned(path, facts.n_expert_used + 1, planner, predictor=predictor)
        return
    for n_slots in sorted({facts.n_expert_used + 1, facts.n_expert // 2}):
        with _planned(path, n_slots, planner, predictor=predictor) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == "async", (arch, eng.decode_mode)
            got = run_sequences(eng)
            st = eng.cache_stats.total()
            plan = dict(eng.pipeline.runtime.cache.planned)
        for a, b in zip(got, stock_logits(path), strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, n_slots, predictor)
        assert st.plan_total > 0 and any(plan.values()), (arch, n_slots)
