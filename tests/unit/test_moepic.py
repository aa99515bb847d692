"""MoEpic's expert split: the per-layer cost by hand, the configurator's fixed point, curves from traces."""

from __future__ import annotations

import dataclasses

import pytest

from ggmoe.cache.hardware import load_profile
from ggmoe.simulate.moepic import Curves, configure, layer_cost

P = dataclasses.replace(load_profile("pcie4"), copy_bytes_per_s=1e9, copy_latency_s=0.0)
B = 1_000_000  # bytes per expert


def curves(hit: dict[int, float], recall: dict[int, float], n_layers: int = 1) -> Curves:
    return Curves({il: hit for il in range(n_layers)}, {il: recall for il in range(n_layers)}, n_expert=8, k=2)


def test_unsplit_cost_is_the_lru_misses():
    c = curves({4: 0.5}, {})
    got = layer_cost(c, 0, B, 4 * B, theta=1.0, y=0, profile=P, window_s=0.0)
    assert got.c == 4
    assert got.exposed_s == pytest.approx(2 * B * 0.5 / 1e9)  # k (1 - H) b over the link


def test_split_cost_by_hand():
    c = curves({4: 0.5, 6: 0.6}, {2: 0.7})
    # theta 0.5, y 2: bottoms take 2 x 0.5 MB; 4 MB - 1 MB holds 6 tops of 0.5 MB
    got = layer_cost(c, 0, B, 4 * B, theta=0.5, y=2, profile=P, window_s=1.0)
    h, p = 0.6, 0.7
    ph = h * p
    demand = 2 * B * (0.5 * (h - ph) + 0.5 * (p - ph) + (1 - h - p + ph))
    assert got.c == 6 and got.exposed_s == pytest.approx(demand / 1e9)
    # a window too short to hide the prefetched bottoms exposes the rest
    tight = layer_cost(c, 0, B, 4 * B, theta=0.5, y=2, profile=P, window_s=0.0)
    assert tight.exposed_s == pytest.approx(demand / 1e9 + 2 * 0.5 * B / 1e9)
    assert layer_cost(c, 0, B, B // 2, theta=0.25, y=2, profile=P, window_s=0.0) is None  # bottoms do not fit


def test_configurator_never_worse_than_the_even_plain_split():
    hit = {c: min(1.0, c / 8) for c in range(1, 9)}
    c = Curves({0: hit, 1: {x: min(1.0, 0.5 + x / 16) for x in range(1, 9)}}, {0: {2: 0.9, 4: 0.95},
               1: {2: 0.3, 4: 0.5}}, n_expert=8, k=2)
    slow_gpu = dataclasses.replace(P, gpu_layer_s=2e-3)  # a layer long enough to hide prefetched bottoms
    plan = configure(c, {0: B, 1: B}, 8 * B, slow_gpu, zeta=B // 4)
    assert plan.exposed_s <= plan.even_exposed_s + 1e-12
    assert sum(x.vram for x in plan.layers.values()) <= 8 * B
    # layer 0 is well predicted: it is the one that gains from a split
    assert plan.layers[0].theta < 1.0


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
