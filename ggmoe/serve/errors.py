"""Errors in each route's own shape with the right HTTP status.

OpenAI's (and llama-server's) ``{"error": {"message", "type", "param", "code"}}`` everywhere but under
``/v1/messages``, where Anthropic's ``{"type": "error", "error": {"type", "message"}}`` is used. The
server's one error edge: validation errors, HTTP errors, the server's own refusals (``APIError``) and
ggmoe's domain errors (``ggmoe.base.errors``, mapped by class in ``domain_error``: a ``UsageError`` raised while
serving a request is that request's 400, wherever it was raised) become these shapes here; anything else
is a 500 (``server_error``, Anthropic's ``api_error``) with the details in the server log, never in the
response.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ggmoe.base.errors import ContextLengthError, EngineError, GgmoeError, UsageError

log = logging.getLogger("ggmoe.serve")

# HTTP status -> OpenAI error type for errors raised as plain HTTP errors
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """A request the server refuses, with its OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.extra = extra  # more fields of the error object (llama-server's n_prompt_tokens and n_ctx)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


# ggmoe's domain errors -> (status, OpenAI error type, code), the first class that matches: a usage error
# is the request's (400); any other domain error met while serving (an engine failure, a file the server
# reads) is the server's (500), its message kept (it names no internals: it is written for users).
_DOMAIN: tuple[tuple[type[GgmoeError], int, str, str], ...] = (
    (ContextLengthError, 400, "invalid_request_error", "context_length_exceeded"),
    (UsageError, 400, "invalid_request_error", "invalid_value"),
    (EngineError, 500, "server_error", "engine_error"),
    (GgmoeError, 500, "server_error", "server_error"),
)


def domain_error(e: GgmoeError, param: str | None = None) -> APIError:
    """A domain error raised while serving a request, as the API error its client sees."""
    status, etype, code = next((s, t, c) for cls, s, t, c in _DOMAIN if isinstance(e, cls))
    if status >= 500:
        log.error("%s while serving a request", type(e).__name__, exc_info=e)
    return APIError(status, str(e), type=etype, param=param if status < 500 else None, code=code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code, **(extra or {})}}


def over_context(n_prompt: int, n_ctx: int, param: str, strict: bool = False) -> APIError:
    """A prompt that alone fills the context: llama-server's ``exceed_context_size_error`` with its
    ``n_prompt_tokens`` and ``n_ctx`` (OpenAI's ``invalid_request_error`` when ``strict``), code
    ``context_length_exceeded`` (OpenAI's) either way."""
    return APIError(400, f"the request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens): "
                         "raise --n-ctx or shorten the prompt", param=param, code="context_length_exceeded",
                    type="invalid_request_error" if strict else "exceed_context_size_error",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


# OpenAI error type -> Anthropic's (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {"server_error": "api_error", "unavailable_error": "overloaded_error",
                    "exceed_context_size_error": "invalid_request_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_body(message: str, type: str, status: int = 400) -> dict[str, Any]:
    etype = "request_too_large" if status == 413 else _ANTHROPIC_TYPES.get(type, type)
    return {"type": "error", "error": {"type": etype, "message": message}}


def error_response(e: APIError, path: str = "") -> JSONResponse:
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_body(e.message, e.type, e.status), status_code=e.status, headers=e.headers)
    return JSONResponse(error_body(e.message, e.type, e.param, e.code, e.extra), status_code=e.status,
                        headers=e.headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages.0.role``."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


# What pydantic puts before the message of an error raised in a validator: its own wording, not the user's.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def plain_message(msg: object) -> str:
    """A validation message without pydantic's prefix (``"Value error, x"`` -> ``"x"``)."""
    text = str(msg)
    for prefix in _PYDANTIC_PREFIXES:
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    path = request.url.path
    if first.get("type") == "json_invalid":
        return error_response(APIError(400, "the request body is not valid JSON", code="invalid_json"), path)
    param = _param(tuple(first.get("loc", ())))
    msg = f"{param}: {plain_message(first.get('msg'))}" if param else plain_message(first.get("msg"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return error_response(APIError(400, msg, param=param, code="invalid_value"), path)


def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    etype = _TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    return error_response(APIError(exc.status_code, str(exc.detail), type=etype,
                                   headers=getattr(exc, "headers", None)), request.url.path)


def _api(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


def _domain(request: Request, exc: GgmoeError) -> JSONResponse:
    return error_response(domain_error(exc), request.url.path)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, "internal server error", type="server_error"), request.url.path)


def install(app: FastAPI) -> None:
    """Register the handlers that give every error its route's shape."""
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(APIError, _api)
    app.add_exception_handler(GgmoeError, _domain)
    app.add_exception_handler(Exception, _unexpected)
