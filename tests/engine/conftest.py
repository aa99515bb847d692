"""Engine tier: fixture models of every architecture, generated from seeds on demand."""

from __future__ import annotations

import pytest
from make_fixtures import ARCHES, fixture_path


@pytest.fixture(scope="session", params=ARCHES)
def arch_model(request):
    """(arch, path) for every fixture architecture."""
    return request.param, fixture_path(request.param)


@pytest.fixture(scope="session")
def qwen3moe_model():
    return fixture_path("qwen3moe")
