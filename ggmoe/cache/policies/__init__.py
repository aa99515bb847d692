"""Eviction policies, one module each; importing this package registers the built-ins in ``POLICIES``."""

from ggmoe.cache.policies import (  # noqa: F401 - registration
    belady,
    classlru,
    eam,
    fmoe,
    lcp,
    lfu,
    lru,
    on_demand,
    static,
    tinylfu,
)
from ggmoe.cache.policies.base import POLICIES, Policy, make_policy

__all__ = ["POLICIES", "Policy", "make_policy"]
