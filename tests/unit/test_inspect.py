"""ggmoe.inspect: MoE facts from fixture headers, and fast rejection of bad files."""

from __future__ import annotations

import json
import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggmoe.base.errors import ModelFileError, UsageError
from ggmoe.cache.config import slots_for_budget
from ggmoe.inspect import inspect_model
from ggmoe.inspect.names import EXPERT_TENSOR_PATTERN, expert_pattern, is_cached_expert_tensor
from tools.fixtures import make_fixtures

pytestmark = pytest.mark.unit

VT = gguf.GGUFValueType
SHAPE = make_fixtures.SHAPE

# One expert's bytes per tensor for [n_embd=64, n_ff_exp=32] by expert type, computed by hand:
# f16: 64*32 elements * 2 bytes; f32: * 4 bytes; q8_0: 64*32/32 blocks * 34 bytes per block.
BYTES_PER_EXPERT_TENSOR = {"f16": 4096, "f32": 8192, "q8_0": 2176}
EXPERT_KINDS = ("ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight")

# (fixture, file arch, n_expert_shared, MoE layers, dense bytes computed by hand for n_vocab=270, n_embd=64,
# 4 layers; all dense tensors are F32)
N_VOCAB = 270
_GLOBAL = (64 * N_VOCAB * 2 + 64) * 4  # token_embd + output (F32) + output_norm
_ATTN_GQA = (64 * 64 + 2 * 64 * 32 + 64 * 64 + 64) * 4  # q, k, v (2 kv heads of 16), o, attn_norm
_ATTN_MHA = (4 * 64 * 64 + 64) * 4  # olmoe: n_head_kv == n_head
_FFN_COMMON = (64 + 64 * 8) * 4  # ffn_norm + ffn_gate_inp router
_QWEN3_QK_NORM = 2 * 16 * 4
_OLMOE_QK_NORM = 2 * 64 * 4
_QWEN2_QKV_BIAS = (64 + 32 + 32) * 4
_QWEN2_SHEXP = (64 + 3 * 64 * 64) * 4  # gate_inp_shexp + gate/up/down_shexp (width 64)
# deepseek2 MLA: attn_norm, q_a_norm, kv_a_norm, q_a [64,32], q_b [32,4*24], kv_a_mqa [64,32+8],
# k_b [16,32,4], v_b [32,16,4], attn_output [4*16,64]
_ATTN_MLA = (64 + 32 + 32 + 64 * 32 + 32 * 96 + 64 * 40 + 16 * 32 * 4 + 32 * 16 * 4 + 64 * 64) * 4
_DS2_DENSE_FFN = (64 + 3 * 64 * 128) * 4  # layer 0: ffn_norm + gate/up/down (n_ff 128)
_DS2_MOE_EXTRA = (8 + 3 * 64 * 32) * 4  # exp_probs_b + one shared expert of width 32
# gpt-oss: q/k/v biases, attn_output bias, attention sinks (one per head), post_attention_norm (its FFN
# norm, no ffn_norm), router with its bias; per-expert biases are expert tensors the cache does not hold
_GPTOSS_ATTN = _ATTN_GQA + (64 + 32 + 32 + 64 + 4 + 64) * 4
_GPTOSS_FFN = (64 * 8 + 8) * 4
GPTOSS_DEVICE_BYTES = (32 + 32 + 64) * 8 * 4  # per layer: gate/up/down expert biases, F32, all 8 experts
# glm4moe: q/k/v biases and post_attention_norm (the FFN norm of every layer, no ffn_norm); layer 0 a dense FFN
_GLM_ATTN = _ATTN_GQA + _QWEN2_QKV_BIAS + 64 * 4
_GLM_DENSE_FFN = 3 * 64 * 128 * 4
_GLM_MOE = 64 * 8 * 4 + _DS2_MOE_EXTRA  # router, exp_probs_b, shared expert
# llama4: MoE on layers 1 and 3 (router, ffn_norm, a shared expert of width 32), dense FFNs on 0 and 2
_LLAMA4_MOE = _FFN_COMMON + 3 * 64 * 32 * 4
ALL_MOE = (0, 1, 2, 3)
CASES = [
    ("qwen3moe", "qwen3moe", 0, ALL_MOE, _GLOBAL + 4 * (_ATTN_GQA + _FFN_COMMON + _QWEN3_QK_NORM)),
    (
        "qwen2moe",
        "qwen2moe",
        1,
        ALL_MOE,
        _GLOBAL + 4 * (_ATTN_GQA + _FFN_COMMON + _QWEN2_QKV_BIAS + _QWEN2_SHEXP),
    ),
    ("olmoe", "olmoe", 0, ALL_MOE, _GLOBAL + 4 * (_ATTN_MHA + _FFN_COMMON + _OLMOE_QK_NORM)),
    ("mixtral", "llama", 0, ALL_MOE, _GLOBAL + 4 * (_ATTN_GQA + _FFN_COMMON)),
    (
        "deepseek2",
        "deepseek2",
        1,
        (1, 2, 3),
        _GLOBAL + 4 * _ATTN_MLA + _DS2_DENSE_FFN + 3 * (_FFN_COMMON + _DS2_MOE_EXTRA),
    ),
    ("gptoss", "gpt-oss", 0, ALL_MOE, _GLOBAL + 4 * (_GPTOSS_ATTN + _GPTOSS_FFN)),
    ("glm4moe", "glm4moe", 1, (1, 2, 3), _GLOBAL + 4 * _GLM_ATTN + _GLM_DENSE_FFN + 3 * _GLM_MOE),
    ("deepseek3", "deepseek2", 1, (1, 2, 3),
     _GLOBAL + 4 * _ATTN_MLA + _DS2_DENSE_FFN + 3 * (_FFN_COMMON + _DS2_MOE_EXTRA)),
    ("ernie45", "ernie4_5-moe", 1, (1, 2, 3),
     _GLOBAL + 4 * _ATTN_GQA + _DS2_DENSE_FFN + 3 * (_FFN_COMMON + (8 + 3 * 64 * 64) * 4)),
    ("llama4", "llama4", 1, (1, 3), _GLOBAL + 4 * _ATTN_GQA + 2 * _DS2_DENSE_FFN + 2 * _LLAMA4_MOE),
]
# top-k per fixture (Llama 4 routes top-1)
TOP_K = {"llama4": 1}
CASE_IDS = [case[0] for case in CASES]


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fixtures")


