"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

The server's one error edge: validation errors, HTTP errors and ggmoe's own
request errors become this shape here; anything else is a 500 ``server_error``
with the details in the server log, never in the response.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ggmoe.serve")

# HTTP status -> OpenAI error type for errors raised as plain HTTP errors
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """A request the server refuses, with its OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages.0.role``."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return JSONResponse(error_body("the request body is not valid JSON", "invalid_request_error", None,
                                       "invalid_json"), status_code=400)
    param = _param(tuple(first.get("loc", ())))
    msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return JSONResponse(error_body(msg, "invalid_request_error", param, "invalid_value"), status_code=400)


def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    etype = _TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    return JSONResponse(error_body(str(exc.detail), etype), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def _api(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the OpenAI shape."""
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(APIError, _api)
    app.add_exception_handler(Exception, _unexpected)
