"""The OpenAI-compatible app: FastAPI over llama-cpp-python's request types and ``Llama`` calls.

llama-cpp-python's own ``create_app`` keeps its model in module globals and
builds the ``Llama`` itself from settings, so it cannot serve a ``GgmoeLlama``
without patching those globals; this app is the same stack (FastAPI,
sse-starlette, its request types, its ``create_completion`` /
``create_chat_completion``) around one given model, plus what a shared server
needs: a bounded queue, API keys compared in constant time, a Host check
against DNS rebinding, body limits, OpenAI-shaped errors and Prometheus
metrics.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health (never needs a key), GET /metrics.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from ggmoe.errors import UsageError
from ggmoe.serve import errors
from ggmoe.serve.asgi import BodyLimit, LoopbackHostOnly, RequestCounter
from ggmoe.serve.errors import APIError
from ggmoe.serve.gate import Gate
from ggmoe.serve.generation import Run, Watch, api_error, check_request, plan_chat, plan_completion
from ggmoe.serve.llama import GgmoeLlama
from ggmoe.serve.metrics import Metrics
from ggmoe.serve.schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
                    "/chat/completions", "/completions", "/models", "/v1/health", "/healthz", "/props",
                    "/tokenize", "/detokenize", "/v1/embeddings", "/embeddings", "/openapi.json"})
_DISCONNECT_POLL_S = 0.1  # seconds between checks that a non-streaming client is still there


@dataclass(frozen=True)
class ServeSettings:
    model_id: str  # the name /v1/models lists first; requests may name any model
    api_key: str | None = None  # every route but /health needs "Authorization: Bearer <key>"
    max_queue: int = 16  # requests that may wait while one generates; more get 429
    max_body_bytes: int = 1 << 20  # bytes; larger request bodies get 413
    loopback_only: bool = True  # refuse Host headers that are not loopback names (DNS rebinding)
    cors_origins: tuple[str, ...] = ()  # CORS stays off unless origins are given
    aliases: tuple[str, ...] = ()  # more names /v1/models lists for the one model
    strict_openai: bool = False  # max_tokens beyond the context: 400 (OpenAI) instead of clamped (llama-server)
    model_path: str = ""  # the GGUF, for /props
    # MoEpic's reconfiguration: every this many generated tokens, when idle, the configurator on the recent
    # routing may replace the cache (ggmoe.serve.reconfigure); 0: off. The hardware profile it estimates with.
    reconfigure_every: int = 0
    reconfigure_hw: str = "pcie4"


log = logging.getLogger("ggmoe.serve")


class _Server:
    """The model, its gate and metrics; the route handlers' shared state."""

    def __init__(self, llama: GgmoeLlama, settings: ServeSettings) -> None:
        self.llama = llama
        self.settings = settings
        self.gate = Gate(settings.max_queue)
        self.metrics = Metrics(llama.stats, lambda: self.gate.waiting, lambda: self.gate.running)
        self.n_ctx = llama.n_ctx()
        self.n_vocab = llama.n_vocab()
        self.reconfigurer = None  # ggmoe.serve.reconfigure.Reconfigurer when the settings ask for it
        if settings.reconfigure_every:
            self.reconfigurer = _reconfigurer(llama, settings)

    def maybe_reconfigure(self) -> None:
        """Between requests, holding the model, no one waiting: MoEpic's configurator on the recent routing
        (every ``reconfigure_every`` tokens); a proposal that pays replaces the cache. A failure is logged and
        leaves the server without a cache rather than failing a request."""
        r = self.reconfigurer
        if r is None or not r.due() or self.gate.waiting:
            return
        cache = self.llama.cache_config
        stats = self.llama.stats()["cache"]
        if cache is None or stats is None:
            return
        proposal = r.propose(cache, {int(il): n for il, n in stats["slots_per_layer"].items()})
        if proposal is None:
            return
        try:
            self.llama.reconfigure(proposal.config)
        except Exception as e:  # noqa: BLE001 - logged; the next request runs (without a cache if it fell)
            log.warning("reconfiguration failed: %s", e)
            return
        r.applied += 1
        self.metrics.reconfigured.inc()
        log.warning("reconfigured the expert cache (MoEpic, %d tokens of routing): estimated wait %.3f -> %.3f ms "
                    "per token", proposal.tokens, proposal.current_s * 1e3, proposal.exposed_s * 1e3)

    # -- one request
    async def generate(self, request: Request, body: CompletionRequest | ChatRequest, chat: bool) -> Any:
        arrival = time.monotonic()
        strict = self.settings.strict_openai
        check_request(body, self.n_ctx, self.n_vocab, strict)
        try:
            plan = (plan_chat if chat else plan_completion)(body, self.llama, self.n_ctx, strict)
        except Exception as e:  # a template that fails to render, a grammar that does not parse
            raise api_error(e) from e
        watch = Watch(arrival, self.n_ctx, plan.kwargs["max_tokens"], self.llama.is_eog)
        run = Run(plan, self.llama, watch, body.model or self.settings.model_id)
        await self.gate.enter()
        lease = _Lease(self)
        try:
            if body.stream:
                # The first chunk is computed before the 200, so early errors keep their status.
                chunks, first = await self._run(request, watch, lambda: _start(run.chunks))
                lease.chunks = chunks
                usage = body.stream_options is not None and body.stream_options.include_usage
                return EventSourceResponse(self._events(first, chunks, watch, usage, lease), sep="\n",
                                           background=BackgroundTask(lease.release))
            result = await self._run(request, watch, run.result)
        except BaseException:
            await lease.release()
            raise
        await lease.release()
        self._observe(watch)
        return result

    async def embed(self, request: Request, body: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embeddings: each input's mean-pooled final hidden state (normalised)."""
        inp = body.input
        if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], int)):
            inp = [inp]  # type: ignore[list-item]
        if not inp or any(isinstance(x, str | list) and len(x) == 0 for x in inp):
            raise APIError(400, "input must not be empty", param="input", code="invalid_value")
        texts = []
        for x in inp:
            if isinstance(x, list):
                bad = [t for t in x if not 0 <= t < self.n_vocab]
                if bad:
                    raise APIError(400, f"input token id {bad[0]} is outside the vocabulary [0, {self.n_vocab})",
                                   param="input", code="invalid_value")
                x = self.llama.detokenize(x).decode("utf-8", "replace")
            texts.append(x)
        n_batch = self.llama.n_batch
        for i, t in enumerate(texts):
            n = len(self.llama.tokenize(t.encode("utf-8")))
            if n == 0:  # llama.cpp cannot decode an empty batch (and llama-cpp-python then corrupts its heap)
                raise APIError(400, f"input {i} has no tokens", param="input", code="invalid_value")
            if n > n_batch:
                raise APIError(400, f"input {i} has {n} tokens; at most {n_batch} per input", param="input",
                               code="context_length_exceeded")
        watch = Watch(time.monotonic(), self.n_ctx, None, self.llama.is_eog)
        await self.gate.enter()
        lease = _Lease(self)
        try:
            vectors, n_tokens = await self._run(request, watch, lambda: self.llama.embed_mean(texts))
        finally:
            await lease.release()
        data = []
        for i, v in enumerate(vectors):
            emb: Any = v
            if body.encoding_format == "base64":
                import base64

                import numpy as np

                emb = base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": body.model or self.settings.model_id,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    async def _run(self, request: Request, watch: Watch, fn: Callable[[], Any]) -> Any:
        """``fn`` in a worker thread, with ``watch`` attached and the client watched for a disconnect."""
        self.llama.watch = watch
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_client, request, watch)
            try:
                result = await anyio.to_thread.run_sync(fn)
            except Exception as e:
                error = e
            tg.cancel_scope.cancel()
        if error is not None:
            raise api_error(error) from error
        return result

    async def _watch_client(self, request: Request, watch: Watch) -> None:
        while not watch.cancel.is_set():
            if await request.is_disconnected():
                watch.cancel.set()
                self.metrics.cancelled.inc()
                return
            await anyio.sleep(_DISCONNECT_POLL_S)

    async def _events(self, first: dict[str, Any] | None, chunks: Iterator[dict[str, Any]], watch: Watch,
                      usage: bool, lease: _Lease) -> AsyncIterator[dict[str, str]]:
        """SSE events; when the client goes, the generation stops after the token being computed."""
        last = first
        try:
            chunk = first
            while chunk is not None:
                yield {"data": json.dumps(chunk)}
                last = chunk
                chunk = await anyio.to_thread.run_sync(next, chunks, None)
            if usage and last is not None:
                yield {"data": json.dumps({"id": last["id"], "object": last["object"], "created": last["created"],
                                           "model": last["model"], "choices": [], "usage": watch.usage()})}
            yield {"data": "[DONE]"}
            self._observe(watch)
        except anyio.get_cancelled_exc_class():
            watch.cancel.set()
            self.metrics.cancelled.inc()
            raise
        except Exception as e:  # after the 200 the error can only travel in the stream
            err = api_error(e)
            errors.log.warning("stream stopped: %s", e)
            yield {"data": json.dumps(errors.error_body(err.message, err.type, err.param, err.code))}
        finally:
            with anyio.CancelScope(shield=True):
                await lease.release()

    def _observe(self, watch: Watch) -> None:
        m = self.metrics
        m.prompt_tokens.inc(watch.n_prompt)
        m.completion_tokens.inc(watch.n_tokens)
        if watch.ttft is not None:
            m.ttft.observe(watch.ttft)
        if watch.tpot is not None:
            m.tpot.observe(watch.tpot)


