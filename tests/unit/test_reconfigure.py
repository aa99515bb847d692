"""MoEpic's reconfiguration between requests: the one-pass LRU hit curve, and the proposals."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import RouteEvent
from ggmoe.cache import CacheConfig, ExpertCache
from ggmoe.cache.hardware import load_profile
from ggmoe.cache.policies import make_policy
from ggmoe.control.run_config import RunConfig
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path
from ggmoe.serve.reconfigure import Reconfigurer, lru_hit_curve

pytestmark = pytest.mark.unit


def _calls(seed: int, n: int, n_expert: int, k: int, skew: float) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    p = np.exp(-np.arange(n_expert) * skew)
    p /= p.sum()
    return [rng.choice(n_expert, size=k, replace=False, p=p).tolist() for _ in range(n)]


@pytest.mark.parametrize("seed, n_expert, k, skew", [(0, 16, 2, 0.3), (1, 32, 4, 0.1), (2, 8, 8, 0.0),
                                                     (3, 64, 6, 0.05)])
def test_lru_hit_curve_equals_the_cache(seed, n_expert, k, skew):
    """Every C of the one-pass curve equals the hit rate of ggmoe's own LRU cache replaying the calls."""
    calls = _calls(seed, 200, n_expert, k, skew)
    curve = lru_hit_curve(calls, n_expert)
    for c in range(k, n_expert + 1):
        cache = ExpertCache(n_expert, k, {0: c}, make_policy("lru", n_expert, [0]))
        for call in calls:
            cache.route_flat(0, call)
        assert curve[c] == pytest.approx(cache.stats.layers[0].hit_rate), c


def _fed(r: Reconfigurer, facts, n_tokens: int, seed: int = 0) -> None:
    for t, _ in enumerate(range(n_tokens)):
        for j, il in enumerate(facts.moe_layers):
            ids = np.asarray([_calls(seed + 7 * t + j, 1, facts.n_expert, facts.n_expert_used, 0.15)[0]],
                             dtype=np.int32)
            r.on_route(RouteEvent(il=il, ids=ids, probs=None, hidden=None))


def test_a_lopsided_cache_is_reconfigured_within_its_bytes():
    facts = inspect_model(default_model_path())
    r = Reconfigurer(facts, load_profile("pcie4"), every_tokens=32)
    assert r.propose(RunConfig(CacheConfig(n_slots=4)), dict.fromkeys(facts.moe_layers, 4)) is None  # no routing yet
    _fed(r, facts, 40)
    assert r.due()
    first = facts.moe_layers[0]
    slots = {il: facts.n_expert if il == first else facts.n_expert_used for il in facts.moe_layers}
    p = r.propose(RunConfig(CacheConfig(layer_slots=slots)), slots)
    assert p is not None and not r.due()  # looked: the count starts again
    assert p.exposed_s < p.current_s and p.gain >= r.min_gain
    b = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    budget = sum(n * b[il] for il, n in slots.items())
    from ggmoe.cache.split import model_split

    split = model_split(facts, p.config.cache.layer_theta)
    used = sum(n * (split[il].top_bytes if il in split else b[il]) for il, n in p.config.cache.layer_slots.items())
    assert used <= budget  # the same VRAM (or less)
    p.config.check_model(facts)


def test_a_good_cache_is_left_alone():
    facts = inspect_model(default_model_path())
    r = Reconfigurer(facts, load_profile("pcie4"), every_tokens=8, min_gain=0.5)
    _fed(r, facts, 16)
    slots = dict.fromkeys(facts.moe_layers, facts.n_expert)  # everything cached: nothing to win
    assert r.propose(RunConfig(CacheConfig(layer_slots=slots)), slots) is None


@pytest.mark.parametrize("kw", [{"every_tokens": 0}, {"every_tokens": 4, "window_tokens": 0},
                                {"every_tokens": 4, "min_gain": 1.0}])
def test_bad_settings(kw):
    with pytest.raises(UsageError):
        Reconfigurer(inspect_model(default_model_path()), load_profile("pcie4"), **kw)
