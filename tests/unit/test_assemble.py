"""The one assembly of the expert cache (``ggmoe.cache.assemble``) and the one default of experts prefetched
per layer (``ggmoe.control.prefetch.default_n_prefetch``)."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.assemble import CacheSpec, assemble_cache
from ggmoe.cache.cache import ExpertCache
from ggmoe.cache.clock import ManualClock
from ggmoe.cache.policies import make_policy
from ggmoe.control.prefetch import default_n_prefetch

pytestmark = pytest.mark.unit


def test_the_record_names_every_argument_of_the_cache():
    """A new argument of ``ExpertCache`` shows up here: the record must name it too."""
    params = [n for n in inspect.signature(ExpertCache.__init__).parameters if n != "self"]
    assert [f.name for f in dataclasses.fields(CacheSpec)] == params


def test_assembled_cache_routes_as_one_built_directly():
    rng = np.random.default_rng(0)
    ids = [rng.choice(8, size=(1, 2), replace=False) for _ in range(40)]
    caches = []
    for build in (lambda p: assemble_cache(p), lambda p: ExpertCache(**dataclasses.asdict(p))):
        parts = CacheSpec(8, 2, {0: 3, 1: 4}, make_policy("lru", 8, [0, 1]), clock=ManualClock(),
                           bytes_per_expert={0: 10, 1: 10})
        cache = build(parts)
        for a in ids:
            for il in (0, 1):
                cache.route(il, a)
        caches.append(cache)
    a, b = (c.stats.total() for c in caches)
    assert (a.hits, a.misses, a.bytes_copied) == (b.hits, b.misses, b.bytes_copied)
    assert a.hits > 0 and a.misses > 0


def test_assembly_keeps_the_cache_checks():
    with pytest.raises(UsageError, match="n_expert_used"):
        assemble_cache(CacheSpec(8, 2, {0: 1}, make_policy("lru", 8, [0])))


@pytest.mark.parametrize(("k", "n_expert", "want"), [(2, 8, 4), (4, 6, 6), (1, 1, 1), (8, 128, 16)])
def test_default_n_prefetch_is_twice_top_k_at_most_every_expert(k, n_expert, want):
    assert default_n_prefetch(k, n_expert) == want
