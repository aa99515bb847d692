"""Every fixture loads and generates in llama.cpp, and llama.cpp's facts match ggmoe.inspect."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from ggmoe.inspect import inspect_model
from tools.fixtures import make_fixtures

pytestmark = pytest.mark.engine

EXPERT_TYPES = ("f16", "q8_0")
N_CTX = 256  # tokens


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fixtures")


@contextmanager
def loaded_model(path: Path) -> Iterator[llama_cpp.llama_model_p]:
    """A llama.cpp model through the low-level API (weights mmapped, CPU), freed on exit."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp failed to load {path}"
    try:
        yield model
    finally:
        llama_cpp.llama_model_free(model)


def meta_str(model: llama_cpp.llama_model_p, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, ctypes.sizeof(buf))
    return buf.value.decode() if n >= 0 else None


@pytest.mark.parametrize("expert_type", EXPERT_TYPES)
@pytest.mark.parametrize("arch", make_fixtures.ARCHES)
def test_llama_cpp_facts_match_inspect(fixture_dir: Path, arch: str, expert_type: str) -> None:
    path = make_fixtures.fixture_path(arch, fixture_dir, expert_type=expert_type)
    facts = inspect_model(path)
    with loaded_model(path) as model:
        assert llama_cpp.llama_model_n_layer(model) == facts.n_layer
        assert llama_cpp.llama_model_n_embd(model) == facts.n_embd
        assert meta_str(model, gguf.Keys.General.ARCHITECTURE) == facts.arch
        assert meta_str(model, gguf.Keys.LLM.EXPERT_COUNT.format(arch=facts.arch)) == str(facts.n_expert)
        assert meta_str(model, gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=facts.arch)) == str(
            facts.n_expert_used
        )
        # llama.cpp's weight bytes (sum of ggml_nbytes over the file's tensors) = experts + dense.
        assert llama_cpp.llama_model_size(model) == facts.expert_bytes + facts.dense_bytes
        vocab = llama_cpp.llama_model_get_vocab(model)
        assert llama_cpp.llama_vocab_n_tokens(vocab) == make_fixtures.make_vocab().n_vocab


@pytest.mark.parametrize("expert_type", EXPERT_TYPES)
@pytest.mark.parametrize("arch", make_fixtures.ARCHES)
def test_fixture_generates(fixture_dir: Path, arch: str, expert_type: str) -> None:
    llm = llama_cpp.Llama(
        model_path=str(make_fixtures.fixture_path(arch, fixture_dir, expert_type=expert_type)),
        n_ctx=N_CTX,
        n_threads=2,
        logits_all=True,
        verbose=False,
    )
    text = b"hello the world\nis on"
    tokens = llm.tokenize(text, add_bos=False)
    assert llm.detokenize(tokens) == text
    assert len(tokens) < len(text)  # merges apply ("the", "is", "on")
    llm.eval(tokens)
    logits = np.asarray(llm.scores[: llm.n_tokens])  # [n_tokens, n_vocab]
    assert np.isfinite(logits).all()
    assert 0.05 < float(logits.std()) < 50.0  # neither dead nor exploding activations
    out = llm.create_completion("the cat", max_tokens=6, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


def test_q8_0_experts_change_logits_only_slightly(fixture_dir: Path) -> None:
    """Same seeded weights, experts stored as F16 vs Q8_0: close but not identical logits."""
    logits = []
    for expert_type in EXPERT_TYPES:
        llm = llama_cpp.Llama(
            model_path=str(make_fixtures.fixture_path("qwen3moe", fixture_dir, expert_type=expert_type)),
            n_ctx=N_CTX,
            n_threads=2,
            logits_all=True,
            verbose=False,
        )
        llm.eval(llm.tokenize(b"the quick brown fox"))
        logits.append(np.asarray(llm.scores[: llm.n_tokens]).copy())
    diff = np.abs(logits[0] - logits[1])
    # Quantization error is small, but it may flip a near-tie in routing for a token,
    # so bound the typical difference, not the largest one.
    assert 0.0 < float(np.median(diff)) < 0.02
    assert np.corrcoef(logits[0].ravel(), logits[1].ravel())[0, 1] > 0.999


def test_dense_fixture_loads_without_experts(fixture_dir: Path) -> None:
    with loaded_model(make_fixtures.dense_fixture_path(fixture_dir)) as model:
        assert llama_cpp.llama_model_n_layer(model) == make_fixtures.SHAPE.n_layer
        assert meta_str(model, gguf.Keys.LLM.EXPERT_COUNT.format(arch="llama")) is None


def test_split_fixture_loads_and_matches_inspect(tmp_path: Path) -> None:
    first = make_fixtures.write_fixture(
        "qwen2moe", tmp_path / "m.gguf", expert_type="q8_0", split_max_tensors=25
    )
    facts = inspect_model(first)
    with loaded_model(first) as model:
        assert llama_cpp.llama_model_size(model) == facts.expert_bytes + facts.dense_bytes
        assert llama_cpp.llama_model_n_layer(model) == facts.n_layer
