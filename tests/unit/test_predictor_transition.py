"""The ``transition`` predictor: experts of layer l + s from this token's experts at layer l (id-only)."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.predict import ModelShape, make_predictor
from ggmoe.simulate.des import SimConfig, simulate
from tests.unit.test_simulator import trace as hand_trace

pytestmark = pytest.mark.unit

E, K, L = 8, 2, 4


def _chain_trace(seed: int, n: int, shift: int):
    """Layer j + 1 selects each of layer j's experts plus ``shift`` (mod E); layer 0 at random."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        first = sorted(rng.choice(E, size=K, replace=False).tolist())
        rows.append([[(e + shift * j) % E for e in first] for j in range(L)])
    return hand_trace(rows, n_prefill=0, n_expert=E)


def _shape() -> ModelShape:
    return ModelShape(model_fingerprint="fp", layers=tuple(range(L)), n_expert=E, n_expert_used=K, n_embd=4)


@pytest.mark.parametrize("stride,shift", [(1, 1), (1, 3), (2, 1)])
def test_it_learns_a_planted_layer_to_layer_map(stride, shift):
    train, held = _chain_trace(0, 200, shift), _chain_trace(1, 20, shift)
    p = make_predictor("transition", _shape(), stride)
    p.fit(train)
    for t in range(held.n_tokens):
        p.begin_token(0)
        for j in range(L - stride):
            p.observe(j, held.ids[t, j].astype(np.int64), None, None)
            top = np.argsort(-p.predict(j + stride), kind="stable")[:K]
            assert sorted(top.tolist()) == sorted(held.ids[t, j + stride].tolist())


def test_before_its_source_layer_routes_it_ranks_by_frequency():
    tr = hand_trace([[[0, 1]] * L] * 30 + [[[2, 3]] * L] * 10, n_prefill=0, n_expert=E)
    p = make_predictor("transition", _shape(), 1)
    p.fit(tr)
    p.begin_token(0)
    assert np.argsort(-p.predict(0), kind="stable")[:K].tolist() == [0, 1]


def test_state_round_trip_and_a_state_of_another_shape_refused():
    p = make_predictor("transition", _shape(), 1)
    assert not p.has_state and p.state() == {}
    p.fit(_chain_trace(2, 50, 1))
    q = make_predictor("transition", _shape(), 1)
    q.load_state(p.state())
    assert q.has_state and np.array_equal(q.state()["transition"], p.state()["transition"])
    with pytest.raises(UsageError, match="do not fit"):
        q.load_state({"transition": np.zeros((1, 2, 2), np.float32), "prior": np.zeros((1, 2), np.float32)})


def test_prefetching_with_it_lifts_the_hit_rate_on_an_id_only_trace():
    train, held = _chain_trace(3, 300, 3), _chain_trace(4, 100, 3)
    bpe = dict.fromkeys(range(L), 1)
    hit = {pred: simulate(held, SimConfig(dict.fromkeys(range(L), 3), predictor=pred, stride=1, n_prefetch=K,
                                          predictor_s=0.0), bpe, None, train).hit_rate
           for pred in (None, "transition")}
    assert hit["transition"] > hit[None] + 0.3
