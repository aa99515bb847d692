"""Serve tier: a real ``ggmoe serve`` process on a free loopback port, driven over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import API_KEY, MAX_QUEUE, N_CTX, Server, start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """The embedded model behind an API key, a small queue, an expert cache with prefetching and a directory
    for slot files."""
    tmp = tmp_path_factory.mktemp("serve")
    s = start_server(tmp, "--api-key", API_KEY, "--max-queue", str(MAX_QUEUE), "--n-ctx", str(N_CTX),
                     "--cache-slots", "8", "--predictor", "reuse", "--slot-save-path", str(tmp / "slots"))
    yield s
    rc = stop_server(s)
    assert rc == 0, open(s.log).read()