def test_arches_are_all_tested() -> None:
    assert set(make_fixtures.ARCHES) == {case[0] for case in CASES}


@pytest.mark.parametrize("expert_type", ["f16", "q8_0", "f32"])
@pytest.mark.parametrize(("fixture", "arch", "n_shared", "moe_layers", "dense_bytes"), CASES, ids=CASE_IDS)
def test_facts_of_fixture(
    fixture_dir: Path,
    fixture: str,
    arch: str,
    n_shared: int,
    moe_layers: tuple[int, ...],
    dense_bytes: int,
    expert_type: str,
) -> None:
    path = make_fixtures.fixture_path(fixture, fixture_dir, expert_type=expert_type)
    facts = inspect_model(path)

    assert facts.arch == arch
    k = TOP_K.get(fixture, 2)
    assert (facts.n_layer, facts.n_expert, facts.n_expert_used) == (4, 8, k)
    assert (facts.n_embd, facts.n_ff_exp, facts.n_expert_shared) == (64, 32, n_shared)
    assert facts.moe_layers == moe_layers
    assert facts.dense_layers == tuple(il for il in range(4) if il not in moe_layers)
    n_moe = len(moe_layers)
    per_tensor = BYTES_PER_EXPERT_TENSOR[expert_type]
    device = GPTOSS_DEVICE_BYTES if fixture == "gptoss" else 0  # expert biases: on the device, not cached
    for layer in facts.layers:
        assert tuple(t.kind for t in layer.cached) == EXPERT_KINDS  # the weights; biases never cached
        assert [t.bytes_per_expert for t in layer.cached] == [per_tensor] * 3
        assert layer.tensor("ffn_up_exps.weight").shape == (64, 32, 8)
        assert layer.tensor("ffn_down_exps.weight").shape == (32, 64, 8)
        assert layer.bytes_per_expert == 3 * per_tensor
        assert facts.bytes_per_expert(layer.il) == 3 * per_tensor
        assert layer.device_bytes == device
    assert facts.expert_bytes == n_moe * (8 * 3 * per_tensor + device)
    assert facts.dense_bytes == dense_bytes
    assert facts.vram_bytes(0) == dense_bytes + n_moe * device
    assert facts.vram_bytes(2) == dense_bytes + n_moe * device + 2 * n_moe * 3 * per_tensor
    assert facts.vram_bytes(8) == dense_bytes + facts.expert_bytes
    # --vram of exactly N slots buys N slots (budgets count the bytes the cache holds)
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    assert set(slots_for_budget(facts.cache_bytes(4), bpe, 8, k).values()) == {4}