def _start(chunks_of: Callable[[], Iterator[dict[str, Any]]]
           ) -> tuple[Iterator[dict[str, Any]], dict[str, Any] | None]:
    """A stream and its first chunk (prefill and first token)."""
    chunks = chunks_of()
    return chunks, next(chunks, None)


class _Lease:
    """The model held by one request; ``release`` (idempotent) closes its stream and frees the gate."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.chunks: Iterator[dict[str, Any]] | None = None
        self.released = False

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        close = getattr(self.chunks, "close", None)
        if close is not None:
            await anyio.to_thread.run_sync(close)  # stops llama-cpp-python's generator
        self.server.llama.watch = None
        if self.server.reconfigurer is not None:
            await anyio.to_thread.run_sync(self.server.maybe_reconfigure)  # still holding the model
        self.server.gate.leave()


class _Authenticate:
    """The API-key check: ``Authorization: Bearer <key>``, compared in constant time."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        self.bearer = HTTPBearer(auto_error=False)  # FastAPI's parser of the Authorization header

    async def __call__(self, request: Request) -> None:
        if self.api_key is None:
            return
        credentials = await self.bearer(request)
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode("utf-8"), self.api_key.encode("utf-8")):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def _reconfigurer(llama: GgmoeLlama, settings: ServeSettings) -> Any:
    """The Reconfigurer the settings ask for, observing the model's routing."""
    from ggmoe.cache.hardware import load_profile
    from ggmoe.inspect import inspect_model
    from ggmoe.serve.reconfigure import Reconfigurer

    if llama.cache_config is None:
        raise UsageError("--reconfigure-every needs a cache (--cache-slots, --vram or --config)")
    r = Reconfigurer(inspect_model(settings.model_path), load_profile(settings.reconfigure_hw),
                     settings.reconfigure_every)
    llama.add_observer(r)
    return r


