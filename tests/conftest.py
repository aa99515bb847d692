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


@pytest.fixture
def even_profile(tmp_path: Path) -> str:
    """A hardware profile file: h100's, with a CPU exactly as fast as a copy, so that ``auto`` beside the link
    splits a layer's misses between the two (the engine and GPU tiers' hybrid tests)."""
    import dataclasses

    from ggmoe.cache.hardware import load_profile, render_profile

    base = load_profile("h100")
    even = dataclasses.replace(base, cpu_bytes_per_s=base.copy_bytes_per_s, cpu_latency_s=base.copy_latency_s,
                               cpu_type_bytes_per_s=())
    path = tmp_path / "even.toml"
    path.write_text(render_profile(even, {}))
    return str(path)
