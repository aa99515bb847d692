"""Real quant types through the cache: Q4_K and MXFP4 experts (the real-shape writer's toy presets).

On a CPU-only build llama.cpp would repack such weights into its CPU_REPACK buffer, whose layout slot
copies cannot read; the engine keeps the GGUF layout, and every cache configuration must give exactly
the logits of the same model run without the hook.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from tools.gpu.realshape import write_model

TOKENS = [1, 5, 9, 200, 33, 7, 120, 64, 2, 90]


@pytest.fixture(scope="module", params=["toy", "toy-mxfp4"])
def model(request, tmp_path_factory):
    path, _, _ = write_model(request.param, tmp_path_factory.mktemp("rs") / f"{request.param}.gguf")
    return path


def logits(path: Path, cache: CacheConfig | None, gate_hook: bool = True) -> np.ndarray:
    with Engine(EngineConfig(model_path=path, n_ctx=64, run=cache, gate_hook=gate_hook)) as eng:
        rows = [eng.decode(TOKENS[:4], all_logits=True)]
        rows += [eng.decode([t]) for t in TOKENS[4:]]
        expert_buffers = eng.expert_buffers
    assert expert_buffers is None or set(expert_buffers.values()) <= {"CPU", "CUDA_Host"}
    return np.concatenate(rows, axis=0)


HALF = dict.fromkeys(range(4), 0.5)  # MoEpic's split at θ 1/2: a whole number of Q4_K (512) and MXFP4 (320) blocks


@pytest.mark.parametrize("cache", [
    RunConfig(CacheConfig(n_slots=32)), RunConfig(CacheConfig(n_slots=4)), RunConfig(CacheConfig(n_slots=6,
                          policy="lfu")),
    RunConfig(CacheConfig(n_slots=6), decode=DecodeConfig(miss_policy="cpu")),
    RunConfig(CacheConfig(n_slots=8, layer_theta=HALF), decode=DecodeConfig(mode="sync")),
    RunConfig(CacheConfig(n_slots=8, layer_theta=HALF), decode=DecodeConfig(mode="async")),
], ids=["all", "top-k", "lfu", "host-path", "split-sync", "split-async"])
def test_cache_gives_the_logits_of_the_plain_model(model, cache):
    ref = logits(model, None, gate_hook=False)
    assert np.isfinite(ref).all() and ref.std() > 0
    assert np.array_equal(logits(model, cache), ref)
