"""The cache's per-layer strategies: each layer is a ``WholeLayer`` or a ``SplitLayer``, and every per-layer call
of the cache goes to that layer's strategy (the cache asks it, never which kind the layer is)."""

from __future__ import annotations

import ast
import inspect

import numpy as np
import pytest
from test_stride_cache import HeldCopies, _split_cache

from ggmoe.cache import ExpertCache
from ggmoe.cache import cache as cache_module
from ggmoe.cache.cache import WholeLayer, keep_free_slots
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.split import SPLIT_MAX_TOKENS
from ggmoe.cache.split_cache import SplitLayer

pytestmark = pytest.mark.unit


def _mixed_cache(n_bottom: int = 2) -> ExpertCache:
    """Layer 0 split (8 experts, 4 slots), layer 1 whole with 4 slots, layer 2 whole with a slot per expert."""
    split_cache, _ = _split_cache(n_bottom=n_bottom)
    split = split_cache.split
    return ExpertCache(8, 2, {0: 4, 1: 4, 2: 8}, POLICIES.get("lru")(8, [0, 1, 2]), copies=HeldCopies(),
                       bytes_per_expert={0: 100, 1: 100, 2: 100}, split=split, n_bottom=n_bottom)


def test_each_layer_gets_the_strategy_of_its_kind():
    cache = _mixed_cache()
    assert [type(cache.layers[il]) for il in (0, 1, 2)] == [SplitLayer, WholeLayer, WholeLayer]
    assert cache.slot_bytes == {0: 40, 1: 100, 2: 100}  # a split layer's slot holds a top segment
    assert cache.prefetch_layers == (0, 1) and cache.partial_layers == (1,)  # layer 2 holds every expert
    assert not cache.roomy
    assert cache.keep_free_cap(3) == {0: 2, 1: 2, 2: 0}  # bottom buffers; 4 slots - top-2; none kept
    assert keep_free_slots({1: 4, 2: 8}, 8, 2, 3) == {1: 2, 2: 0}  # the same rule for whole-expert layers


@pytest.mark.parametrize("n_tokens, split_fits, whole_fits", [
    (1, True, True), (2, True, True), (SPLIT_MAX_TOKENS, True, True), (SPLIT_MAX_TOKENS + 1, False, True)])
def test_what_fits_is_each_strategys_answer(n_tokens, split_fits, whole_fits):
    """A split layer reads through its table (the batch size limits); a whole layer with a slot per expert
    takes any batch; one with 4 slots at top-2 takes 2 tokens at most."""
    cache = _mixed_cache()
    assert cache.fits(0, n_tokens) is split_fits
    assert cache.fits(2, n_tokens) is whole_fits
    assert cache.fits(1, n_tokens) is (n_tokens <= 2)


class Recorder:
    """A strategy that records what the cache asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        def record(*args):
            self.calls.append((name, args))
            return {"route": [7], "fits": True, "has_room": True, "keep_free_cap": 1, "prefetch": 3,
                    "prefetch_free": 4}.get(name)
        return record


CALLS = [  # the cache's call, its answer, and what the strategy was asked
    (lambda c: c.route_flat(1, [2, 3]), [7], ("route", ([2, 3], None))),
    (lambda c: c.after_token(1, [2]), None, ("after_token", ([2],))),
    (lambda c: c.seen_start(1, [2]), None, ("seen_start", ([2],))),
    (lambda c: c.prefetch(1, [5], free_only=True), 4, ("prefetch_free", ([5], None, None))),
    (lambda c: c.prefetch(1, [5], keep={6}), 3, ("prefetch", ([5], {6}, None))),
    (lambda c: c.fits(1, 9), True, ("fits", (9,))),
    (lambda c: c.has_room(1), True, ("has_room", ())),
    (lambda c: c.keep_free_cap(2)[1], 1, ("keep_free_cap", (2,))),
    (lambda c: c.land_ready(), None, ("land", ())),
    (lambda c: c.observe(1, [4]), None, ("observe", ([4],))),
]


@pytest.mark.parametrize("call, answer, asked", CALLS)
def test_every_per_layer_call_goes_to_the_layers_strategy(call, answer, asked):
    cache = _mixed_cache()
    cache.layers[1] = rec = Recorder()
    assert call(cache) == answer
    assert rec.calls == [asked]


def test_the_cache_never_asks_which_kind_a_layer_is_outside_its_construction():
    """``il in self.split`` only builds the strategies (``_build_layers``): every other decision is the strategy's."""
    tree = ast.parse(inspect.getsource(cache_module.ExpertCache))
    asked = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name != "_build_layers"):
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and node.attr in ("split", "bottoms")
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                asked.append(fn.name)
    assert set(asked) <= {"follow_tables"}  # which hands the bottom buffers the step log


def test_a_split_layer_leaves_its_prefills_tops_behind_a_whole_layer_nothing():
    """The native path (a prefill above SPLIT_MAX_TOKENS): the split layer admits its experts' tops, the
    whole-expert layer loads nothing."""
    cache = _mixed_cache()
    ids = np.array([[1, 2], [3, 1], [2, 3], [1, 2], [3, 2]])
    cache.observe(0, ids)
    cache.observe(1, ids)
    assert sorted(cache.tables[0].resident()) == [1, 2, 3]
    assert cache.tables[1].resident() == []
    assert cache.stats.layers[0].native_calls == cache.stats.layers[1].native_calls == 1
