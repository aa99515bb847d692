"""The real-shape writer's toy preset through the engine: loads, reads back its shape, generates."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.cache import CacheConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from tools.gpu.realshape import PRESETS, write_model


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path, nbytes, _ = write_model("toy", tmp_path_factory.mktemp("rs") / "toy.gguf", seed=1)
    assert nbytes == path.stat().st_size
    return path


def test_toy_reads_back_its_shape(toy):
    facts = inspect_model(toy)
    s = PRESETS["toy"].shape
    assert (facts.arch, facts.n_layer, facts.n_embd, facts.n_expert, facts.n_expert_used, facts.n_ff_exp) == (
        "qwen3moe", s.n_layer, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp)
    assert facts.moe_layers == tuple(range(s.n_layer))
    assert dict(facts.ggml_types)["Q4_K"] == 3 * s.n_layer  # gate, up, down experts of every layer


@pytest.mark.parametrize("cache", [None, RunConfig(CacheConfig(n_slots=8))], ids=["plain", "cache"])
def test_toy_generates(toy, cache):
    with Engine(EngineConfig(model_path=toy, n_ctx=128, n_threads=1, run=cache)) as eng:
        logits = eng.decode([1, 2, 3, 4], all_logits=True)
        g = eng.generate("hello experts", max_tokens=6, temp=1.0, seed=0)
    assert np.isfinite(logits).all() and logits.std() > 0.1  # not a constant: the weights are not all zero
    assert len(g.token_ids) == 6 or g.stopped_on_eog
    assert g.timings.decode_tokens >= 1


def test_real_shape_presets():
    g, q = PRESETS["gpt-oss-20b"].shape, PRESETS["qwen3-30b-a3b"].shape
    assert (g.n_layer, g.n_embd, g.n_expert, g.n_ff_exp, g.n_expert_used) == (24, 2880, 32, 2880, 4)
    assert (q.n_layer, q.n_embd, q.n_expert, q.n_ff_exp, q.n_expert_used) == (48, 2048, 128, 768, 8)
