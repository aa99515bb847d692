"""A real routing mapped to another model's shape (``ggmoe.trace.remap``), and the GPU harness naming it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.trace.remap import map_ids, map_trace
from tests.unit.test_simulator import trace as hand_trace
from tools.gpu.trace_routing import ROUTING_NAME, model_trace, routing_name

pytestmark = pytest.mark.unit


def _real(seed: int = 0, n: int = 40, layers: int = 6, e: int = 16, k: int = 3):
    rng = np.random.default_rng(seed)
    rows = [[sorted(rng.choice(e, size=k, replace=False).tolist()) for _ in range(layers)] for _ in range(n)]
    tr = hand_trace(rows, n_prefill=0, n_expert=e)
    return replace(tr, meta=replace(tr.meta, source="layer-files:/logs (test)", lacks=("hidden", "token_ids")))


@pytest.mark.parametrize("n_expert,k,n_layers", [(16, 3, 6), (32, 4, 12), (64, 8, 3), (8, 2, 6), (4, 4, 2)])
def test_every_token_gets_k_distinct_experts_of_the_model(n_expert, k, n_layers):
    src = _real()
    m = map_trace(src, tuple(range(1, n_layers + 1)), n_expert, k, n_layers + 1)
    assert m.ids.shape == (src.n_tokens, n_layers, k)
    flat = m.ids.reshape(-1, k).astype(int)
    assert flat.min() >= 0 and flat.max() < n_expert
    assert all(len(set(r)) == k for r in flat.tolist())
    assert m.meta.n_expert == n_expert and m.meta.n_expert_used == k and m.meta.model_fingerprint == ""
    assert m.meta.source.startswith("mapped from layer-files:/logs (test)") and "probs" in m.meta.lacks


def test_the_same_shape_maps_to_itself():
    src = _real()
    m = map_trace(src, tuple(range(6)), 16, 3, 6)
    assert np.array_equal(np.sort(m.ids, axis=2), np.sort(src.ids, axis=2))


def test_more_experts_keep_reuse_and_follow_the_weights():
    ids = np.array([[3, 7], [3, 7], [7, 1]])
    w = np.array([[0.1, 0.9], [0.1, 0.9], [0.5, 0.2]], dtype=np.float32)
    out = map_ids(ids, w, 8, 16, 3).tolist()  # each trace expert is a block of 2; the strongest gives the 3rd
    assert out[0] == [14, 6, 15] and out[1] == out[0]  # a repeated token repeats
    assert out[2] == [14, 2, 15]


def test_bad_top_k_is_refused():
    with pytest.raises(UsageError, match="top-k 9"):
        map_trace(_real(), (0,), 8, 9, 1)


def test_the_harness_maps_real_routing_and_names_its_source():
    real = _real()
    m = model_trace(real, tuple(range(12)), 32, 4, "fp")
    assert m.meta.model_fingerprint == "fp" and m.ids.shape[1:] == (12, 4)
    assert "real routing, layer-files:/logs (test)" in routing_name(real)
    toy = replace(real, meta=replace(real.meta, source=""))
    assert routing_name(toy) == ROUTING_NAME