@pytest.mark.parametrize(("name", "cached"), [
    ("blk.0.ffn_up_exps.weight", True), ("blk.12.ffn_gate_up_exps.weight", True),
    ("blk.3.ffn_down_exps.weight", True), ("blk.0.ffn_up_exps.bias", False), ("blk.0.ffn_down_exps.scale", False),
    ("blk.0.ffn_up_shexp.weight", False), ("blk.0.ffn_gate_inp.weight", False), ("blk.0.ffn_up_exps.weight.x", False),
])
def test_one_rule_says_what_the_cache_holds(name: str, cached: bool) -> None:
    """Expert weights go to host memory (the override pattern) and into the cache; biases and scales stay on the
    device, so a layer's graph splits no more than stock's."""
    assert is_cached_expert_tensor(name) == cached
    assert (re.search(EXPERT_TENSOR_PATTERN, name) is not None) == cached
    assert (re.search(expert_pattern((0, 3, 12)), name) is not None) == cached


@pytest.mark.parametrize("fixture", CASE_IDS)
def test_expert_offsets_match_gguf_reader(fixture_dir: Path, fixture: str) -> None:
    """The bounded parser finds the same data offsets and sizes as gguf.GGUFReader on a good file."""
    path = make_fixtures.fixture_path(fixture, fixture_dir, expert_type="q8_0")
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    facts = inspect_model(path)
    for layer in facts.layers:
        for t in layer.tensors:
            assert (t.data_offset, t.nbytes) == (reader[t.name].data_offset, reader[t.name].n_bytes)
            assert t.ggml_type == reader[t.name].tensor_type.name
    assert facts.expert_bytes + facts.dense_bytes == sum(int(t.n_bytes) for t in reader.values())


def test_to_dict_is_json_and_render_text_mentions_facts(fixture_dir: Path) -> None:
    facts = inspect_model(make_fixtures.fixture_path("qwen2moe", fixture_dir, expert_type="q8_0"))
    d = json.loads(json.dumps(facts.to_dict()))
    assert d["n_expert"] == 8 and d["moe_layers"] == [0, 1, 2, 3]
    assert d["layers"][0]["tensors"]["ffn_up_exps.weight"] == {
        "type": "Q8_0",
        "shape": [64, 32, 8],
        "bytes_per_expert": 2176,
    }
    assert d["vram_bytes"]["n_expert_used"] == facts.vram_bytes(2)
    text = facts.render_text()
    for needle in ("qwen2moe", "top-2", "1 shared", "Q8_0", "6,528 B", "ffn_down_exps.weight"):
        assert needle in text


def test_vram_bytes_rejects_bad_slot_counts(fixture_dir: Path) -> None:
    facts = inspect_model(make_fixtures.fixture_path("olmoe", fixture_dir))
    for n_slots in (-1, 9):
        with pytest.raises(UsageError):
            facts.vram_bytes(n_slots)


def test_split_model_is_read_across_shards(tmp_path: Path, fixture_dir: Path) -> None:
    first = make_fixtures.write_fixture("qwen3moe", tmp_path / "m.gguf", split_max_tensors=20)
    assert first.name == "m-00001-of-00003.gguf"
    split = inspect_model(first)
    whole = inspect_model(make_fixtures.fixture_path("qwen3moe", fixture_dir))
    assert (split.n_tensors, split.expert_bytes, split.dense_bytes) == (
        whole.n_tensors,
        whole.expert_bytes,
        whole.dense_bytes,
    )
    assert {Path(t.file).name for layer in split.layers for t in layer.tensors} > {first.name}


def test_split_model_with_a_missing_shard_is_rejected(tmp_path: Path) -> None:
    first = make_fixtures.write_fixture("qwen3moe", tmp_path / "m.gguf", split_max_tensors=20)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelFileError, match="no such file"):
        inspect_model(first)


# ---------------------------------------------------------------------------
# Fixtures themselves


