"""Request bodies: llama-cpp-python's server types plus the OpenAI fields they lack.

``CreateCompletionRequest`` and ``CreateChatCompletionRequest`` come from
``llama_cpp.server.types`` (pydantic models over llama-cpp-python's own
TypedDicts); the subclasses add ``stream_options`` (usage at the end of a
stream), token-id prompts and ``max_completion_tokens``, and give messages a
clear error before the union of message types reports every alternative.
"""

from __future__ import annotations

from typing import Any

from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import BaseModel, Field, field_validator, model_validator

# The roles llama-cpp-python's message types accept.
ROLES = ("system", "user", "assistant", "tool", "function")


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(CreateCompletionRequest):
    # A string, one string in a list, or token ids (OpenAI's forms for one prompt).
    prompt: str | list[str] | list[int] = Field(default="", description="The prompt, as text or token ids.")
    stream_options: StreamOptions | None = None


class ChatRequest(CreateChatCompletionRequest):
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(default=None, description="OpenAI's newer name for max_tokens.")

    @model_validator(mode="before")
    @classmethod
    def _messages_given(cls, data: Any) -> Any:
        # llama-cpp-python's type defaults messages to []; OpenAI requires them: check them as given.
        if isinstance(data, dict) and "messages" not in data:
            return {**data, "messages": None}
        return data

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(value):
            if not isinstance(m, dict):
                raise ValueError(f"message {i} is not an object")
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"message {i} has role {role!r}; roles are {', '.join(ROLES)}")
            if role in ("system", "user") and not isinstance(m.get("content"), str | list):
                raise ValueError(f"message {i} ({role}) needs content (a string or a list of parts)")
        return value
