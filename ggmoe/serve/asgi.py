"""Small ASGI middlewares Starlette does not ship: a body size limit, a request counter, a loopback Host check,
a same-origin check and JSON bodies whatever their Content-Type.

Each wraps the ASGI callables only; parsing stays uvicorn's and Starlette's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp

from ggmoe.serve.errors import APIError, error_response

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (by Content-Length, or while streaming in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes  # bytes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        seen = 0

        async def limited() -> Message:
            # Raised from the body read inside the route, so FastAPI's handlers shape the 413.
            nonlocal seen
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
                raise HTTPException(413, f"the request body exceeds {self.max_bytes} bytes")
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, f"the request body exceeds {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


class RequestCounter:
    """Calls ``count(route, status)`` once per HTTP response, when its status is sent."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None], routes: frozenset[str]) -> None:
        self.app = app
        self.count = count
        self.routes = routes  # known paths; anything else is counted as "other"

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope.get("path", "") if scope.get("path", "") in self.routes else "other"

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(route, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting)


def is_loopback(host: str) -> bool:
    """Whether a host name or address (``[::1]`` bracketed or not) names this machine's loopback."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a Host header, without its port: ``[::1]:8080`` -> ``[::1]``, ``a:80`` -> ``a``."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackHostOnly:
    """Refuse (403, OpenAI-shaped) a request whose Host header is not a loopback name.

    While the server listens on loopback only, a web page can still reach it through a DNS name that
    rebinds to 127.0.0.1; such a request carries the page's host name, which this refuses.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            if not is_loopback(_host_name(host)):
                err = APIError(403, f"the Host header {host!r} is not a loopback name; this server answers "
                                    "requests to localhost only (DNS rebinding protection)",
                               type="permission_error", code="invalid_host")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_port(host: str, scheme: str) -> tuple[str, int | None]:
    """A Host header (or an origin's netloc) as (lower-case name, port), the scheme's port when none is given."""
    name = _host_name(host)
    rest = host[len(name):]
    port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else _DEFAULT_PORTS.get(scheme)
    return name.strip("[]").lower().rstrip("."), port


def same_site(origin: str, host: str) -> bool:
    """Whether a browser's ``Origin`` names this server itself (the request's ``Host``), not another site: the
    same host and port, or a loopback name for a loopback Host on the same port."""
    parts = urlsplit(origin)
    if parts.scheme not in _DEFAULT_PORTS or not parts.netloc:
        return False  # "null" (a sandboxed frame, a file), or no web origin at all
    o_name, o_port = _host_port(parts.netloc, parts.scheme)
    h_name, h_port = _host_port(host, parts.scheme)
    if o_port != h_port:
        return False
    return o_name == h_name or (is_loopback(o_name) and is_loopback(h_name))


class SameOriginOnly:
    """Refuse (403, in the route's error shape) a request whose ``Origin`` names another site, unless
    ``allowed`` (``--cors-origin``) names it, or holds ``*``.

    Bodies are read as JSON whatever their Content-Type (``JsonBodies``), so a web page could send one with
    ``text/plain`` or a form type, which a browser sends cross-site without asking first (no CORS
    preflight); browsers name the page's site in ``Origin``, which this refuses. Clients that are not
    browsers send no ``Origin`` and pass.
    """

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = frozenset(a.rstrip("/") for a in allowed)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and not self.any and origin.rstrip("/") not in self.allowed \
                    and not same_site(origin, headers.get("host", "")):
                err = APIError(403, f"the Origin {origin!r} is another site: this server answers browsers on "
                                    "its own origin only; start it with --cors-origin ORIGIN to allow that site",
                               type="permission_error", code="invalid_origin")
                await error_response(err, scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class JsonBodies:
    """Read every request body as JSON whatever its Content-Type, as llama-server does (``curl -d`` labels a
    body a form, many scripts send no Content-Type): every route of this server takes JSON only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
