"""OpenAI's Responses API: ``POST /v1/responses``, text in and text out.

A request (``input`` as a string or a list of messages, ``instructions``, ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format``) is turned into the OpenAI chat request the rest of the server runs
(the model's chat template), and its answer shaped back into a ``response`` object: ``output`` holds one
``message`` item with one ``output_text`` part, ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens``; ``usage`` counts ``input_tokens`` and ``output_tokens``.
A stream sends OpenAI's events in its order: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, then
``response.completed`` (or ``response.incomplete``), each with its ``sequence_number``. Nothing is stored:
``previous_response_id`` and tools are a 400 (``/v1/chat/completions`` serves tools).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ggmoe.serve.errors import APIError, plain_message
from ggmoe.serve.framing import Sse, typed_event
from ggmoe.serve.schema import ChatRequest

if TYPE_CHECKING:
    from ggmoe.serve.generation import ReadyRequest, Run, Watch

# the Responses stream: named events, nothing after the last, an error as an ``error`` event
SSE = Sse(typed_event, lambda last, watch: [],
          lambda err: {"event": "error", "data": json.dumps({
              "type": "error", "code": err.code or err.type, "message": err.message, "param": err.param,
              "sequence_number": 0})})

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: accepted, ignored
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # store, metadata, user, reasoning, truncation...: accepted, ignored
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None


def _content(item: dict[str, Any], where: str) -> str:
    """A message item's text: a string, or its text parts joined by newlines (other parts: a 400)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}] is of type {kind!r}: only text parts (input_text, "
                           "output_text) are served (the models are text-only)", param=f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.get("type", "message") != "message" or item.get("role") not in _ROLES:
            raise APIError(400, f"{where} must be a message with a role of {', '.join(_ROLES)} (item type "
                           f"{item.get('type', 'message')!r}, role {item.get('role')!r}): function calls, "
                           "reasoning and other items are not served", param="input")
        messages.append({"role": item["role"], "content": _content(item, where)})
    if not messages:
        raise APIError(400, "input holds no message", param="input")
    return messages


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The OpenAI chat request of a Responses one (400 where it does not convert)."""
    if body.tools:
        raise APIError(400, "tools are not served on /v1/responses: use /v1/chat/completions",
                       param="tools", code="unsupported_value")
    if body.previous_response_id is not None:
        raise APIError(400, "responses are not stored, so previous_response_id names none: send the whole "
                       "conversation as input", param="previous_response_id", code="unsupported_value")
    data: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p)):
        if value is not None:
            data[name] = value
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        data["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        data["response_format"] = {"type": "json_object"}
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        raise APIError(400, f"the request does not convert: {plain_message(e.errors()[0]['msg'])}") from e


class ResponseObject:
    """The ``response`` object of one request, built up as the generation goes."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def item(self, text: str, done: bool) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"id": self.item_id, "type": "message", "status": "completed" if done else "in_progress",
                "role": "assistant", "content": content}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": b.model,
            "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0 if b.temperature is None else b.temperature, "text": {"format": fmt},
            "tool_choice": "auto", "tools": [], "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled", "usage": usage, "user": None, "metadata": {}}


def _usage(n_input: int, n_output: int) -> dict[str, Any]:
    return {"input_tokens": n_input, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_input + n_output}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def response(result: dict[str, Any], obj: ResponseObject) -> dict[str, Any]:
    """The ``response`` object of an OpenAI chat completion."""
    choice = result["choices"][0]
    usage = result["usage"]
    return obj.response(_status(choice["finish_reason"]), [obj.item(choice["message"]["content"] or "", True)],
                          _usage(usage["prompt_tokens"], usage["completion_tokens"]))


def events(chunks: Iterator[dict[str, Any]], obj: ResponseObject, n_input: int,
           n_output: Callable[[], int]) -> Iterator[dict[str, Any]]:
    """OpenAI's Responses stream events (without their sequence numbers) from one generation's chat chunks."""
    first = next(chunks, None)  # the prefill and first token, before anything is sent
    yield {"type": "response.created", "response": obj.response("in_progress", [], None)}
    yield {"type": "response.in_progress", "response": obj.response("in_progress", [], None)}
    where = {"item_id": obj.item_id, "output_index": 0}
    yield {"type": "response.output_item.added", "output_index": 0, "item": obj.item("", False)}
    empty = {"type": "output_text", "text": "", "annotations": []}
    yield {"type": "response.content_part.added", **where, "content_index": 0, "part": empty}
    text, finish, chunk = "", None, first
    while chunk is not None:
        choice = chunk["choices"][0] if chunk["choices"] else {}
        if delta := (choice.get("delta") or {}).get("content"):
            text += delta
            yield {"type": "response.output_text.delta", **where, "content_index": 0, "delta": delta,
                   "logprobs": []}
        finish = choice.get("finish_reason") or finish
        chunk = next(chunks, None)
    yield {"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []}
    yield {"type": "response.content_part.done", **where, "content_index": 0, "part": {**empty, "text": text}}
    item = obj.item(text, True)
    yield {"type": "response.output_item.done", "output_index": 0, "item": item}
    status = _status(finish)
    yield {"type": f"response.{status}", "response": obj.response(status, [item], _usage(n_input, n_output()))}


def numbered(events_: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each event with its ``sequence_number``, from 0."""
    for n, event in enumerate(events_):
        yield {**event, "sequence_number": n}


class ResponsesApi:
    """``/v1/responses`` as a ``ChatApi``: the chat's answer as a ``response`` object, its chunks as the
    Responses API's numbered events."""

    sse = SSE

    def __init__(self, body: ResponsesRequest) -> None:
        self.response_object = ResponseObject(body)

    def result(self, run: Run, watch: Watch, ready: ReadyRequest) -> dict[str, Any]:
        return response(run.result(), self.response_object)

    def chunks(self, run: Run, watch: Watch, ready: ReadyRequest) -> Iterator[dict[str, Any]]:
        return numbered(events(run.chunks(), self.response_object, len(ready.prompt), lambda: watch.n_tokens))
