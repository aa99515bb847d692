"""MoEpic's expert split: representable top shares, the per-layer cost by hand (bottom buffers of whole-expert
size), the configurator's fixed point and its budget, curves from traces."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.hardware import load_profile
from ggmoe.cache.split import layer_split
from ggmoe.inspect.facts import ExpertTensor, MoeLayer
from ggmoe.simulate.moepic import Curves, Share, configure, layer_cost, layer_shares, representable_thetas

P = dataclasses.replace(load_profile("pcie4"), copy_bytes_per_s=1e9, copy_latency_s=0.0, zero_copy_bytes_per_s=None)
B = 1_000_000  # bytes per expert
HALF = Share(0.5, B // 2, B // 2, B)  # a split share: half the bytes in the top, a bottom buffer of B bytes
WHOLE = Share(1.0, B, 0, B)


def curves(hit: dict[int, float], recall: dict[int, float], n_layers: int = 1) -> Curves:
    return Curves({il: hit for il in range(n_layers)}, {il: recall for il in range(n_layers)}, n_expert=8, k=2)


def moe_layer(n_ff: int, down_type: str, up_type: str = "Q8_0", n_embd: int = 256, n_expert: int = 8) -> MoeLayer:
    """A layer's expert tensors as the GGUF header describes them (no data)."""

    def tensor(kind: str, ggml_type: str, shape: tuple[int, int]) -> ExpertTensor:
        el, nb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
        per = shape[0] // el * nb * shape[1]  # bytes of one expert
        return ExpertTensor(f"blk.0.{kind}", kind, ggml_type, (*shape, n_expert), per * n_expert, per, "x.gguf", 0)

    return MoeLayer(0, (tensor("ffn_down_exps.weight", down_type, (n_ff, n_embd)),
                        tensor("ffn_gate_exps.weight", up_type, (n_embd, n_ff)),
                        tensor("ffn_up_exps.weight", up_type, (n_embd, n_ff))))


@pytest.mark.parametrize("n_ff,down,want", [
    (768, "Q4_K", [1 / 3, 2 / 3, 1.0]),  # 3 blocks of 256 in a down row
    (64, "Q8_0", [0.5, 1.0]),  # the embedded model's shape: 2 blocks of 32
    (256, "Q4_K", [1.0]),  # one block: nothing to split
])
def test_representable_thetas_are_whole_quant_blocks(n_ff, down, want):
    layer = moe_layer(n_ff, down)
    got = representable_thetas(layer)
    assert got == pytest.approx(want)
    blck = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[down]][0]
    for t in got[:-1]:  # every θ < 1 keeps exactly a whole number of blocks (never one short to rounding)
        s = layer_split(layer, t)
        assert s is not None and s.n_top % blck == 0 and s.n_top == round(t * n_ff)


def test_many_blocks_give_a_few_evenly_spread_shares():
    layer = moe_layer(768, "Q8_0")  # 24 blocks of 32
    got = representable_thetas(layer)
    assert got[-1] == 1.0 and 3 <= len(got) - 1 <= 6 and list(got) == sorted(set(got))
    steps = [b - a for a, b in zip((0.0, *got), got, strict=False)]
    assert max(steps) - min(steps) <= 1 / 24 + 1e-9  # evenly spread, to a block
    assert all(layer_split(layer, t).n_top == round(t * 768) for t in got[:-1])


def test_shares_take_their_bytes_from_the_split():
    layer = moe_layer(768, "Q4_K")
    shares = layer_shares(layer)
    assert [s.theta for s in shares] == pytest.approx([1 / 3, 2 / 3, 1.0])
    for s in shares[:-1]:
        split = layer_split(layer, s.theta)
        assert (s.top_bytes, s.bottom_bytes, s.expert_bytes) == (split.top_bytes, split.bottom_bytes,
                                                                 split.expert_bytes)
        assert s.top_bytes + s.bottom_bytes == s.expert_bytes == layer.bytes_per_expert
    assert shares[-1] == Share(1.0, layer.bytes_per_expert, 0, layer.bytes_per_expert)


def test_unsplit_cost_is_the_lru_misses():
    c = curves({4: 0.5}, {})
    got = layer_cost(c, 0, WHOLE, 4 * B, y=2, profile=P, window_s=0.0)  # y does not apply to whole experts
    assert got.c == 4 and got.y == 0 and got.used_bytes == 4 * B
    assert got.exposed_s == pytest.approx(2 * B * 0.5 / 1e9)  # k (1 - H) b over the link


