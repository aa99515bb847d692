"""GPU tier: skipped, never failed, when no CUDA device is visible to ggml."""

import pytest


def pytest_collection_modifyitems(config, items):
    from ggmoe.engine import gpu_device_name

    if gpu_device_name() is None:
        skip = pytest.mark.skip(reason="no GPU device visible to ggml (CPU-only build or machine)")
        for item in items:
            if "tests/gpu/" in str(item.fspath):
                item.add_marker(skip)