def test_fixture_files_are_small_deterministic_and_keyed(tmp_path: Path, fixture_dir: Path) -> None:
    a = make_fixtures.fixture_path("mixtral", fixture_dir)
    b = make_fixtures.write_fixture("mixtral", tmp_path / "again.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert make_fixtures.fixture_path("mixtral", fixture_dir, expert_type="q8_0") != a
    for arch in make_fixtures.ARCHES:
        for expert_type in ("f16", "q8_0"):
            assert make_fixtures.fixture_path(arch, fixture_dir, expert_type).stat().st_size < 2 * 2**20


def test_fixture_path_rejects_unknown_names(fixture_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown fixture arch"):
        make_fixtures.fixture_path("gpt5moe", fixture_dir)
    with pytest.raises(ValueError, match="unknown expert type"):
        make_fixtures.fixture_path("olmoe", fixture_dir, expert_type="q4_k")


def test_cli_writes_requested_fixtures(tmp_path: Path) -> None:
    assert (
        make_fixtures.main(["--out", str(tmp_path), "--arch", "olmoe", "--expert-type", "q8_0", "--dense"])
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-dense.gguf", "olmoe-q8_0.gguf"]


@pytest.mark.parametrize("arch", make_fixtures.ARCHES)
def test_router_is_not_degenerate(fixture_dir: Path, arch: str) -> None:
    """The first MoE layer's router, applied to RMS-normed token embeddings, spreads tokens over many top-2 pairs."""
    path = make_fixtures.fixture_path(arch, fixture_dir)
    il = inspect_model(path).moe_layers[0]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embd = np.asarray(tensors["token_embd.weight"].data, dtype=np.float32)  # [n_vocab, n_embd]
    router = np.asarray(tensors[f"blk.{il}.ffn_gate_inp.weight"].data, dtype=np.float32)  # [n_expert, n_embd]
    x = embd / np.sqrt((embd**2).mean(axis=1, keepdims=True) + SHAPE.rms_eps)
    top2 = np.sort(np.argsort(x @ router.T, axis=1)[:, -2:], axis=1)  # [n_vocab, 2] (top-1 routers too)
    pairs = {tuple(p) for p in top2.tolist()}
    usage = np.bincount(top2.ravel(), minlength=SHAPE.n_expert)
    assert len(pairs) >= 15  # of 28 possible
    assert usage.min() > 0 and usage.max() < 0.5 * top2.size


def test_vocab_is_byte_level() -> None:
    vocab = make_fixtures.make_vocab()
    assert len(set(vocab.tokens)) == vocab.n_vocab == N_VOCAB
    assert vocab.tokens[ord(" ")] == "Ġ" and vocab.tokens[ord("\n")] == "Ċ" and vocab.tokens[ord("a")] == "a"


# ---------------------------------------------------------------------------
# Rejections: every bad file raises ModelFileError, quickly and without big allocations


def _str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: VT, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _kv_u32(key: str, value: int) -> bytes:
    return _kv(key, VT.UINT32, struct.pack("<I", value))


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _tensor_info(name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return _str(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, ggml_type, offset)


def _pad(data: bytes, align: int = 32) -> bytes:
    return data + b"\0" * (-len(data) % align)


def _moe_kvs(arch: str = "qwen3moe", n_expert: int = 8, n_expert_used: int = 2) -> list[bytes]:
    return [
        _kv(gguf.Keys.General.ARCHITECTURE, VT.STRING, _str(arch)),
        _kv_u32(gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch), 1),
        _kv_u32(gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), 32),
        _kv_u32(gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch), n_expert),
        _kv_u32(gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=arch), n_expert_used),
    ]


