"""Stride prefetching live: exact logits, prefetch hits counted, stale prefetches dropped, predictor errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from ggmoe.predict import PREDICTORS, Predictor


class Fixed(Predictor):
    """Predicts experts 0..m-1 everywhere (a predictor that is often wrong: prefetches get wasted)."""

    def predict(self, il_target):
        s = np.zeros(self.shape.n_expert, dtype=np.float32)
        s[: self.shape.n_expert_used] = 1.0
        return s


class Raising(Predictor):
    def predict(self, il_target):
        raise RuntimeError("the predictor broke")


@pytest.fixture(autouse=True, scope="module")
def test_predictors():
    """Throwaway predictors, registered for this module only (the registry's built-in list stays exact)."""
    PREDICTORS.register("test-fixed")(Fixed)
    PREDICTORS.register("test-raising")(Raising)
    yield
    PREDICTORS.unregister("test-fixed")
    PREDICTORS.unregister("test-raising")


@pytest.mark.parametrize("predictor", ["reuse", "skip-gate", "test-fixed"])
@pytest.mark.parametrize("miss_policy", ["wait", "cpu"])
def test_logits_equal_stock_with_prefetching(arch_model, stock_logits, predictor, miss_policy, monkeypatch):
    # lockstep: in the async decode the mailbox's reader then reads every layer whatever the machine's load (a
    # reader behind the device predicts nothing, and its budget turns it off: no prediction to count)
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    stride = min(2, len(facts.moe_layers) - 1)
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2),
                                     decode=DecodeConfig(miss_policy=miss_policy),
                                     prefetch=PrefetchConfig(predictor, stride=stride)))
    with Engine(cfg) as eng:
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT, (arch, predictor, miss_policy)
    assert st.pred_total > 0
    if predictor == "test-fixed":
        assert st.prefetch_issued > 0
    assert st.prefetch_hits + st.prefetch_wasted <= st.prefetch_issued


def test_a_used_prefetch_is_a_prefetch_hit(qwen3moe_model, monkeypatch):
    """With the skip-gate predictor at stride 1 on a model whose adjacent routers agree, prefetches get used (the
    reader in lockstep, so that it issues them whatever the machine's load)."""
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256,
                       run=RunConfig(CacheConfig(n_slots=4),
                                     prefetch=PrefetchConfig("test-fixed", stride=1, n_prefetch=2)))
    with Engine(cfg) as eng:
        eng.generate("hello world, the quick brown fox", 24)
        st = eng.cache_stats.total()
    # test-fixed always prefetches experts 0 and 1: when a layer then selects one of them, that is a hit
    assert st.prefetch_issued > 0 and st.prefetch_hits > 0
    assert st.prefetch_hits <= st.hits


def test_stale_prefetches_are_dropped_at_the_gate(qwen3moe_model):
    """Slow copies on a worker: prefetches still queued when their layer runs and not needed get cancelled."""
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256,
                       run=RunConfig(CacheConfig(n_slots=6),
                                     decode=DecodeConfig(miss_policy="cpu"),
                                     copy_delay_s=0.01,
                                     prefetch=PrefetchConfig("test-fixed", stride=1, n_prefetch=6)))
    with Engine(cfg) as eng:
        eng.generate("hello world, the quick brown fox", 24)
        st = eng.cache_stats.total()
    assert st.prefetch_issued > 0 and st.prefetch_dropped > 0


def test_a_predictor_that_raises_surfaces_after_the_decode(qwen3moe_model):
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256,
                       run=RunConfig(CacheConfig(n_slots=4),
                                     prefetch=PrefetchConfig("test-raising", stride=1)))
    with Engine(cfg) as eng:
        ids = eng.tokenize("hello")
        eng.decode(ids)  # a prefill: no prediction
        with pytest.raises(RuntimeError, match="the predictor broke"):
            eng.decode([ids[-1]])
        eng.reset()
        eng.decode(ids)  # the engine still works


def test_oracle_is_refused_live(qwen3moe_model):
    from ggmoe.base.errors import UsageError

    with pytest.raises(UsageError, match="simulator"):
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64,
                            run=RunConfig(CacheConfig(n_slots=4),
                                          prefetch=PrefetchConfig("oracle", stride=1))))


# (predictor on a worker thread, copies through the GPU's copy queue)
WORKERS = [(True, False), (False, True), (True, True)]


@pytest.mark.parametrize(("background", "queue"), WORKERS, ids=["background", "queue", "background+queue"])
@pytest.mark.parametrize("miss_policy", ["wait", "cpu"])
def test_worker_threads_keep_logits_exact(arch_model, stock_logits, monkeypatch, miss_policy, background, queue):
    """The predictor on a worker thread, and the GPU's copy queue (``StreamCopyBackend``: demand copies at
    once, the rest one chunk at a time on a worker) over the CPU build's memcpy "stream": counts depend on
    timing, the logits never do."""
    from ggmoe.cache.copy import StreamCopyBackend
    from ggmoe.engine import runtime

    monkeypatch.setattr(runtime, "use_copy_queue", lambda ggml, config, miss: queue)  # on any copy stream
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    stride = min(2, len(facts.moe_layers) - 1)
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2),
                                     decode=DecodeConfig(miss_policy=miss_policy, mode="sync"),
                                     prefetch=PrefetchConfig("test-fixed", stride=stride, background=background)))  # the route op's worker thread and copy queue
    with Engine(cfg) as eng:
        assert isinstance(eng._runtime.copies, StreamCopyBackend) == queue
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT, (arch, miss_policy, background, queue)
    if not background:  # a background worker's output depends on when its thread runs on 2 busy cores
        assert st.pred_total + st.prefetch_issued + st.prefetch_late > 0
    assert st.demand_copies > 0 or st.host_computed > 0


def test_a_background_predictor_error_surfaces_at_a_decode(qwen3moe_model):
    cfg = EngineConfig(model_path=qwen3moe_model, n_ctx=256,
                       run=RunConfig(CacheConfig(n_slots=4), prefetch=PrefetchConfig("test-raising", stride=1,
                                                                            background=True)))
    with Engine(cfg) as eng:
        ids = eng.tokenize("hello there")
        eng.decode(ids)
        with pytest.raises(RuntimeError, match="the predictor broke"):
            for t in ids * 20:  # the worker's error reaches one of the next decodes
                eng.decode([t])
