"""Request bodies: llama-cpp-python's server types plus the OpenAI fields they lack.

``CreateCompletionRequest`` and ``CreateChatCompletionRequest`` come from
``llama_cpp.server.types`` (pydantic models over llama-cpp-python's own
TypedDicts). The subclasses add what OpenAI clients send today and those types
refuse or lack: ``stream_options`` (usage at the end of a stream), token-id
prompts, ``max_completion_tokens``, messages with content-part arrays, the
``developer`` role, assistant turns with ``tool_calls`` and ``content: null``,
``tool`` turns, ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and
``response_format`` with a JSON schema. The models also give the OpenAPI
schema the fuzz tests drive the server with.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

MAX_N = 8  # choices per request at most (they are generated one after another)
MAX_STOP = 4  # OpenAI's cap on stop sequences


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["refusal"]
    refusal: str


class MediaPart(BaseModel):
    """An image, audio or file part: in the schema so that the refusal says why (a text-only model)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image", "input_audio", "audio", "file", "video_url"]


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]
Content = str | list[ContentPart]


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients an object


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(BaseModel):
    """What every chat message shares; one subclass per role (the schema says which fields each needs)."""

    model_config = ConfigDict(extra="allow")
    name: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> _Message:
        content = getattr(self, "content", None)
        for part in content if isinstance(content, list) else ():
            if isinstance(part, MediaPart):
                raise ValueError(f"content parts of type {part.type!r} are not supported: this server runs a "
                                 "text-only model (send text parts)")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, null as ""."""
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "\n".join(p.text if isinstance(p, TextPart) else getattr(p, "refusal", "") for p in content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: string content, ``developer`` as ``system``,
        tool-call arguments as objects (what Hugging Face templates render with ``tojson``)."""
        role = self.role  # type: ignore[attr-defined]
        out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if getattr(self, "tool_call_id", None) is not None:
            out["tool_call_id"] = self.tool_call_id  # type: ignore[attr-defined]
        if getattr(self, "tool_calls", None):
            calls = []
            for c in self.tool_calls:  # type: ignore[attr-defined]
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                           "arguments": args}})
            out["tool_calls"] = calls
        return out


class SystemMessage(_Message):
    role: Literal["system", "developer"]  # "developer": OpenAI's newer name, rendered as "system"
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


class FunctionMessage(_Message):
    role: Literal["function"]  # deprecated: a function's result
    content: Content


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
                    Field(discriminator="role")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-cpp-python's json_object form

    model_config = ConfigDict(populate_by_name=True)

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


def _check_stop(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if isinstance(value, list) and any(s == "" for s in value) or value == "":
        raise ValueError("a stop sequence must not be empty")
    return value


class _Sampling(BaseModel):
    """Bounds on the sampling fields llama-cpp-python's types leave open (each would reach llama.cpp)."""

    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    top_p: float = Field(default=0.95, ge=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)
    repeat_penalty: float = Field(default=1.1, ge=0.0, le=100.0)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    mirostat_mode: int = Field(default=0, ge=0, le=2)
    mirostat_tau: float = Field(default=5.0, ge=0.0, le=100.0)
    mirostat_eta: float = Field(default=0.1, ge=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 64 - 1)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before", check_fields=False)
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return _check_stop(value)


class CompletionRequest(_Sampling, CreateCompletionRequest):
    # A string, one string in a list, or token ids (OpenAI's forms for one prompt).
    prompt: str | list[str] | list[int] = Field(default="", description="The prompt, as text or token ids.")
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=1, ge=1, le=1)


# What the chat formatter itself passes to a template: chat_template_kwargs may not set these.
TEMPLATE_NAMES = frozenset({"messages", "tools", "tool_choice", "functions", "function_call", "eos_token",
                            "bos_token", "raise_exception", "add_generation_prompt", "strftime_now"})


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """llama-server's ``chat_template_kwargs``: more variables for the chat template (``enable_thinking``...)."""
    taken = sorted(set(value or ()) & TEMPLATE_NAMES)
    if taken:
        raise ValueError(f"may not set {', '.join(taken)}: the server passes "
                         f"{'it' if len(taken) == 1 else 'them'} to the template itself")
    return value


