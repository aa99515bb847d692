"""Loading: llama.cpp's reason in the error, its log on stderr only when verbose, placement from buffers."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ggmoe.base.errors import EngineError, ModelFileError
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import engine as engine_mod
from ggmoe.engine import patch as _patched
from ggmoe.inspect import inspect_model
from tools.fixtures.make_fixtures import rewrite_gguf


@pytest.fixture(scope="module")
def no_output_norm(qwen3moe_model, tmp_path_factory):
    """The qwen3moe fixture without ``output_norm.weight``: the inspector accepts it, llama.cpp does not."""
    dst = tmp_path_factory.mktemp("models") / "no-output-norm.gguf"
    return rewrite_gguf(qwen3moe_model, dst, tensors=lambda by: (
        (n, np.asarray(t.data), t.tensor_type) for n, t in by.items() if n != "output_norm.weight"))


def test_a_load_failure_says_llama_cpps_reason_and_prints_nothing(no_output_norm, capfd):
    inspect_model(no_output_norm)  # valid for the inspector: the failure is llama.cpp's
    with pytest.raises(ModelFileError, match=r"could not load .*output_norm\.weight.* not found"):
        Engine(EngineConfig(model_path=no_output_norm, n_ctx=64))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_llama_cpp_log_reaches_stderr_only_when_verbose(qwen3moe_model, capfd):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)) as eng:
        eng.decode(eng.tokenize("hi"))
    assert capfd.readouterr().err == ""
    try:
        with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64, verbose=True)) as eng:
            eng.decode(eng.tokenize("hi"))
        assert "llama_model_loader" in capfd.readouterr().err
    finally:
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)).close()  # quiet again for later tests


def test_expert_buffers_name_every_expert_tensor(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    every = {t.name for layer in facts.layers for t in layer.tensors}
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)) as eng:
        assert set(eng.expert_buffers) == every
        assert set(eng.expert_buffers.values()) == {"CPU"}  # the CPU build's host buffer type


def test_a_misplaced_expert_tensor_is_an_error(qwen3moe_model, monkeypatch):
    real = engine_mod.expert_placement

    def one_on_the_gpu(model, facts):
        placement = real(model, facts)
        placement[next(iter(placement))] = "CUDA0"
        return placement

    monkeypatch.setattr(engine_mod, "expert_placement", one_on_the_gpu)
    with pytest.raises(EngineError, match="1 expert tensors are not in CPU"):
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64))


def test_placement_is_unknown_on_a_stock_build(qwen3moe_model, monkeypatch):
    monkeypatch.setattr(_patched, "_loaded", None)
    monkeypatch.setattr(_patched, "_libllama", lambda: ctypes.CDLL(None))  # no llama_ggmoe_* symbols
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64)) as eng:
        assert eng.expert_buffers is None and eng.host_expert_tensors == ()
