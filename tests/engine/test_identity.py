"""Identity (patch 0017): a cache with a slot for every expert, each expert in its own slot, is read in table
mode with stock's matmuls on the slot tensors, at the selected ids: no table, fill or mailbox.

The async decode warms such a cache (every expert copied in before the first token) and turns identity on for
every layer where nothing reads the mailbox. The logits equal stock's on every fixture family and both copy
streams; the graph reads the slots (poisoned slots change the logits) and not the tables (zeroed tables do
not); a flip of a layer turns its identity off, and its graph reads the tables again.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences, zero_slots

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.step import StepChanges
from ggmoe.control.prefetch import build_prefetch_config
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import patch as _patched
from ggmoe.inspect import inspect_model

pytestmark = pytest.mark.engine


def _engine(path, n_slots: int, policy: str = "lru", prefetch=None, identity: bool = True) -> Engine:
    run = RunConfig(CacheConfig(n_slots=n_slots, policy=policy), decode=DecodeConfig(mode="async", identity=identity),
                    prefetch=prefetch)
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, n_threads=2, run=run))


def _zero_tables(eng: Engine) -> None:
    """Every table entry 0: a table matmul would read nothing there (a zero row), so logits equal to stock's
    prove that no graph read the tables."""
    tables = eng.pipeline.tables
    tables.flat[:] = 0
    tables.touch(0)
    tables.touch(tables.flat.size - 1)
    tables.flush()


def test_a_warm_cache_of_every_expert_reads_its_slots_with_stock_matmuls(arch_model, stock_logits):
    arch, path = arch_model
    facts = inspect_model(path)
    with _engine(path, facts.n_expert) as eng:
        assert eng.pipeline.tables.identity == set(facts.moe_layers), arch
        _zero_tables(eng)
        got = run_sequences(eng)
        st = eng.cache_stats.total()
        zero_slots(eng)  # the slots are what the graph reads: poisoned, the logits move
        poisoned = run_sequences(eng)
    for a, b in zip(got, stock_logits(path), strict=True):
        assert np.abs(a - b).max() <= EXACT, arch
    assert st.misses == 0 and st.hits > 0  # warmed: every expert use a hit
    assert any(np.abs(a - b).max() > EXACT for a, b in zip(poisoned, got, strict=True)), arch


@pytest.mark.parametrize("case", ["fewer slots", "on-demand", "predictor", "asked off"])
def test_no_identity_where_the_tables_are_needed(qwen3moe_model, case):
    """A slot short of every expert, a policy that drops what it loaded, or a predictor reading the mailbox
    (which identity's graph does not write): the layers keep their tables; and where a benchmark asks so."""
    facts = inspect_model(qwen3moe_model)
    n_slots = facts.n_expert - 1 if case == "fewer slots" else facts.n_expert
    policy = "on-demand" if case == "on-demand" else "lru"
    prefetch = build_prefetch_config("reuse", 1) if case == "predictor" else None
    with _engine(qwen3moe_model, n_slots, policy, prefetch, identity=case != "asked off") as eng:
        assert eng.pipeline.tables.identity == set()


def _layer_counts(eng: Engine) -> dict[int, tuple[int, int, int]]:
    return {il: (st.calls, st.hits, st.misses) for il, st in eng.cache_stats.layers.items()}


def test_identity_counts_its_hits_without_reading_the_routing(qwen3moe_model):
    """After a one-token decode that read every layer with identity, the controller counts each layer's top-k as
    hits without reading the routing back: the same per-layer counts as the tables' decode, which reads it. An
    observer that wants the routing gets it read, every decode token, and identity stays on."""
    from ggmoe.base.hook import HookRequest, RouteRecorder

    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert) as fast, \
            _engine(qwen3moe_model, facts.n_expert, identity=False) as tabled:
        reads = []
        read = fast.pipeline.tables.read_routing
        fast.pipeline.tables.read_routing = lambda n: reads.append(n) or read(n)
        run_sequences(fast)
        run_sequences(tabled)
        assert _layer_counts(fast) == _layer_counts(tabled)
        assert fast.pipeline.controller.calls == tabled.pipeline.controller.calls
        assert 1 not in reads  # only a prefill's last micro-batch of several tokens read it
        rec = RouteRecorder(HookRequest(probs=False, hidden=False))
        with fast.observing(rec):
            ids = fast.tokenize("The lazy dog")
            fast.reset()
            fast.decode(ids)
            rec.take()
            reads.clear()
            fast.decode(ids[:1])
            assert reads == [1] and sorted(rec.take()) == sorted(facts.moe_layers)
        assert fast.pipeline.tables.identity == set(facts.moe_layers)


def test_a_flip_turns_a_layers_identity_off(qwen3moe_model, stock_logits):
    """An expert moved out of its slot (here by hand, as a later step would): that layer reads its tables
    again, the entry pointing at host memory; the other layers keep identity; the logits stay stock's."""
    facts = inspect_model(qwen3moe_model)
    il = facts.moe_layers[0]
    with _engine(qwen3moe_model, facts.n_expert) as eng:
        tables = eng.pipeline.tables
        tables.apply(StepChanges(flips=[(il, 3, -1, False)]))
        tables.flush()
        assert tables.identity == set(facts.moe_layers) - {il}
        got = run_sequences(eng)
    for a, b in zip(got, stock_logits(qwen3moe_model), strict=True):
        assert np.abs(a - b).max() <= EXACT


def test_set_layer_identity_checks_its_arguments(qwen3moe_model):
    """The C API refuses what identity cannot serve, and changes nothing then."""
    facts = inspect_model(qwen3moe_model)
    P = _patched.symbols()
    il = facts.moe_layers[0]
    with _engine(qwen3moe_model, facts.n_expert - 1) as eng:
        ctx = eng.pipeline._ctx_ptr
        assert P.llama_ggmoe_set_layer_identity(None, il, True) == _patched.LLAMA_GGMOE_ERR_ARG
        assert P.llama_ggmoe_set_layer_identity(ctx, 10_000, True) == _patched.LLAMA_GGMOE_ERR_LAYER
        # fewer slots than experts: slot e cannot hold expert e for every e
        assert P.llama_ggmoe_set_layer_identity(ctx, il, True) == _patched.LLAMA_GGMOE_ERR_TENSOR
        assert P.llama_ggmoe_set_layer_identity(ctx, il, False) == _patched.LLAMA_GGMOE_OK
