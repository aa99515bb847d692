"""Shared test setup: tiers by directory, fixture models generated on demand from seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tools.* (tools/fixtures, tools/gpu, ...) by their package names

_TIERS = ("unit", "engine", "serve", "integrations", "slow", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with the tier of its directory (tests/<tier>/...)."""
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests")
        tier = rel.parts[0]
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
