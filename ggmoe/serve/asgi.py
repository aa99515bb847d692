"""Small ASGI middlewares Starlette does not ship: a body size limit, a request counter, a loopback Host check.

Both wrap the ASGI callables only; parsing stays uvicorn's and Starlette's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

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
