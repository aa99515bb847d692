"""GPU tier: the expert cache on the GPU's copy stream, with and without the copy queue.

On a GPU the cache's slots live in VRAM and the experts' other copy in pinned host memory; greedy decoding
with any cache configuration must give the tokens that every expert in host memory gives (the same
matmuls on other buffers: the tokens, not the logits' last bits, are compared).
"""

from __future__ import annotations

import pytest
from make_fixtures import fixture_path

from ggmoe.cache import CacheConfig
from ggmoe.cache.copy import StreamCopyBackend
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model

PROMPT = "The expert cache keeps the experts a model uses most on the device"

CONFIGS = [  # (label, cache config from n_slots, whether the copy queue runs)
    ("lru", lambda n: CacheConfig(n_slots=n), False),
    ("prefetch, wait", lambda n: CacheConfig(n_slots=n, prefetch=PrefetchConfig("reuse", stride=1)), True),
    ("prefetch, cpu", lambda n: CacheConfig(n_slots=n, miss_policy="cpu",
                                            prefetch=PrefetchConfig("reuse", stride=1)), True),
    ("prefetch in background", lambda n: CacheConfig(n_slots=n, prefetch=PrefetchConfig(
        "reuse", stride=1, background=True)), True),
]


@pytest.mark.parametrize(("label", "make", "queued"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_gpu_cache_tokens_equal_host_experts(label, make, queued):
    path = fixture_path("qwen3moe")
    facts = inspect_model(path)
    with Engine(EngineConfig(model_path=path, n_ctx=256)) as eng:
        want = eng.generate(PROMPT, 24).token_ids
    cfg = EngineConfig(model_path=path, n_ctx=256, cache=make(facts.n_expert_used + 1))
    with Engine(cfg) as eng:
        assert isinstance(eng._runtime.copies, StreamCopyBackend) == queued
        got = eng.generate(PROMPT, 24).token_ids
        st = eng.cache_stats.total()
    assert got == want, label
    assert st.misses > 0  # the cache really copied
