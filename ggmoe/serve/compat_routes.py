"""llama-server's own routes on the app: ``/tokenize``, ``/detokenize``, ``/completion`` (and ``/completions``),
``/infill``,
``/embedding(s)``, ``/apply-template``, ``/props``, ``/slots`` and ``/slots/{id}?action=save|restore|erase``;
and Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``.

The handlers are thin: ``ggmoe.serve.native`` shapes the completions, ``ggmoe.serve.lanes`` the lanes (llama-server's
slots); the server object (``ggmoe.serve.app.Server``) holds the model, its request queue and the lane states.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.params import Depends

from ggmoe.serve import anthropic, responses
from ggmoe.serve.anthropic import CountTokensRequest, MessagesRequest
from ggmoe.serve.errors import APIError
from ggmoe.serve.framing import ChatApi
from ggmoe.serve.lanes import LaneState, erase_lane, lane_file, restore_lane, save_lane
from ggmoe.serve.native import tokenize_text
from ggmoe.serve.responses import ResponsesRequest
from ggmoe.serve.schema import (
    ApplyTemplateRequest,
    ChatRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InfillRequest,
    Message,
    NativeCompletionRequest,
    NativeEmbeddingRequest,
    SlotFileRequest,
    TokenizeRequest,
    Tool,
)

if TYPE_CHECKING:
    from ggmoe.engine.llama import GgmoeLlama


class RouteSettings(Protocol):
    """What the routes read of the server's settings (``ggmoe.serve.app.ServeSettings``)."""

    model_id: str  # the name /props reports
    model_path: str  # the GGUF
    slot_save_path: str | None  # where slot files go; None: saving and restoring are refused
    strict_openai: bool  # OpenAI's refusals (a max_tokens beyond the context) instead of llama-server's clamps


class RouteServer(Protocol):
    """The seam: what these routes use of the server object (``ggmoe.serve.app.Server``, which imports this
    module, so it is a protocol; tests/serve check that the server has every name with the same signature)."""

    llama: GgmoeLlama
    settings: RouteSettings
    lanes: list[LaneState]  # llama-server's slots, as /slots shows them
    n_vocab: int  # tokens in the vocabulary
    version: str  # ggmoe's, for /props

    async def native(self, request: Request, body: NativeCompletionRequest, infill: bool) -> Any: ...

    async def as_chat(self, request: Request, chat: ChatRequest, model: str, stream: bool, strict: bool,
                      api: ChatApi) -> Any: ...

    def prompt_size(self, chat: ChatRequest) -> int: ...

    def render(self, messages: list[Message], tools: list[Tool] | None,
               template_kwargs: dict[str, Any] | None = None) -> str: ...

    def check_lane(self, id_slot: int, any_ok: bool = True) -> LaneState | None: ...

    async def holding(self, fn: Callable[[GgmoeLlama], dict[str, Any]], id_slot: int) -> dict[str, Any]: ...

    async def embed(self, request: Request, body: EmbeddingRequest | NativeEmbeddingRequest,
                    native: bool = False) -> Any: ...


def _defaults() -> dict[str, Any]:
    """``/completion``'s defaults, as ``/props`` reports them."""
    fields = NativeCompletionRequest.model_fields
    params = {name: fields[name].get_default(call_default_factory=True)
              for name in ("n_predict", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                           "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta",
                           "stop", "n_probs", "ignore_eos", "stream", "cache_prompt")}
    return {**params, "seed": 4294967295, "max_tokens": -1, "grammar": ""}


def _props(server: RouteServer) -> dict[str, Any]:
    llama, settings = server.llama, server.settings
    formatter = llama.chat_formatter()
    idle = server.lanes[0].to_json()
    return {"default_generation_settings": {**idle, "is_processing": False, "id_task": -1,
                                            "model": settings.model_id, "params": _defaults(),
                                            "prompt": ""},
            "total_slots": len(server.lanes), "model_path": settings.model_path, "model_alias": settings.model_id,
            "chat_template": formatter.template, "chat_template_caps": {}, "bos_token": formatter.bos_token,
            "eos_token": formatter.eos_token, "build_info": f"ggmoe {server.version}",
            "modalities": {"vision": False, "audio": False}, "is_sleeping": False}


