"""``CachePipeline``'s one teardown path: a step that raises stops none of the steps after it, and its error
reaches the caller (``close``, ``detach``, ``reconfigure``'s drop of the old cache)."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import EngineError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig

pytestmark = pytest.mark.engine


def _fail() -> None:
    raise EngineError("injected teardown failure")


@pytest.fixture
def engine(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128,
                             run=RunConfig(CacheConfig(n_slots=4), decode=DecodeConfig(mode="async")))) as eng:
        eng.decode(eng.tokenize("hello world"))  # copies admitted, tables written: something to tear down
        yield eng


def test_close_frees_everything_when_an_early_step_raises(engine):
    """The copies' landing raises (a step before the context is left and the memory freed): ``close`` raises it,
    and the route hook is still off the context, the tables and the slot tensors freed."""
    pipeline = engine.pipeline
    runtime, tables = pipeline.runtime, pipeline.tables
    assert tables is not None  # the async decode's tables: a step after the failing one
    freed, real_close = [], runtime.close
    runtime.quiesce = _fail
    runtime.close = lambda: (freed.append(True), real_close())
    with pytest.raises(EngineError, match="injected teardown failure"):
        pipeline.close()
    assert freed == [True] and pipeline.runtime is None and pipeline.tables is None
    assert pipeline._ctx_ptr == 0 and pipeline.stride is None and pipeline.mailbox is None
    pipeline.close()  # again: nothing left to do, nothing raised
    pipeline.detach()


def test_detach_leaves_the_context_when_an_early_step_raises(engine):
    """detach with a failing step still takes the hook and tables off the context and keeps the memory (the
    context that computes with it goes first); the ``close`` after it frees that memory."""
    pipeline = engine.pipeline
    runtime, tables = pipeline.runtime, pipeline.tables
    real_quiesce = runtime.quiesce
    runtime.quiesce = _fail
    with pytest.raises(EngineError, match="injected teardown failure"):
        pipeline.detach()
    assert pipeline._ctx_ptr == 0 and tables.ctx_ptr == 0  # the hook and the tables off the context
    assert pipeline.runtime is runtime and pipeline.tables is tables  # kept until the context is gone
    runtime.quiesce = real_quiesce
    pipeline.detach()  # again: nothing left on the context
    pipeline.close()
    assert pipeline.runtime is None and pipeline.tables is None


def test_reconfigure_drops_the_old_cache_when_a_step_raises(engine):
    """reconfigure's drop of the old cache raises: the old cache is freed all the same and the route hook stays,
    the pipeline left without a cache on its context; the next reconfigure builds one that decodes."""
    pipeline = engine.pipeline
    old = pipeline.runtime
    old.quiesce = _fail
    with pytest.raises(EngineError, match="injected teardown failure"):
        engine.reconfigure(RunConfig(CacheConfig(n_slots=6), decode=DecodeConfig(mode="sync")))
    assert pipeline.runtime is None and pipeline.tables is None and old.slots is None  # freed
    assert pipeline.hook.cache is None and pipeline.decode_mode is None and pipeline._ctx_ptr != 0
    pipeline.reconfigure(RunConfig(CacheConfig(n_slots=6), decode=DecodeConfig(mode="sync")))
    assert pipeline.runtime is not None and pipeline.mode_in_effect == "sync"
    engine.decode(engine.tokenize(" again"))
