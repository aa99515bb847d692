"""Engine tier: fixture models of every architecture, generated from seeds on demand."""

from __future__ import annotations

import pytest

from tools.fixtures.make_fixtures import ARCHES, fixture_path

COPY_STREAMS = ("immediate", "deferred")


@pytest.fixture(autouse=True, params=COPY_STREAMS)
def copy_stream(request, monkeypatch):
    """Every engine test runs twice: on the CPU build's immediate copies, and on the deferred copy stream,
    whose copies land later, on their own threads, out of order, seen only through the readiness query, as a
    GPU's do (GGMOE_COPY_STREAM, inherited by the CLI's subprocesses). A test whose assertion holds only
    for copies that land at once says why with ``@pytest.mark.immediate_copies("why")``."""
    marker = request.node.get_closest_marker("immediate_copies")
    if request.param == "deferred" and marker is not None:
        pytest.skip(f"immediate copies only: {marker.args[0]}")
    monkeypatch.setenv("GGMOE_COPY_STREAM", request.param)
    return request.param


@pytest.fixture(scope="session", params=ARCHES)
def arch_model(request):
    """(arch, path) for every fixture architecture."""
    return request.param, fixture_path(request.param)


@pytest.fixture(scope="session")
def qwen3moe_model():
    return fixture_path("qwen3moe")


@pytest.fixture(scope="session")
def stock_logits():
    """path -> the stock path's logits of ``test_cache_engine.run_sequences`` (computed once per model)."""
    from test_cache_engine import run_sequences

    from ggmoe.engine import Engine, EngineConfig

    memo: dict = {}

    def get(path):
        if path not in memo:
            with Engine(EngineConfig(model_path=path, n_ctx=256, gate_hook=False)) as eng:
                memo[path] = run_sequences(eng)
        return memo[path]

    return get
