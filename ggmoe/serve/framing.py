"""How an API frames a chat's answer: its stream's events (``Sse``), and, for the APIs that run a request as an
OpenAI chat (Anthropic's Messages, OpenAI's Responses), its answer and chunks in their own shapes (``ChatApi``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ggmoe.serve import errors
from ggmoe.serve.errors import APIError

if TYPE_CHECKING:
    from ggmoe.serve.generation import ReadyRequest, Run, Watch


@dataclass(frozen=True)
class Sse:
    """How a route frames its stream: each chunk, what follows the last one, an error after the 200."""

    event: Callable[[dict[str, Any]], dict[str, str]]
    tail: Callable[[dict[str, Any] | None, Watch], list[dict[str, str]]]
    error: Callable[[APIError], dict[str, str]]


class ChatApi(Protocol):
    """An API whose request runs as an OpenAI chat: its stream framing, and the chat's result and chunks in its
    own shapes."""

    sse: Sse

    def result(self, run: Run, watch: Watch, ready: ReadyRequest) -> dict[str, Any]:
        """The whole answer, once the chat has run."""

    def chunks(self, run: Run, watch: Watch, ready: ReadyRequest) -> Iterator[dict[str, Any]]:
        """The answer's stream events, as the chat's chunks come."""


def data(chunk: dict[str, Any]) -> dict[str, str]:
    """A chunk as a plain ``data:`` event."""
    return {"data": json.dumps(chunk)}


def error_data(err: APIError) -> dict[str, str]:
    """An error after the 200 as OpenAI's and llama-server's streams carry it."""
    return {"data": json.dumps(errors.error_body(err.message, err.type, err.param, err.code, err.extra))}


def typed_event(chunk: dict[str, Any]) -> dict[str, str]:
    """A chunk as a named event (its ``type``), as Anthropic's and the Responses API's streams carry them."""
    return {"event": chunk["type"], "data": json.dumps(chunk)}