def add_anthropic_routes(app: FastAPI, server: RouteServer, auth: list[Depends]) -> None:
    """Register Anthropic's Messages API on ``app``."""

    @app.post("/v1/messages", dependencies=auth)
    async def messages(request: Request, body: MessagesRequest) -> Any:
        return await server.as_chat(request, anthropic.chat_request(body), body.model, body.stream, False,
                                    anthropic.MessagesApi(body, server.llama))

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return {"input_tokens": server.prompt_size(anthropic.chat_request(body))}


def add_responses_routes(app: FastAPI, server: RouteServer, auth: list[Depends]) -> None:
    """OpenAI's Responses API (``ggmoe.serve.responses``)."""

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(request: Request, body: ResponsesRequest) -> Any:
        return await server.as_chat(request, responses.chat_request(body), body.model, body.stream,
                                    server.settings.strict_openai, responses.ResponsesApi(body))


def add_llama_server_routes(app: FastAPI, server: RouteServer, auth: list[Depends]) -> None:
    """Register llama-server's native routes on ``app``: text, generation, and the server's state."""
    _add_text_routes(app, server, auth)
    _add_generation_routes(app, server, auth)
    _add_state_routes(app, server, auth)


def _add_text_routes(app: FastAPI, server: RouteServer, auth: list[Depends]) -> None:
    """``/tokenize``, ``/detokenize``, ``/apply-template``: text in and out, no generation."""
    llama = server.llama

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tokens = tokenize_text(llama, body.content, body.add_special, "content")
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": llama.detokenize([t], special=True).decode("utf-8", "replace")}
                           for t in tokens]}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        bad = [t for t in body.tokens if not 0 <= t < server.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {server.n_vocab})",
                           param="tokens", code="invalid_value")
        return {"content": llama.detokenize(body.tokens, special=True).decode("utf-8", "replace")}

    @app.post("/apply-template", dependencies=auth)
    async def apply_template(body: ApplyTemplateRequest) -> dict[str, Any]:
        from ggmoe.serve.generation import api_error

        try:
            return {"prompt": server.render(body.messages, body.tools, body.chat_template_kwargs)}
        except Exception as e:  # a template that fails to render
            raise api_error(e) from e


def _add_generation_routes(app: FastAPI, server: RouteServer, auth: list[Depends]) -> None:
    """``/completion`` (``/completions``), ``/infill``, ``/embedding`` (``/embeddings``): through the model."""

    @app.post("/completion", dependencies=auth)
    @app.post("/completions", dependencies=auth, include_in_schema=False)
    async def completion(request: Request, body: NativeCompletionRequest) -> Any:
        return await server.native(request, body, infill=False)

    @app.post("/infill", dependencies=auth)
    async def infill(request: Request, body: InfillRequest) -> Any:
        return await server.native(request, body, infill=True)

    @app.post("/embedding", dependencies=auth)
    @app.post("/embeddings", dependencies=auth, include_in_schema=False)
    async def embedding(request: Request, body: NativeEmbeddingRequest) -> Any:
        return await server.embed(request, body, native=True)


def _add_state_routes(app: FastAPI, server: RouteServer, auth: list[Depends]) -> None:
    """``/props``, ``/slots``, ``/slots/{id}`` (save, restore, erase): the server's state."""

    @app.get("/props", dependencies=auth)
    async def props() -> dict[str, Any]:
        return _props(server)

    @app.get("/slots", dependencies=auth)
    async def slots(fail_on_no_slot: bool = False) -> list[dict[str, Any]]:
        states = [s.to_json() for s in server.lanes]
        if fail_on_no_slot and all(s["is_processing"] for s in states):
            raise APIError(503, "no slot available", type="unavailable_error")
        return states

    @app.post("/slots/{id_slot}", dependencies=auth)
    async def slot_action(id_slot: int, action: Literal["save", "restore", "erase"] = Query(),
                          body: SlotFileRequest | None = None) -> dict[str, Any]:
        server.check_lane(id_slot, any_ok=False)
        if action == "erase":
            return {"id_slot": id_slot, **await server.holding(erase_lane, id_slot)}
        if body is None or body.filename is None:
            raise APIError(400, f"action={action} needs a JSON body with a filename", param="filename",
                           code="invalid_value")
        save_dir = server.settings.slot_save_path
        path = lane_file(Path(save_dir) if save_dir else None, body.filename)
        work = save_lane if action == "save" else restore_lane
        return {"id_slot": id_slot, "filename": body.filename,
                **await server.holding(lambda lane_llama: work(lane_llama, path), id_slot)}
