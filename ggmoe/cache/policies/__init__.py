"""Eviction policies, one module each; importing this package registers the built-ins in ``POLICIES``."""

from ggmoe.cache.policies import lru, on_demand  # noqa: F401 - registration
from ggmoe.cache.policies.base import POLICIES, Policy

__all__ = ["POLICIES", "Policy"]
