"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request (system prompt, content blocks, tools, tool use and tool results) is checked for Anthropic's
rules (the first turn is the user's; ``tool_use`` only in assistant turns; a ``tool_result`` answers an
earlier ``tool_use``; consecutive turns of one role are joined, as Anthropic joins them), then turned into
the OpenAI chat request the rest of the server runs (the model's chat template, tool calls in its format).
The answer is shaped back: ``content`` blocks (``text``, ``tool_use`` with ``toolu_`` ids), ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), ``usage``; a stream sends Anthropic's events
in its order: ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, ``message_delta``, ``message_stop``. Errors use Anthropic's shape
(``ggmoe.serve.errors``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ggmoe.serve import errors
from ggmoe.serve.errors import APIError, plain_message
from ggmoe.serve.framing import Sse, typed_event
from ggmoe.serve.schema import ChatRequest

if TYPE_CHECKING:
    from ggmoe.engine.llama import GgmoeLlama
    from ggmoe.serve.generation import ReadyRequest, Run, Watch

# Anthropic's stream: named events, nothing after the last, an error as an ``error`` event
SSE = Sse(typed_event, lambda last, watch: [],
          lambda err: {"event": "error", "data": json.dumps(errors.anthropic_body(err.message, err.type, err.status))})


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations
    type: Literal["text"]
    text: str


class MediaBlock(BaseModel):
    """Images and documents: in the schema so that the refusal says why (a text-only model)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result"]


class ThinkingBlock(BaseModel):
    """A thinking block of an earlier turn: accepted and left out of the prompt."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(b, MediaBlock) for b in self.content):
            raise ValueError("tool results with images or documents are not supported: a text-only model")
        return "\n".join(b.text for b in self.content)  # type: ignore[union-attr]


Block = Annotated[TextBlock | MediaBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs a name")
        return self


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, thinking, service_tier...: accepted, ignored
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _order(self) -> CountTokensRequest:
        _check_turns(self.messages)
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


def _check_turns(messages: list[AnthropicMessage]) -> None:
    """Anthropic's rules on the order of turns and tool blocks (ValueError: a 400)."""
    if messages[0].role != "user":
        raise ValueError("messages: the first message must use the user role")
    if messages[-1].role == "assistant":
        raise ValueError("messages: a final assistant turn (a prefill) is not supported; end with a user turn")
    used: set[str] = set()
    for i, m in enumerate(messages):
        for b in m.blocks():
            if isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise ValueError(f"messages.{i}: tool_use blocks belong to assistant turns")
                used.add(b.id)
            elif isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise ValueError(f"messages.{i}: tool_result blocks belong to user turns")
                if b.tool_use_id not in used:
                    raise ValueError(f"messages.{i}: tool_result for {b.tool_use_id!r}, which no earlier "
                                     "tool_use has")
            elif isinstance(b, MediaBlock):
                raise ValueError(f"messages.{i}: {b.type} blocks are not supported: this server runs a "
                                 "text-only model (send text blocks)")


# -- to the OpenAI request the server runs
def _openai_turns(m: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic turn as OpenAI messages: tool results first (``tool`` turns), then the text and calls."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for b in m.blocks():
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}})
    text = "\n".join(texts)
    if m.role == "assistant":
        out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    elif text or not out:
        out.append({"role": "user", "content": text})
    return out


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}] if text else []


