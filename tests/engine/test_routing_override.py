"""Benchmark seams of the engine: a routing override (trace-replay routing) and per-layer expert placement."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_cache_and_the_observers_see_the_override(qwen3moe_model, mode, copy_stream):
    """sync: the route op hands the override's experts to the cache; async: the device reads the forced
    routing through the tables and the controller sees it after each token."""
    rec = RouteRecorder(HookRequest(probs=False, hidden=False))
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64,
                             run=RunConfig(CacheConfig(n_slots=4),
                                           decode=DecodeConfig(mode=mode))), observer=rec) as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == mode
        k = eng.facts.n_expert_used
        calls = []

        def override(il: int, n_tokens: int) -> list[int]:
            calls.append((il, n_tokens))
            return [e for _ in range(n_tokens) for e in range(k)]  # always experts 0..k-1

        eng.set_routing_override(override)
        eng.decode([1])  # one token per call: every call runs on the cache (none natively)
        events = rec.take()
        for _ in range(5):
            eng.decode([4])
        stats = {il: (s.calls, s.hits, s.misses) for il, s in eng.cache_stats.layers.items()}  # a copy
        eng.set_routing_override(None)
        eng.decode([5])
        after = rec.take()
    assert calls and {il for il, _ in calls} == set(eng.facts.moe_layers)
    assert all(set(ev.ids.ravel().tolist()) == set(range(k)) for ev in events.values())
    for calls_, hits, misses in stats.values():
        assert calls_ == 6 and hits + misses == k * calls_
        if mode == "sync" or copy_stream == "immediate":
            assert misses == k  # loaded once, then every call hits
        else:  # the async admissions are seen once they landed: when, the deferred stream's threads decide
            assert misses >= k
    assert any(set(ev.ids.ravel().tolist()) != set(range(k)) for ev in after.values())


def test_an_override_needs_the_route_op(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64, hook_path="cb_eval")) as eng:
        with pytest.raises(UsageError, match="route op"):
            eng.set_routing_override(lambda il, n: [])


def test_host_expert_layers(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64, host_expert_layers=(1, 3),
                             gate_hook=False)) as eng:
        assert set(eng.host_expert_tensors) <= {n for n in eng.expert_buffers if n.split(".")[1] in ("1", "3")}
        assert eng.decode([1, 2]).shape[-1] == eng.n_vocab
    with pytest.raises(UsageError, match="every layer"):
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64, host_expert_layers=(1,),
                            run=RunConfig(CacheConfig(n_slots=4))))


def test_a_long_prefill_under_an_override_in_the_async_decode(qwen3moe_model):
    """A prefill larger than table mode takes the route op in every layer, the last one included (which
    computes only the token whose logits are wanted): the forced routing, written only before table-mode
    decodes, is never read there (it once was: garbage ids, a crash)."""
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128,
                             run=RunConfig(CacheConfig(n_slots=4),
                                           decode=DecodeConfig(mode="async")))) as eng:
        k = eng.facts.n_expert_used
        eng.set_routing_override(lambda il, n: [e for _ in range(n) for e in range(k)])
        eng.record_hook_times()
        eng.decode(list(range(1, 40)))
        assert len(eng.hook_times) == len(eng.facts.moe_layers)  # every layer on the route op, the last too
        eng.decode([5])
        assert len(eng.hook_times) == len(eng.facts.moe_layers)  # and the decode step on none
