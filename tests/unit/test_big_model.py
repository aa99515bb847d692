"""tools/fixtures/big_model.py: a random-weight model of the size asked, the shape asked, written once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ggmoe.inspect import inspect_model
from tools.fixtures.big_model import big_preset, ensure_model

pytestmark = pytest.mark.unit
SIZE = 50_000_000  # bytes: the toy shape's 13 MB layers, four of them


def test_the_32_gib_default_is_qwen3_30b_a3b_with_53_layers_and_scaled_residual_branches() -> None:
    p = big_preset(32 << 30)
    assert (p.shape.n_layer, p.shape.n_embd, p.shape.n_expert, p.shape.n_expert_used) == (53, 2048, 128, 8)
    assert p.residual_std == pytest.approx(1 / math.sqrt(2 * 53))


def test_a_small_model_has_the_size_and_shape_asked_and_is_written_once(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    rec, written = ensure_model(path, SIZE, base="toy", expert_type="q8_0", quiet=True)
    assert written
    facts = inspect_model(path)
    assert (facts.arch, facts.n_layer, facts.n_expert, facts.n_expert_used) == ("qwen3moe", 4, 32, 4)
    assert facts.n_layer == rec["n_layer"] and facts.n_ff_exp == 512
    assert abs(facts.file_bytes - SIZE) < 0.15 * SIZE  # whole layers: the nearest count of them
    assert facts.expert_bytes / facts.file_bytes > 0.95
    assert dict(facts.ggml_types)["Q8_0"] >= 3 * facts.n_layer
    mtime = path.stat().st_mtime_ns
    again, written = ensure_model(path, SIZE, base="toy", expert_type="q8_0", quiet=True)
    assert not written and again == rec and path.stat().st_mtime_ns == mtime
    side = json.loads(path.with_name(path.name + ".json").read_text())
    assert side["bytes"] == path.stat().st_size and side["seed"] == 0


def test_other_arguments_or_a_cut_file_write_again(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    ensure_model(path, SIZE, base="toy", quiet=True)
    first = path.read_bytes()
    assert not ensure_model(path, SIZE, base="toy", quiet=True)[1]
    assert ensure_model(path, SIZE, base="toy", seed=1, quiet=True)[1]  # another seed: other weights
    assert path.read_bytes() != first
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    assert ensure_model(path, SIZE, base="toy", seed=1, quiet=True)[1]
