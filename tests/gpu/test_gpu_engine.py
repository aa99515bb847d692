"""GPU tier (CUDA build): dense layers on the GPU, experts in pinned host memory."""

from __future__ import annotations

import pytest

from ggmoe.engine import Engine, EngineConfig, gpu_device_name
from ggmoe.engine.verify import check_hook
from ggmoe.inspect import inspect_model
from ggmoe.inspect.router import load_routers
from tools.fixtures.make_fixtures import ARCHES, fixture_path


@pytest.mark.parametrize("arch", ARCHES)
def test_gpu_engine_hook_and_generation(arch):
    assert gpu_device_name() is not None
    path = fixture_path(arch)
    facts = inspect_model(path)
    with Engine(EngineConfig(model_path=path, n_ctx=256, n_gpu_layers=-1)) as eng:
        assert eng.host_expert_tensors  # experts stayed host-side (pinned buffer type)
        gen = eng.generate("hello world", 8)
        assert gen.token_ids or gen.stopped_on_eog
        res = check_hook(eng, load_routers(path), eng.tokenize("The quick brown fox"), facts.n_expert_used)
    assert res.ok, res