def create_app(llama: GgmoeLlama, settings: ServeSettings) -> FastAPI:
    """The app serving ``llama`` (which the caller owns and closes)."""
    server = _Server(llama, settings)
    auth = [Depends(_Authenticate(settings.api_key))]
    app = FastAPI(title="ggmoe", version=_version(), docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = server
    errors.install(app)
    created = int(time.time())

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    @app.get("/healthz", include_in_schema=False)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_id, "queue_length": server.gate.waiting,
                "running": server.gate.running}

    @app.get("/v1/models", dependencies=auth)
    @app.get("/models", dependencies=auth, include_in_schema=False)
    async def models() -> dict[str, Any]:
        names = [settings.model_id, *(a for a in settings.aliases if a != settings.model_id)]
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "ggmoe", "permissions": [],
             "meta": {"n_ctx": server.n_ctx, "n_vocab": server.n_vocab, "aliases": names}} for name in names]}

    @app.post("/v1/completions", dependencies=auth)
    @app.post("/completions", dependencies=auth, include_in_schema=False)
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await server.generate(request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    @app.post("/chat/completions", dependencies=auth, include_in_schema=False)
    async def chat_completions(request: Request, body: ChatRequest) -> Any:
        return await server.generate(request, body, chat=True)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tokens = llama.tokenize(body.content.encode("utf-8"), add_bos=body.add_special, special=True)
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

    @app.post("/v1/embeddings", dependencies=auth)
    @app.post("/embeddings", dependencies=auth, include_in_schema=False)
    async def embeddings(request: Request, body: EmbeddingRequest) -> Any:
        return await server.embed(request, body)

    @app.get("/props", dependencies=auth)
    async def props() -> dict[str, Any]:
        formatter = llama.chat_formatter()
        return {"model_path": settings.model_path, "model_alias": settings.model_id, "total_slots": 1,
                "chat_template": formatter.template, "bos_token": formatter.bos_token,
                "eos_token": formatter.eos_token, "build_info": f"ggmoe {_version()}",
                "modalities": {"vision": False, "audio": False},
                "default_generation_settings": {"n_ctx": server.n_ctx, "model": settings.model_id, "params": {
                    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1,
                    "n_predict": -1}}}

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # Outermost last: count every response, then refuse foreign Hosts, then limit bodies.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    if settings.loopback_only:
        app.add_middleware(LoopbackHostOnly)
    app.add_middleware(RequestCounter, count=lambda route, status: server.metrics.requests.labels(
        route, str(status)).inc(), routes=ROUTES)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ggmoe")
    except PackageNotFoundError:
        return "0"