def test_split_cost_by_hand_with_packed_bottom_buffers():
    c = curves({2: 0.3, 4: 0.5, 6: 0.6}, {2: 0.7})
    # theta 0.5, y 2: the bottom buffers take 2 packed bottoms (2 x 0.5 MB); 4 MB - 1 MB holds 6 tops
    got = layer_cost(c, 0, HALF, 4 * B, y=2, profile=P, window_s=1.0)
    h, p = 0.6, 0.7
    ph = h * p
    demand = 2 * (B / 2 * (h - ph) + B / 2 * (p - ph) + B * (1 - h - p + ph))
    assert (got.c, got.y, got.used_bytes) == (6, 2, 4 * B)
    assert got.exposed_s == pytest.approx(demand / 1e9)
    # a window too short to hide the prefetched bottoms exposes the rest
    tight = layer_cost(c, 0, HALF, 4 * B, y=2, profile=P, window_s=0.0)
    assert tight.exposed_s == pytest.approx(demand / 1e9 + 2 * 0.5 * B / 1e9)
    # 2 bottom buffers and k = 2 tops need 2 MB: below that the choice does not exist
    assert layer_cost(c, 0, HALF, 2 * B, y=2, profile=P, window_s=0.0).c == 2
    assert layer_cost(c, 0, HALF, 2 * B - 1, y=2, profile=P, window_s=0.0) is None
    assert layer_cost(c, 0, HALF, B // 2, y=2, profile=P, window_s=0.0) is None  # not even the buffers


def test_configurator_never_worse_than_the_even_plain_split():
    hit = {c: min(1.0, c / 8) for c in range(2, 9)}
    c = Curves({0: hit, 1: {x: min(1.0, 0.5 + x / 16) for x in range(2, 9)}}, {0: {2: 0.9, 4: 0.95},
               1: {2: 0.3, 4: 0.5}}, n_expert=8, k=2)
    slow_gpu = dataclasses.replace(P, gpu_layer_s=2e-3)  # a layer long enough to hide prefetched bottoms
    plan = configure(c, {0: (HALF, WHOLE), 1: (HALF, WHOLE)}, 8 * B, slow_gpu, zeta=B // 4)
    assert plan.exposed_s <= plan.even_exposed_s + 1e-12
    assert sum(x.used_bytes for x in plan.layers.values()) <= 8 * B
    assert all(x.used_bytes <= x.vram for x in plan.layers.values())
    # layer 0 is well predicted: it is the one that gains from a split
    assert plan.layers[0].theta < 1.0
    # one y for every split layer (the engine's n_prefetch bottom buffers per split layer)
    assert {x.y for x in plan.layers.values() if x.theta < 1} == {plan.y}
    assert {x.y for x in plan.layers.values() if x.theta == 1} <= {0}
    assert plan.y in {y for y, _ in plan.tried}


def test_predictor_time_counts_against_prefetching():
    hit = {c: min(1.0, c / 8) for c in range(2, 9)}
    fast = Curves({0: hit}, {0: {2: 0.9, 4: 0.95}}, n_expert=8, k=2)
    slow = Curves({0: hit}, {0: {2: 0.9, 4: 0.95}}, n_expert=8, k=2, predictor_s=1.0)
    gpu = dataclasses.replace(P, gpu_layer_s=2e-3)
    assert configure(fast, {0: (HALF, WHOLE)}, 4 * B, gpu, zeta=B // 4).y > 0
    assert configure(slow, {0: (HALF, WHOLE)}, 4 * B, gpu, zeta=B // 4).y == 0  # a second per call: never


def test_budget_below_k_tops_is_a_usage_error():
    c = curves({x: x / 8 for x in range(2, 9)}, {2: 0.5}, n_layers=2)
    # whole experts need 2 x 2 MB; halves 2 x 1 MB: 2 MB plans the split only, without a baseline
    plan = configure(c, {0: (HALF, WHOLE), 1: (HALF, WHOLE)}, 2 * B, P, zeta=B // 4)
    assert plan.even_exposed_s is None and all(x.theta == 0.5 and x.c == 2 for x in plan.layers.values())
    assert plan.y == 0  # no room for bottom buffers
    with pytest.raises(UsageError, match="n_expert_used = 2"):
        configure(c, {0: (HALF, WHOLE), 1: (HALF, WHOLE)}, 2 * B - 1, P, zeta=B // 4)


def test_curves_from_a_trace(tmp_path):
    import numpy as np

    from ggmoe.simulate.moepic import measure_curves
    from predictors.synthetic import planted_trace

    path = tmp_path / "t.npz"
    planted_trace(path, n_prompts=6, tokens=12, group_by="prompt", n_groups=2, seed=5)
    from ggmoe.trace import load_trace

    tr = load_trace(path)
    cv = measure_curves(tr, "reuse", 1)
    il = int(tr.layers[1])
    hs = [cv.h(il, c) for c in range(tr.meta.n_expert_used, tr.meta.n_expert + 1)]
    assert all(0 <= x <= 1 for x in hs) and hs == sorted(hs)  # LRU is a stack algorithm
    assert 0 < cv.p(il, tr.meta.n_expert_used) <= 1
    assert np.isclose(cv.p(il, 0), 0.0)  # no prefetched bottoms, no predicted hits
    assert cv.predictor_s > 0  # the predictor's time per call, measured


def test_a_layer_without_a_down_tensor_is_not_split():
    layer = moe_layer(768, "Q4_K")
    layer = MoeLayer(0, tuple(t for t in layer.tensors if "down" not in t.kind))
    assert representable_thetas(layer) == (1.0,)
    assert layer_shares(layer) == (Share(1.0, layer.bytes_per_expert, 0, layer.bytes_per_expert),)
