"""The GPU harness's pure parts: quant blocks with valid scales, trace tiling, the trace-replay cursor."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
from realshape import (  # noqa: E402
    PRESETS,
    Payload,
    mxfp4_blocks,
    plan_for,
    q4_k_blocks,
    q8_0_blocks,
    tensor_bytes,
    tensor_type,
)
from trace_routing import TilingError, TraceRouting, expert_map, tile_ids  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("make,qtype", [(q8_0_blocks, Q.Q8_0), (q4_k_blocks, Q.Q4_K), (mxfp4_blocks, Q.MXFP4)])
@pytest.mark.parametrize("std", [0.02, 0.0625])
def test_blocks_dequantize_to_the_asked_spread(make, qtype, std):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = make(4096, std, Payload(np.random.default_rng(0), 1 << 20))
    assert b.shape == (4096, size) and b.dtype == np.uint8
    v = gguf.quants.dequantize(b.reshape(64, -1), qtype)
    assert v.shape == (64, 4096 * block // 64)
    assert np.isfinite(v).all()
    assert abs(float(v.mean())) < 0.1 * std
    # MXFP4's scale is a power of two: the spread is right within a factor sqrt(2)
    assert float(v.std()) == pytest.approx(std, rel=0.42 if qtype == Q.MXFP4 else 0.25)


def test_payload_is_fresh_per_take_and_random():
    p = Payload(np.random.default_rng(1), 1 << 16)
    a = p.take(100_000).copy()
    b = p.take(100_000)
    assert not np.array_equal(a, b)
    assert 100 < a.mean() < 155  # uniform bytes average 127.5


def test_quant_types_and_sizes_of_the_presets():
    for name, preset in PRESETS.items():
        plan, _ = plan_for(name)
        experts = [t for t in plan.tensors if "_exps" in t.name]
        assert experts and all(tensor_type(t, preset.expert_type) == preset.expert_type for t in experts)
        assert all(tensor_bytes(t, tensor_type(t, preset.expert_type)) > 0 for t in plan.tensors)
    # gpt-oss-20b: 24 layers x 32 experts x 3 x 2880 x 2880 MXFP4 weights (17 bytes per 32)
    plan, preset = plan_for("gpt-oss-20b")
    total = sum(tensor_bytes(t, tensor_type(t, preset.expert_type)) for t in plan.tensors if "_exps" in t.name)
    assert total == 24 * 32 * 3 * 2880 * 2880 // 32 * 17


def test_rows_that_do_not_fit_the_block_are_refused():
    from make_fixtures import Role, TensorSpec

    with pytest.raises(ValueError, match="not a multiple"):
        tensor_bytes(TensorSpec("x", (2880, 16), Role.EXPERT), Q.Q4_K)


@pytest.mark.parametrize("n_e_t,k_t,n_e,k,want", [
    (32, 4, 32, 4, (1, 1)), (32, 4, 128, 8, (4, 2)), (8, 2, 64, 8, (8, 4)),
])
def test_expert_map(n_e_t, k_t, n_e, k, want):
    assert expert_map(n_e_t, k_t, n_e, k) == want


@pytest.mark.parametrize("args", [(32, 4, 100, 8), (32, 4, 128, 6), (32, 4, 64, 16)])
def test_expert_map_refuses(args):
    with pytest.raises(TilingError):
        expert_map(*args)


def test_tile_ids_by_hand():
    ids = np.array([[[0, 1], [2, 3]]], dtype=np.int16)  # one token, 2 trace layers, top-2 of 4 experts
    out = tile_ids(ids, n_layer=3, factor=4, reps=2)  # 16 experts, top-4
    # layer j replays trace layer j % 2; expert e -> 4e + ((j*2 + r) % 4)
    assert out[0, 0].tolist() == [0, 1, 4, 5]
    assert out[0, 1].tolist() == [8 + 2, 8 + 3, 12 + 2, 12 + 3]
    assert out[0, 2].tolist() == [0, 1, 4, 5]  # (2*2 + r) % 4 = r
    assert len(set(out[0, 1].tolist())) == 4


class _Trace:
    def __init__(self, ids, layers):
        self.ids = np.asarray(ids)
        self.layers = np.asarray(layers)


def test_trace_routing_cursor():
    # 3 tokens, layers il 0 and 5, top-1
    r = TraceRouting(_Trace([[[10], [20]], [[11], [21]], [[12], [22]]], [0, 5]))
    assert r(0, 2) == [10, 11]  # a two-token micro-batch
    assert r(5, 1) == [21]  # the last layer computes only the batch's last row
    assert r(0, 1) == [12]
    assert r(5, 1) == [22]
    assert r(0, 2) == [10, 11]  # wraps around the trace