def chat_request(body: CountTokensRequest) -> ChatRequest:
    """The OpenAI chat request of an Anthropic one (400 in Anthropic's shape where it does not convert)."""
    messages = _system(body.system)
    for m in body.messages:
        messages += _openai_turns(m)
    data: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        data["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
        choice = body.tool_choice or ToolChoice(type="auto")
        data["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        data["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        data.update(max_tokens=body.max_tokens, temperature=body.temperature, stop=body.stop_sequences or None)
        if body.top_p is not None:
            data["top_p"] = body.top_p
        if body.top_k is not None:
            data["top_k"] = body.top_k
    try:
        return ChatRequest.model_validate(data)
    except (ValidationError, ValueError) as e:
        first = plain_message(e.errors()[0]["msg"]) if isinstance(e, ValidationError) else str(e)
        raise APIError(400, f"the request does not convert: {first}") from e


# -- back to Anthropic's shapes
def _tool_id(openai_id: str) -> str:
    return "toolu_" + openai_id.removeprefix("call_")


def stop_of(finish: str | None, sampled_text: str, stops: list[str], ended_by_eog: bool) -> tuple[str, str | None]:
    """stop_reason and stop_sequence of an OpenAI finish_reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    found = [(sampled_text.find(s), s) for s in stops if s in sampled_text]
    if found and not ended_by_eog:
        return "stop_sequence", min(found)[1]
    return "end_turn", None


def message(result: dict[str, Any], model: str, stop: tuple[str, str | None]) -> dict[str, Any]:
    """Anthropic's message from an OpenAI chat completion."""
    msg = result["choices"][0]["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    usage = result["usage"]
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


class MessageEvents:
    """Anthropic's stream events from the OpenAI chat chunks of one generation."""

    def __init__(self, chunks: Iterator[dict[str, Any]], model: str, n_input: int,
                 stop: Callable[[str | None], tuple[str, str | None]], n_output: Callable[[], int]) -> None:
        self.chunks = chunks
        self.model = model
        self.n_input = n_input
        self.stop = stop  # finish_reason -> (stop_reason, stop_sequence), once the generation ended
        self.n_output = n_output  # () -> tokens generated so far
        self.index = -1  # the open block's index
        self.open: str | None = None  # the open block's type

    def _start(self, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._stop()
        self.index += 1
        self.open = block["type"]
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def _stop(self) -> Iterator[dict[str, Any]]:
        if self.open is not None:
            yield {"type": "content_block_stop", "index": self.index}
            self.open = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        first = next(self.chunks, None)  # the prefill, before anything is sent
        yield {"type": "message_start", "message": {
            "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.n_input, "output_tokens": 0}}}
        yield {"type": "ping"}
        finish = None
        chunk = first
        while chunk is not None:
            choice = chunk["choices"][0] if chunk["choices"] else None
            delta = choice["delta"] if choice else {}
            if delta.get("content"):
                if self.open != "text":
                    yield from self._start({"type": "text", "text": ""})
                yield {"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "text_delta", "text": delta["content"]}}
            for call in delta.get("tool_calls") or []:
                yield from self._start({"type": "tool_use", "id": _tool_id(call["id"]),
                                        "name": call["function"]["name"], "input": {}})
                yield {"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}}
            finish = (choice or {}).get("finish_reason") or finish
            chunk = next(self.chunks, None)
        if self.index < 0:
            yield from self._start({"type": "text", "text": ""})
        yield from self._stop()
        reason, sequence = self.stop(finish)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": self.n_output()}}
        yield {"type": "message_stop"}


class MessagesApi:
    """``/v1/messages`` as a ``ChatApi``: the chat's answer as Anthropic's message, its chunks as Anthropic's
    events, the stop reason from what was sampled."""

    sse = SSE

    def __init__(self, body: MessagesRequest, llama: GgmoeLlama) -> None:
        self.body = body
        self.llama = llama

    def _stop(self, watch: Watch, finish: str | None) -> tuple[str, str | None]:
        is_eog = self.llama.is_eog
        text = self.llama.detokenize([t for t in watch.sampled if not is_eog(t)]).decode("utf-8", "replace")
        ended = watch.last is not None and is_eog(watch.last)
        return stop_of(finish, text, self.body.stop_sequences or [], ended)

    def result(self, run: Run, watch: Watch, ready: ReadyRequest) -> dict[str, Any]:
        r = run.result()
        return message(r, self.body.model, self._stop(watch, r["choices"][0]["finish_reason"]))

    def chunks(self, run: Run, watch: Watch, ready: ReadyRequest) -> Iterator[dict[str, Any]]:
        return iter(MessageEvents(run.chunks(), self.body.model, len(ready.prompt),
                                lambda finish: self._stop(watch, finish), lambda: watch.n_tokens))
