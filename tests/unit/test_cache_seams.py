"""The split layers' seam: ``split_cache.SlotCache`` (a protocol, as cache.py imports split_cache) names
only what the real ``ggmoe.cache.cache.ExpertCache`` has, with the same signatures, so the type is true."""

from __future__ import annotations

import inspect

import pytest

from ggmoe.cache import split_cache
from ggmoe.cache.cache import ExpertCache
from ggmoe.cache.policies.lru import LRU

pytestmark = pytest.mark.unit

SEAM = split_cache.SlotCache
METHODS = sorted(n for n, v in vars(SEAM).items() if inspect.isfunction(v) and not n.startswith("__"))
FIELDS = sorted(SEAM.__annotations__)


def test_the_seam_names_what_split_layers_use():
    assert "admit_after" in METHODS and "cancel_stale" in METHODS and "tables" in FIELDS


@pytest.mark.parametrize("name", METHODS)
def test_seam_methods_match_the_cache(name):
    real = getattr(ExpertCache, name, None)
    assert real is not None, f"ExpertCache has no {name}"
    assert inspect.signature(real) == inspect.signature(getattr(SEAM, name))


@pytest.mark.parametrize("name", FIELDS)
def test_seam_fields_exist_on_a_cache(name):
    cache = ExpertCache(n_expert=8, n_expert_used=2, n_slots={0: 4, 1: 4}, policy=LRU(8, [0, 1]))
    assert hasattr(cache, name)