class ChatRequest(_Sampling, CreateChatCompletionRequest):
    messages: list[Message] = Field(min_length=1, description="The conversation, oldest first.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="More variables for the chat template, such as enable_thinking (llama-server's).")
    max_completion_tokens: int | None = Field(default=None, ge=1, description="OpenAI's newer name for max_tokens.")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    functions: list[FunctionDef] | None = None  # deprecated: read as tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # deprecated: read as tool_choice

    @model_validator(mode="before")
    @classmethod
    def _messages_given(cls, data: Any) -> Any:
        # llama-cpp-python's type defaults messages to []; OpenAI requires them: check them as given.
        if isinstance(data, dict) and "messages" not in data:
            return {**data, "messages": None}
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatRequest:
        if self.functions and not self.tools:
            self.tools = [Tool(function=f) for f in self.functions]
        if self.function_call is not None and self.tool_choice is None:
            fc = self.function_call
            self.tool_choice = fc if isinstance(fc, str) else NamedToolChoice(function=fc)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among "
                                 f"the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self


class TokenizeRequest(BaseModel):
    """llama-server's ``/tokenize``."""

    content: str = Field(max_length=1 << 20)
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    """llama-server's ``/detokenize``."""

    tokens: list[int]


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


# -- llama-server's native routes (/completion, /infill, /apply-template, /slots)
TokenOrText = StrictInt | str
MAX_NATIVE_STOP = 16  # stop strings per native request (llama-server sets no cap; 16 keeps the scan cheap)


class NativeCompletionRequest(BaseModel):
    """llama-server's ``/completion``: its field names and defaults, the samplers llama-cpp-python has."""

    model_config = ConfigDict(extra="allow")  # llama-server ignores fields it does not know; so does ggmoe
    prompt: str | list[TokenOrText | list[TokenOrText]] = Field(
        description="A string, token ids, a mix of both, or a list of such prompts (one result each).")
    n_predict: int = Field(default=-1, ge=-1, description="Tokens to generate; -1: until the context is full.")
    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, ge=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    typical_p: float = Field(default=1.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, ge=0.0, le=100.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    mirostat: int = Field(default=0, ge=0, le=2)
    mirostat_tau: float = Field(default=5.0, ge=0.0, le=100.0)
    mirostat_eta: float = Field(default=0.1, ge=0.0, le=10.0)
    seed: int = Field(default=-1, ge=-1, le=2 ** 64 - 1, description="-1: a random seed.")
    stop: list[str] = Field(default_factory=list, max_length=MAX_NATIVE_STOP)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int = Field(default=0, ge=0, le=100)
    logit_bias: list[tuple[TokenOrText, float | bool]] | dict[str, float | bool] | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    timings_per_token: bool = Field(default=False, description="Streamed chunks carry the timings so far.")
    return_progress: bool = Field(default=False, description="The first streamed chunk carries prompt_progress.")
    return_tokens: bool = False
    stream: bool = False
    id_slot: int = Field(default=-1, ge=-1)
    n_indent: int = Field(default=0, ge=0, description="Stop at a new line indented less than this (code).")
    t_max_predict_ms: int = Field(default=0, ge=0, description="After this long and a new line, stop (FIM).")
    response_fields: list[str] | None = Field(default=None, max_length=64,
                                              description="Only these fields (a/b unnests b of a).")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("a stop string must not be empty")
        return value

    @model_validator(mode="before")
    @classmethod
    def _max_tokens(cls, data: Any) -> Any:
        # llama-server reads max_tokens when n_predict is not given
        if isinstance(data, dict) and "n_predict" not in data and "max_tokens" in data:
            return {**data, "n_predict": data["max_tokens"]}
        return data

    @model_validator(mode="after")
    def _one_constraint(self) -> NativeCompletionRequest:
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give either grammar or json_schema, not both")
        return self


class ExtraChunk(BaseModel):
    """One context file of ``/infill``'s ``input_extra`` (what llama.vscode sends)."""

    filename: str  # both required, as llama-server requires them
    text: str


class InfillRequest(NativeCompletionRequest):
    """llama-server's ``/infill``: the code around the cursor, context files, and ``/completion``'s options."""

    prompt: str = Field(default="", description="Text put after the FIM middle token (the start of the fill).")
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)


class ApplyTemplateRequest(BaseModel):
    """llama-server's ``/apply-template``: the messages as ``/v1/chat/completions`` takes them."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)


class SlotFileRequest(BaseModel):
    """``/slots/{id}?action=save|restore``: a file name inside ``--slot-save-path``."""

    filename: str | None = Field(default=None, min_length=1, max_length=255)


class NativeEmbeddingRequest(BaseModel):
    """llama-server's ``/embedding`` and ``/embeddings``: ``content`` (or OpenAI's ``input``)."""

    content: str | list[str] | list[int] | list[list[int]] | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None

    @model_validator(mode="after")
    def _given(self) -> NativeEmbeddingRequest:
        if self.content is None and self.input is None:
            raise ValueError("give content (or input)")
        return self

    @property
    def inputs(self) -> Any:
        return self.content if self.content is not None else self.input