def _gguf(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", n_tensors: int | None = None) -> bytes:
    head = (
        _header(len(tensors) if n_tensors is None else n_tensors, len(kvs))
        + b"".join(kvs)
        + b"".join(tensors)
    )
    return _pad(head) + data


def _one_expert_model(
    shape: tuple[int, ...] = (32, 16, 8), offset: int = 0, data_bytes: int = 32 * 16 * 8 * 4
) -> bytes:
    info = _tensor_info("blk.0.ffn_up_exps.weight", shape, gguf.GGMLQuantizationType.F32, offset)
    return _gguf(_moe_kvs(), [info], b"\0" * data_bytes)


# case -> (file bytes, regex the one-line message must match)
CRAFTED: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (
        lambda: b"",
        "only 0 bytes",
    ),
    "tiny": (
        lambda: b"GGUF",
        "only 4 bytes",
    ),
    "text": (
        lambda: b"hello, this is not a model\n" * 40,
        "bad magic",
    ),
    "bad magic": (
        lambda: b"GGML" + _one_expert_model()[4:],
        "bad magic",
    ),
    "version 1": (
        lambda: _header(0, 0, version=1) + b"\0" * 64,
        "version 1",
    ),
    "version 99": (
        lambda: _header(0, 0, version=99) + b"\0" * 64,
        "version 99",
    ),
    "big endian": (
        lambda: b"GGUF" + struct.pack(">IQQ", 3, 0, 0) + b"\0" * 64,
        "big-endian",
    ),
    "n_tensors 2**60": (
        lambda: _gguf(_moe_kvs(), [], n_tensors=2**60),
        "tensor count",
    ),
    "n_tensors 2**64-1": (
        lambda: _gguf(_moe_kvs(), [], n_tensors=2**64 - 1),
        "tensor count",
    ),
    "n_kv 2**60": (
        lambda: _header(0, 2**60) + b"".join(_moe_kvs()),
        "key/value count",
    ),
    "key length 2**62": (
        lambda: _header(0, 1) + struct.pack("<Q", 2**62) + b"x" * 64,
        "key #0",
    ),
    "string value length 2**62": (
        lambda: _header(0, 1) + _str("general.name") + struct.pack("<IQ", VT.STRING, 2**62) + b"x" * 64,
        "value of key",
    ),
    "u32 array length 2**62": (
        lambda: _header(0, 1) + _str("a") + struct.pack("<IIQ", VT.ARRAY, VT.UINT32, 2**62) + b"\0" * 64,
        "length of array",
    ),
    "string array length 2**62": (
        lambda: _header(0, 1) + _str("a") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 2**62) + b"\0" * 64,
        "length of array",
    ),
    "string array item length 2**62": (
        lambda: _header(0, 1) + _str("a") + struct.pack("<IIQQ", VT.ARRAY, VT.STRING, 2, 2**62) + b"\0" * 64,
        "item of",
    ),
    "nested array": (
        lambda: _header(0, 1) + _str("a") + struct.pack("<IIQ", VT.ARRAY, VT.ARRAY, 1) + b"\0" * 64,
        "array of arrays",
    ),
    "unknown value type": (
        lambda: _header(0, 1) + _str("a") + struct.pack("<I", 99) + b"\0" * 64,
        "unknown value type",
    ),
    "duplicate key": (
        lambda: _gguf([*_moe_kvs(), _kv_u32(gguf.Keys.LLM.EXPERT_COUNT.format(arch="qwen3moe"), 8)], []),
        "duplicate key",
    ),
    "bad alignment": (
        lambda: _gguf([*_moe_kvs(), _kv_u32(gguf.Keys.General.ALIGNMENT, 24)], []),
        "power of 2",
    ),
    "5 dims": (
        lambda: _one_expert_model(shape=(32, 16, 8, 1, 1)),
        "5 dimensions",
    ),
    "dims overflow int64": (
        lambda: _one_expert_model(shape=(2**40, 2**40, 8)),
        "overflows int64",
    ),
    "dim 2**64-1": (
        lambda: _one_expert_model(shape=(2**64 - 1, 1, 8)),
        "overflows int64",
    ),
    "unknown ggml type": (
        lambda: _gguf(_moe_kvs(), [_tensor_info("blk.0.ffn_up_exps.weight", (32, 16, 8), 999, 0)]),
        "ggml type 999",
    ),
    "row not a multiple of block": (
        lambda: _gguf(
            _moe_kvs(),
            [_tensor_info("blk.0.ffn_up_exps.weight", (33, 16, 8), gguf.GGMLQuantizationType.Q8_0, 0)],
        ),
        "block size",
    ),
    "data offset beyond file": (
        lambda: _one_expert_model(offset=2**40),
        "beyond the end",
    ),
    "data offset 2**64-32": (
        lambda: _one_expert_model(offset=2**64 - 32),
        "beyond the end",
    ),
    "unaligned data offset": (
        lambda: _one_expert_model(offset=4),
        "not aligned",
    ),
    "data cut short": (
        lambda: _one_expert_model(data_bytes=100),
        "beyond the end",
    ),
    "duplicate tensor": (
        lambda: _gguf(
            _moe_kvs(),
            [_tensor_info("blk.0.ffn_up_exps.weight", (32, 16, 8), 0, 0)] * 2,
            b"\0" * 32 * 16 * 8 * 4,
        ),
        "duplicate tensor",
    ),
    "no architecture": (
        lambda: _gguf(_moe_kvs()[1:], []),
        "no general.architecture",
    ),
    "no expert_count": (
        lambda: _gguf([_moe_kvs()[i] for i in (0, 1, 2)], []),
        "not a Mixture-of-Experts",
    ),
    "expert_count 0": (
        lambda: _gguf(_moe_kvs(n_expert=0), []),
        "not a Mixture-of-Experts",
    ),
    "experts but no expert tensors": (
        lambda: _gguf(_moe_kvs(), []),
        "no expert tensors",
    ),
    "expert_used_count > expert_count": (
        lambda: _gguf(_moe_kvs(n_expert_used=9), []),
        "expert_used_count 9",
    ),
    "expert_count is a string": (
        lambda: _gguf(
            [
                *_moe_kvs()[:3],
                _kv(gguf.Keys.LLM.EXPERT_COUNT.format(arch="qwen3moe"), VT.STRING, _str("8")),
                _moe_kvs()[4],
            ],
            [],
        ),
        "not an integer",
    ),
    "expert tensor with wrong expert dim": (
        lambda: _one_expert_model(shape=(32, 16, 4), data_bytes=32 * 16 * 4 * 4),
        "expected 8 experts",
    ),
    "expert tensor beyond block_count": (
        lambda: _gguf(
            _moe_kvs(), [_tensor_info("blk.5.ffn_up_exps.weight", (32, 16, 8), 0, 0)], b"\0" * 32 * 16 * 8 * 4
        ),
        "beyond block_count",
    ),
}


