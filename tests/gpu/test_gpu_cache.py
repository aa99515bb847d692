"""GPU tier: the expert cache on the GPU's copy stream, with and without the copy queue.

On a GPU the cache's slots live in VRAM and the experts' other copy in pinned host memory; greedy decoding
with any cache configuration must give the tokens that every expert in host memory gives (the same
matmuls on other buffers: the tokens, not the logits' last bits, are compared).
"""

from __future__ import annotations

import pytest

from ggmoe.cache import CacheConfig
from ggmoe.cache.copy import StreamCopyBackend
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from tools.fixtures.make_fixtures import fixture_path

PROMPT = "The expert cache keeps the experts a model uses most on the device"

# (label, cache config from n_slots and the decode mode, whether the copy queue runs, decode modes). The mode
# is named, never auto: auto weighs the machine, and each path must be covered whatever it picks (the H200
# loan of 2026-11-26 aborted in "prefetch in background", F16 experts, which auto ran sync: its cause was
# lost with pytest's captured stderr; the GPU tests now run uncaptured)
CONFIGS = [
    ("lru", lambda n, m: RunConfig(CacheConfig(n_slots=n),
                                   decode=DecodeConfig(mode=m)), False, ("sync", "async")),
    ("prefetch, wait", lambda n, m: RunConfig(CacheConfig(n_slots=n),
                                              decode=DecodeConfig(mode=m),
                                              prefetch=PrefetchConfig("reuse", stride=1)), True, ("sync", "async")),
    ("prefetch, cpu", lambda n, m: RunConfig(CacheConfig(n_slots=n),
                                             decode=DecodeConfig(mode=m, miss_policy="cpu"),
                                             prefetch=PrefetchConfig("reuse", stride=1)), True, ("sync",)),
    ("prefetch in background", lambda n, m: RunConfig(CacheConfig(n_slots=n),
                                                      decode=DecodeConfig(mode=m),
                                                      prefetch=PrefetchConfig(
        "reuse", stride=1, background=True)), True, ("sync", "async")),
]
CASES = [(label, make, queued, mode) for label, make, queued, modes in CONFIGS for mode in modes]


@pytest.mark.parametrize(("label", "make", "queued", "mode"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_gpu_cache_tokens_equal_host_experts(label, make, queued, mode):
    # the async decode reads expert tables with MMVQ: quantized experts (F16 has no MMVQ kernel)
    path = fixture_path("qwen3moe", expert_type="q8_0" if mode == "async" else "f16")
    facts = inspect_model(path)
    with Engine(EngineConfig(model_path=path, n_ctx=256)) as eng:
        want = eng.generate(PROMPT, 24).token_ids
    cfg = EngineConfig(model_path=path, n_ctx=256, run=make(facts.n_expert_used + 1, mode))
    with Engine(cfg) as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == mode
        assert isinstance(eng._runtime.copies, StreamCopyBackend) == queued
        got = eng.generate(PROMPT, 24).token_ids
        st = eng.cache_stats.total()
    assert got == want, (label, mode)
    assert st.misses > 0  # the cache really copied
