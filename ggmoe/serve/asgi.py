"""Two small ASGI middlewares Starlette does not ship: a request-body size limit and a request counter.

Both wrap the ASGI callables only; parsing stays uvicorn's and Starlette's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (by Content-Length, or while streaming in)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
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

    def __init__(self, app: Any, count: Callable[[str, int], None], routes: frozenset[str]) -> None:
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