def _assert_rejected_fast(path: Path, match: str | None = None) -> ModelFileError:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ModelFileError, match=match) as info:
            inspect_model(path)
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message and message
    assert elapsed < 2.0, f"took {elapsed:.2f} s"
    assert peak < 16 * 2**20, f"allocated {peak / 2**20:.1f} MiB"
    return info.value


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_file_is_rejected(tmp_path: Path, case: str) -> None:
    build, match = CRAFTED[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(build())
    _assert_rejected_fast(path, match=re.escape(match))


def test_crafted_minimal_moe_model_is_accepted(tmp_path: Path) -> None:
    """The crafted files above fail for their one flaw, not because the helper writes bad GGUF."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(_one_expert_model())
    facts = inspect_model(path)
    assert (facts.n_expert, facts.n_ff_exp, facts.bytes_per_expert(0)) == (8, 16, 32 * 16 * 4)


def test_missing_path_is_rejected(tmp_path: Path) -> None:
    _assert_rejected_fast(tmp_path / "nope.gguf", match="no such file")


def test_directory_is_rejected(tmp_path: Path) -> None:
    _assert_rejected_fast(tmp_path, match="directory")


def test_non_moe_model_is_rejected(fixture_dir: Path) -> None:
    _assert_rejected_fast(make_fixtures.dense_fixture_path(fixture_dir), match="not a Mixture-of-Experts")


@pytest.fixture(scope="module")
def good_file(fixture_dir: Path) -> tuple[bytes, int, int]:
    """A fixture's bytes, the offset where its tensor data starts and where the last tensor ends."""
    path = make_fixtures.fixture_path("qwen3moe", fixture_dir, expert_type="q8_0")
    tensors = gguf.GGUFReader(path).tensors
    data_start = min(int(t.data_offset) for t in tensors)
    data_end = max(int(t.data_offset + t.n_bytes) for t in tensors)
    return path.read_bytes(), data_start, data_end


def test_truncated_fixture_is_rejected_at_every_cut(
    tmp_path: Path, good_file: tuple[bytes, int, int]
) -> None:
    """Cuts in the header, KV section, tensor infos and tensor data all raise ModelFileError."""
    data, data_start, data_end = good_file
    header_cuts = [*range(0, 64), *range(64, data_start, max(1, data_start // 300))]
    data_cuts = [data_start - 1, data_start, data_start + 1, (data_start + data_end) // 2, data_end - 1]
    cuts = sorted({*header_cuts, *data_cuts})
    assert len(cuts) > 300
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFileError):
            inspect_model(path)
    path.write_bytes(data[: data_start // 2])
    _assert_rejected_fast(path, match="truncated")


def test_random_byte_flips_give_facts_or_model_file_error(
    tmp_path: Path, good_file: tuple[bytes, int, int]
) -> None:
    """Corrupting header bytes never escapes as another exception type."""
    data, data_start, _ = good_file
    rng = np.random.default_rng(0)
    path = tmp_path / "flip.gguf"
    for _ in range(300):
        mutated = bytearray(data)
        for pos in rng.integers(0, data_start, size=int(rng.integers(1, 4))):
            mutated[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(mutated))
        try:
            inspect_model(path)
        except ModelFileError as e:
            assert "\n" not in str(e)
