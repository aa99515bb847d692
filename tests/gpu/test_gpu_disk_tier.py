"""GPU tier: the disk tier under the GPU's slots. Experts stay in the GGUF; the host tier's pinned slots are
read from it with O_DIRECT and copied to VRAM on the copy stream. Greedy tokens equal those of every expert
in host memory; the async decode, whose kernels would read an expert that only the file holds, is refused."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.tiers import TierConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from tools.fixtures.make_fixtures import fixture_path

PROMPT = "The expert cache keeps the experts a model uses most on the device"


@pytest.mark.parametrize("prefetch", [None, PrefetchConfig("reuse", stride=1)], ids=["lru", "prefetch"])
def test_gpu_disk_tier_tokens_equal_host_experts(prefetch):
    path = fixture_path("qwen3moe", expert_type="q8_0")
    facts = inspect_model(path)
    with Engine(EngineConfig(model_path=path, n_ctx=256)) as eng:
        want = eng.generate(PROMPT, 24).token_ids
    cache = RunConfig(CacheConfig(n_slots=facts.n_expert_used),
                      tiers=TierConfig(host_ram=(facts.n_expert // 2) * facts.expert_bytes_per_slot),
                      prefetch=prefetch)
    with Engine(EngineConfig(model_path=path, n_ctx=256, run=cache)) as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "sync"
        got = eng.generate(PROMPT, 24).token_ids
        tier = eng.report()["host_tier"]
    assert got == want
    assert tier["reads"] > 0


def test_gpu_async_decode_is_refused_under_a_disk_tier():
    path = fixture_path("qwen3moe", expert_type="q8_0")
    facts = inspect_model(path)
    cache = RunConfig(CacheConfig(n_slots=facts.n_expert_used),
                      decode=DecodeConfig(mode="async"),
                      tiers=TierConfig(host_ram=facts.n_expert_used * facts.expert_bytes_per_slot))
    with pytest.raises(UsageError, match="disk tier"):
        Engine(EngineConfig(model_path=path, n_ctx=256, run=cache))
