"""Hyperparameters llama.cpp aborts on (or hangs with): rejected before llama.cpp sees the file.

Each case copies a real fixture model with one header value changed and runs
``inspect``, ``run``, ``trace`` and ``verify-hook`` on it in a subprocess.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from conftest import assert_clean_error, run_ggmoe

from tools.fixtures.make_fixtures import fixture_path, rewrite_gguf

pytestmark = pytest.mark.badinput

VT = gguf.GGUFValueType
A = "qwen3moe"  # the fixture: 4 layers, 8 experts, top-2, n_embd 64

# case -> {key: (value, value type, array item type)}; None deletes the key
MODEL_CASES: dict[str, dict[str, tuple]] = {
    "expert_used_count 0": {f"{A}.expert_used_count": (0, VT.UINT32, None)},
    "expert_used_count 9 > expert_count": {f"{A}.expert_used_count": (9, VT.UINT32, None)},
    "expert_used_count u32 max": {f"{A}.expert_used_count": (2**32 - 1, VT.UINT32, None)},
    "expert_used_count array with 0": {f"{A}.expert_used_count": ([2, 2, 0, 2], VT.ARRAY, VT.UINT32)},
    "expert_used_count array with 9": {f"{A}.expert_used_count": ([2, 9, 2, 2], VT.ARRAY, VT.UINT32)},
    "expert_used_count array too short": {f"{A}.expert_used_count": ([2, 2, 2], VT.ARRAY, VT.UINT32)},
    "expert_used_count array too long": {f"{A}.expert_used_count": ([2] * 5, VT.ARRAY, VT.UINT32)},
    "expert_used_count string": {f"{A}.expert_used_count": ("2", VT.STRING, None)},
    "expert_count 0": {f"{A}.expert_count": (0, VT.UINT32, None)},
    "expert_count 7 (tensors have 8)": {f"{A}.expert_count": (7, VT.UINT32, None)},
    "expert_count 2**31": {f"{A}.expert_count": (2**31, VT.UINT32, None)},
    "expert_count float": {f"{A}.expert_count": (8.0, VT.FLOAT32, None)},
    "block_count 0": {f"{A}.block_count": (0, VT.UINT32, None)},
    "block_count 3 (tensors of 4)": {f"{A}.block_count": (3, VT.UINT32, None)},
    "block_count 5 (tensors of 4)": {f"{A}.block_count": (5, VT.UINT32, None)},
    "block_count 2**31": {f"{A}.block_count": (2**31, VT.UINT32, None)},
    "block_count u32 max": {f"{A}.block_count": (2**32 - 1, VT.UINT32, None)},
    "block_count string": {f"{A}.block_count": ("4", VT.STRING, None)},
    "block_count missing": {f"{A}.block_count": None},
    "embedding_length 0": {f"{A}.embedding_length": (0, VT.UINT32, None)},
    "embedding_length 63": {f"{A}.embedding_length": (63, VT.UINT32, None)},
    "embedding_length 2**31": {f"{A}.embedding_length": (2**31, VT.UINT32, None)},
    "head_count 0": {f"{A}.attention.head_count": (0, VT.UINT32, None)},
    "head_count_kv 0": {f"{A}.attention.head_count_kv": (0, VT.UINT32, None)},
    "head_count array with a wrong length": {f"{A}.attention.head_count": ([4, 4], VT.ARRAY, VT.UINT32)},
    "context_length 0": {f"{A}.context_length": (0, VT.UINT32, None)},
    "context_length u32 max": {f"{A}.context_length": (2**32 - 1, VT.UINT32, None)},
    "expert_group_count 3 (8 experts)": {f"{A}.expert_group_count": (3, VT.UINT32, None),
                                         f"{A}.expert_group_used_count": (1, VT.UINT32, None)},
    "expert_group_count 8 = expert_count": {f"{A}.expert_group_count": (8, VT.UINT32, None),
                                            f"{A}.expert_group_used_count": (1, VT.UINT32, None)},
    "expert_group_used_count 0 of 4 groups": {f"{A}.expert_group_count": (4, VT.UINT32, None)},
    "expert_group_used_count 4 of 4 groups": {f"{A}.expert_group_count": (4, VT.UINT32, None),
                                              f"{A}.expert_group_used_count": (4, VT.UINT32, None)},
    "architecture missing": {"general.architecture": None},
    "architecture not MoE": {"general.architecture": ("gpt2", VT.STRING, None)},
}


def rewrite(src: Path, dst: Path, changes: dict[str, tuple | None]) -> Path:
    """A copy of a GGUF with some keys replaced or deleted (tensors unchanged)."""
    return rewrite_gguf(src, dst, changes)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad-models")
    src = fixture_path(A)
    return {name: rewrite(src, d / f"m{i}.gguf", ch) for i, (name, ch) in enumerate(MODEL_CASES.items())}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return p


def test_the_rewriter_keeps_a_good_model_good(tmp_path):
    good = rewrite(fixture_path(A), tmp_path / "same.gguf", {})
    out = run_ggmoe("run", str(good), "-p", "hi", "-n", "2")
    assert out.code == 0, out.stderr[-1500:]


COMMANDS = {
    "inspect": lambda m, p, o: ("inspect", str(m)),
    "run": lambda m, p, o: ("run", str(m), "-p", "hello", "-n", "2"),
    "trace": lambda m, p, o: ("trace", str(m), "--prompts", str(p), "-o", str(o), "--max-tokens", "2"),
    "verify-hook": lambda m, p, o: ("verify-hook", str(m)),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_gives_one_clean_error(case, command, bad_models, prompts, tmp_path):
    out_dir = tmp_path / "out"
    res = run_ggmoe(*COMMANDS[command](bad_models[case], prompts, out_dir), timeout=30)
    assert_clean_error(res)
    assert not out_dir.exists() or not any(out_dir.iterdir())  # nothing written
