"""The routes' seam: ``compat_routes.RouteServer`` (a protocol, as app.py imports compat_routes) names only what
the real ``ggmoe.serve.app.Server`` has, with the same signatures, so the type is true; its settings protocol
only fields ``ServeSettings`` has. tests/serve/test_llama_server.py checks the fields on a running server."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from ggmoe.serve import compat_routes
from ggmoe.serve.app import Server, ServeSettings

pytestmark = pytest.mark.unit

SEAM = compat_routes.RouteServer
METHODS = sorted(n for n, v in vars(SEAM).items() if inspect.isfunction(v) and not n.startswith("__"))


def test_the_seam_names_what_the_routes_use():
    source = inspect.getsource(compat_routes)
    used = {name for name in METHODS + sorted(SEAM.__annotations__) if f"server.{name}" in source}
    assert used == set(METHODS) | set(SEAM.__annotations__)  # nothing declared that no route uses
    assert "holding" in METHODS and "lanes" in SEAM.__annotations__


@pytest.mark.parametrize("name", METHODS)
def test_seam_methods_match_the_server(name):
    real = getattr(Server, name, None)
    assert real is not None, f"Server has no {name}"
    assert inspect.signature(real) == inspect.signature(getattr(SEAM, name))
    assert inspect.iscoroutinefunction(real) == inspect.iscoroutinefunction(getattr(SEAM, name))


def test_the_settings_seam_names_fields_of_serve_settings():
    fields = {f.name: f.type for f in dataclasses.fields(ServeSettings)}
    for name, kind in compat_routes.RouteSettings.__annotations__.items():
        assert fields.get(name) == kind, name
