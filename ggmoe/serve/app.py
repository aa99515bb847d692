"""The app: FastAPI over llama-cpp-python's request types and ``Llama`` calls, speaking OpenAI's API,
llama-server's own routes (``ggmoe.serve.compat_routes``, ``native``, ``slots``), and the APIs whose requests run
as an OpenAI chat (Anthropic's Messages, OpenAI's Responses): ``Server.as_chat`` with the API's ``ChatApi``
(``ggmoe.serve.framing``), which ``anthropic`` and ``responses`` implement.

llama-cpp-python's own ``create_app`` keeps its model in module globals and
builds the ``Llama`` itself from settings, so it cannot serve a ``GgmoeLlama``
without patching those globals; this app is the same stack (FastAPI,
sse-starlette, its request types, its ``create_completion`` /
``create_chat_completion``) around one given model, plus what a shared server
needs: a bounded queue, API keys compared in constant time, a Host check
against DNS rebinding, body limits, OpenAI-shaped errors and Prometheus
metrics.

Routes here: POST /v1/chat/completions (and /chat/completions), POST /v1/completions, POST /v1/embeddings,
GET /v1/models (and /models), GET /health (never needs a key), GET /metrics. Every generation, whatever its
route, goes through ``Server.execute``: the request queue, the lane's state, the client watched, the stream framed as
its route frames it (``Sse``).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.security import APIKeyHeader, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from ggmoe.base.errors import UsageError
from ggmoe.control.prefetch import reader_behind_note
from ggmoe.engine.llama import GgmoeLlama
from ggmoe.engine.parallel import LanePool
from ggmoe.serve import errors
from ggmoe.serve.asgi import BodyLimit, JsonBodies, LoopbackHostOnly, RequestCounter, SameOriginOnly
from ggmoe.serve.compat_routes import add_anthropic_routes, add_llama_server_routes, add_responses_routes
from ggmoe.serve.errors import APIError
from ggmoe.serve.framing import ChatApi, Sse, data, error_data
from ggmoe.serve.generation import Run, Watch, api_error, check_request, prepare_chat, prepare_completion
from ggmoe.serve.lanes import LaneState
from ggmoe.serve.metrics import Metrics
from ggmoe.serve.native import NativeRun, infill_tokens, processors, prompt_tokens
from ggmoe.serve.pump import Pump
from ggmoe.serve.request_queue import RequestQueue
from ggmoe.serve.schema import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Message,
    NativeCompletionRequest,
    NativeEmbeddingRequest,
    Tool,
)

if TYPE_CHECKING:
    from ggmoe.serve.reconfigure import Reconfigurer

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
                    "/chat/completions", "/completions", "/models", "/v1/health", "/healthz", "/props",
                    "/tokenize", "/detokenize", "/v1/embeddings", "/embeddings", "/openapi.json",
                    "/completion", "/infill", "/apply-template", "/slots", "/embedding",
                    "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"})
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
    slot_save_path: str | None = None  # where /slots/{id}?action=save|restore keep their files; None: refused
    parallel: int = 1  # slots decoding together (the model loaded with n_seq_max = parallel); more wait
    # variables every chat template rendering gets (--chat-template-kwargs); a request's own override them
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


log = logging.getLogger("ggmoe.serve")


READER_NOTE_MIN_LAYERS = 256  # layers the predictor's reader read with a target before the server judges its pace


class Server:
    """The model, its request queue and metrics; the route handlers' shared state."""

    def __init__(self, llama: GgmoeLlama, settings: ServeSettings) -> None:
        self.llama = llama
        self.settings = settings
        n_lanes = settings.parallel
        self.pool = LanePool(llama, n_lanes) if n_lanes > 1 else None  # the lanes' views and their batcher
        self.queue = RequestQueue(settings.max_queue, n_lanes)
        self.n_ctx = self.pool.n_ctx if self.pool is not None else llama.n_ctx()  # tokens per lane
        self.n_vocab = llama.n_vocab()
        self.lanes = [LaneState(i, self.n_ctx) for i in range(n_lanes)]  # llama-server's slots, as /slots shows
        self._busy: set[int] = set()  # lanes held by a request
        self._live: set[Watch] = set()  # the generations running now (stopped together at shutdown)
        self.stopping = False  # set by stop_generations: the server is shutting down
        self.metrics = Metrics(llama.stats, lambda: self.queue.waiting, lambda: self.queue.running, self.lanes,
                               self.pool.batcher.stats if self.pool is not None else None)
        self._tasks = itertools.count()  # task ids, as /slots shows them
        self.version = _version()
        self.reconfigurer: Reconfigurer | None = None  # when the settings ask for it
        self._reader_noted = False  # the predictor's reader said to lag (once per server)
        if settings.reconfigure_every:
            self.reconfigurer = _reconfigurer(llama, settings)

    def stop_generations(self) -> None:
        """Shutdown (SIGTERM, Ctrl-C): every running generation stops at its next token, so its answer or stream
        ends as usual (``finish_reason`` ``length``, a stream's final events), and a request still waiting for
        a lane gets a 503. Safe from a signal handler: it only sets flags."""
        self.stopping = True
        for watch in list(self._live):
            watch.cancel.set()

    def close(self) -> None:
        """Stop the slots' batcher (before the model is closed)."""
        if self.pool is not None:
            self.pool.close()

    def note_reader(self) -> None:
        """After a request: the first time the async decode's predictor has read a quarter or more of its layers
        too late to prefetch (``reader_behind_note``), one warning in the log; /metrics has the counts."""
        if self._reader_noted or self.llama.run_config is None or self.llama.run_config.prefetch is None:
            return
        pre = (self.llama.stats()["cache"] or {}).get("prefetch") or {}
        if pre.get("layers_targeted", 0) < READER_NOTE_MIN_LAYERS:  # a short first request says little yet
            return
        note = reader_behind_note(pre)
        if note is not None:
            self._reader_noted = True
            log.warning("%s", note)

    def maybe_reconfigure(self) -> None:
        """Between requests, holding the model, no one waiting: MoEpic's configurator on the recent routing
        (every ``reconfigure_every`` tokens); a proposal that pays replaces the cache. A failure is logged and
        leaves the server without a cache rather than failing a request."""
        r = self.reconfigurer
        if r is None or not r.due() or self.queue.waiting:
            return
        run = self.llama.run_config
        stats = self.llama.stats()["cache"]
        if run is None or stats is None:
            return
        proposal = r.propose(run, {int(il): n for il, n in stats["slots_per_layer"].items()})
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
        if chat:
            body.chat_template_kwargs = self.template_kwargs(body.chat_template_kwargs)
        try:
            ready = (prepare_chat if chat else prepare_completion)(body, self.llama, self.n_ctx, strict)
        except Exception as e:  # a template that fails to render, a grammar that does not parse
            raise api_error(e) from e
        watch = Watch(arrival, self.n_ctx, ready.kwargs["max_tokens"], self.llama.is_eog)
        run = Run(ready, self.llama, watch, body.model or self.settings.model_id)
        usage = body.stream_options is not None and body.stream_options.include_usage
        params = _shown(ready.kwargs)
        # the prompt's logprobs need every position's logits: a lane has only its last ones
        return await self.execute(request, watch, body.stream, run.result, run.chunks, _openai_sse(usage),
                                  params, run, ready.prompt, whole=ready.echo_logprobs)

    async def native(self, request: Request, body: NativeCompletionRequest, infill: bool) -> Any:
        """llama-server's ``/completion`` (or ``/infill``): its prompt forms, fields and shapes."""
        self.check_lane(body.id_slot)
        watch = Watch(time.monotonic(), self.n_ctx, None, self.llama.is_eog)
        try:
            prompts = ([infill_tokens(body, self.llama, self.n_ctx)] if infill  # type: ignore[arg-type]
                       else prompt_tokens(body.prompt, self.llama, self.n_vocab))
            eog = self.llama.eog_tokens() if body.ignore_eos else []
            run = NativeRun(body, prompts, self.llama, watch, self.settings.model_id, self.n_ctx,
                            processors(body, self.llama, self.n_vocab, eog))
        except Exception as e:  # a grammar or schema that does not convert
            raise api_error(e) from e
        return await self.execute(request, watch, body.stream, run.result, run.chunks, NATIVE_SSE,
                                  run.settings(), run, prompts[0], body.id_slot)

    async def as_chat(self, request: Request, chat: ChatRequest, model: str, stream: bool, strict: bool,
                      api: ChatApi) -> Any:
        """A request of another API run as an OpenAI chat, its answer in the shapes of that API (``api``: Anthropic's
        Messages, OpenAI's Responses)."""
        arrival = time.monotonic()
        chat.chat_template_kwargs = self.template_kwargs(None)
        check_request(chat, self.n_ctx, self.n_vocab, strict)
        try:
            ready = prepare_chat(chat, self.llama, self.n_ctx, strict)
        except Exception as e:  # a template that fails to render, a schema that does not convert
            raise api_error(e) from e
        watch = Watch(arrival, self.n_ctx, ready.kwargs["max_tokens"], self.llama.is_eog)
        run = Run(ready, self.llama, watch, model)
        return await self.execute(request, watch, stream, lambda: api.result(run, watch, ready),
                                  lambda: api.chunks(run, watch, ready), api.sse, _shown(ready.kwargs), run,
                                  ready.prompt)

    def prompt_size(self, chat: ChatRequest) -> int:
        """Tokens of a chat's prompt as the template renders it (tools included), no generation."""
        chat.chat_template_kwargs = self.template_kwargs(None)
        try:
            ready = prepare_chat(chat, self.llama, 1 << 30, False)
        except Exception as e:
            raise api_error(e) from e
        return len(ready.prompt)

    def template_kwargs(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The chat template's extra variables: ``--chat-template-kwargs``, then the request's own."""
        return {**self.settings.chat_template_kwargs, **(given or {})}

    def render(self, messages: list[Message], tools: list[Tool] | None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt the model's chat template makes of ``messages`` (``/apply-template``)."""
        from ggmoe.serve import structured

        formatter = self.llama.chat_formatter()
        kw: dict[str, Any] = self.template_kwargs(template_kwargs)
        if tools and structured.template_renders_tools(formatter.template):
            kw["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        return formatter(messages=[m.for_template() for m in messages], **kw).prompt

    def check_lane(self, id_slot: int, any_ok: bool = True) -> LaneState | None:
        """The lane a request names (None for -1: any, where ``any_ok``); 400 for one this server does not have."""
        if id_slot == -1 and any_ok:
            return None
        if not 0 <= id_slot < len(self.lanes):
            raise APIError(400, f"no slot {id_slot}: this server has {len(self.lanes)} (ids 0 to "
                                f"{len(self.lanes) - 1})", param="id_slot", code="invalid_value")
        return self.lanes[id_slot]

    async def _lease(self, prompt: list[int] | None = None, id_slot: int = -1, whole: bool = False) -> _Lease:
        """A lane for one request (the one it names, or the free one whose cached prompt it shares most), or,
        with ``whole`` and several lanes, the whole model once every lane is idle (their prompt caches are
        forgotten: the model's own ``Llama`` runs on the context)."""
        pool = self.pool
        if pool is None or whole:
            n = self.queue.n_lanes
            ticket = await (self.queue.enter_all() if pool is not None else self.queue.enter())
            if pool is not None:
                pool.forget_all()
            self._busy.update(range(n))
            return _Lease(self, ticket, 0, self.llama, n)
        ticket = await self.queue.enter()
        free = [i for i in range(len(self.lanes)) if i not in self._busy]
        lane = pool.pick(free, prompt, id_slot)
        self._busy.add(lane)
        return _Lease(self, ticket, lane, pool.lanes[lane], 1)

    async def execute(self, request: Request, watch: Watch, stream: bool, result: Callable[[], Any],
                      chunks_of: Callable[[], Iterator[dict[str, Any]]], sse: Sse, params: dict[str, Any],
                      run: Run | NativeRun, prompt: list[int] | None = None, id_slot: int = -1, whole: bool = False) -> Any:
        """One generation holding a lane: its result, or its stream as server-sent events. ``run`` (a
        ``Run`` or ``NativeRun``) is given the lane's ``Llama`` and id first."""
        lease = await self._lease(prompt, id_slot, whole)
        if self.stopping:
            await lease.release()
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        lease.watch = watch
        self._live.add(watch)
        run.llama, run.id_slot = lease.llama, lease.lane
        self.lanes[lease.lane].begin(next(self._tasks), params, lambda: watch.n_tokens, watch.max_tokens)
        try:
            if stream:
                # The first chunk is computed before the 200, so early errors keep their status. With several
                # slots a stream is generated in its own thread: a slow client never holds back the others.
                cancel = watch.cancel if self.pool is not None else None
                chunks, first = await self._run(request, watch, lambda: _start(chunks_of, cancel), lease.llama)
                lease.chunks = chunks
                return EventSourceResponse(self._events(first, chunks, watch, sse, lease), sep="\n",
                                           background=BackgroundTask(lease.release))
            out = await self._run(request, watch, result, lease.llama)
        except BaseException:
            await lease.release()
            raise
        await lease.release()
        self._observe(watch)
        return out

    async def holding(self, fn: Callable[[GgmoeLlama], dict[str, Any]], id_slot: int) -> dict[str, Any]:
        """``fn(llama)`` in a worker thread on lane ``id_slot``'s ``Llama`` while every lane is idle (slot
        actions: the other lanes' prompt caches stay)."""
        if self.pool is None:
            lease = await self._lease()
        else:
            ticket = await self.queue.enter_all()
            self._busy.update(range(self.queue.n_lanes))
            lease = _Lease(self, ticket, id_slot, self.pool.lanes[id_slot], self.queue.n_lanes)
        try:
            return await anyio.to_thread.run_sync(fn, lease.llama)
        finally:
            await lease.release()

    async def embed(self, request: Request, body: EmbeddingRequest | NativeEmbeddingRequest,
                    native: bool = False) -> Any:
        """OpenAI's embeddings (or llama-server's native list): each input's mean-pooled final hidden state
        (normalised)."""
        inp = body.inputs if isinstance(body, NativeEmbeddingRequest) else body.input
        if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], int)):
            inp = [inp]  # type: ignore[list-item]
        if not inp or any(isinstance(x, str | list) and len(x) == 0 for x in inp):
            raise APIError(400, "input must not be empty", param="content" if native else "input",
                           code="invalid_value")
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
            if n > min(n_batch, self.n_ctx):
                raise APIError(400, f"input {i} has {n} tokens; at most {min(n_batch, self.n_ctx)} per input",
                               param="input", code="context_length_exceeded")
        watch = Watch(time.monotonic(), self.n_ctx, None, self.llama.is_eog)
        lease = await self._lease(whole=True)  # Llama.embed clears the KV cache: every lane idle
        try:
            vectors, n_tokens = await self._run(request, watch, lambda: self.llama.embed_mean(texts), self.llama)
        finally:
            await lease.release()
        if native:  # llama-server's: the pooled vector of each input, in a list of one
            return [{"index": i, "embedding": [v]} for i, v in enumerate(vectors)]
        data = []
        for i, v in enumerate(vectors):
            emb: Any = v
            if isinstance(body, EmbeddingRequest) and body.encoding_format == "base64":
                import base64

                import numpy as np

                emb = base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": emb})
        model = body.model if isinstance(body, EmbeddingRequest) else None
        return {"object": "list", "data": data, "model": model or self.settings.model_id,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    async def _run(self, request: Request, watch: Watch, fn: Callable[[], Any], llama: GgmoeLlama) -> Any:
        """``fn`` in a worker thread, with ``watch`` attached to ``llama`` and the client watched for a
        disconnect."""
        llama.watch = watch
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
                      sse: Sse, lease: _Lease) -> AsyncIterator[dict[str, str]]:
        """SSE events; when the client goes, the generation stops after the token being computed."""
        last = first
        try:
            chunk = first
            while chunk is not None:
                yield sse.event(chunk)
                last = chunk
                chunk = await anyio.to_thread.run_sync(next, chunks, None)
            for event in sse.tail(last, watch):
                yield event
            self._observe(watch)
        except anyio.get_cancelled_exc_class():
            watch.cancel.set()
            self.metrics.cancelled.inc()
            raise
        except Exception as e:  # after the 200 the error can only travel in the stream
            err = api_error(e)
            errors.log.warning("stream stopped: %s", e)
            yield sse.error(err)
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


def _shown(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings /slots shows: numbers, strings and plain lists of them (not a
    ``StoppingCriteriaList`` of functions, which no JSON holds)."""
    def plain(v: Any) -> bool:
        return isinstance(v, int | float | str) or (type(v) is list and all(plain(x) for x in v))

    return {k: v for k, v in kwargs.items() if plain(v)}


def _openai_sse(usage: bool) -> Sse:
    """OpenAI's: chunks, a usage chunk when asked, then ``[DONE]``."""

    def tail(last: dict[str, Any] | None, watch: Watch) -> list[dict[str, str]]:
        out = []
        if usage and last is not None:
            out.append(data({"id": last["id"], "object": last["object"], "created": last["created"],
                              "model": last["model"], "choices": [], "usage": watch.usage()}))
        return [*out, {"data": "[DONE]"}]

    return Sse(data, tail, error_data)


NATIVE_SSE = Sse(data, lambda last, watch: [], error_data)  # llama-server's native routes: no [DONE]


def _start(chunks_of: Callable[[], Iterator[dict[str, Any]]], cancel: threading.Event | None = None
           ) -> tuple[Iterator[dict[str, Any]], dict[str, Any] | None]:
    """A stream and its first chunk (prefill and first token); with ``cancel``, generated in its own thread."""
    chunks = chunks_of()
    if cancel is not None:
        chunks = Pump(chunks, cancel)
    return chunks, next(chunks, None)


class _Lease:
    """A lane (or, with ``n`` = every lane, the whole model) held by one request; ``release`` (idempotent)
    closes its stream and frees its lanes in the request queue."""

    def __init__(self, server: Server, ticket: int, lane: int, llama: GgmoeLlama, n: int) -> None:
        self.server = server
        self.ticket, self.lane, self.llama, self.n = ticket, lane, llama, n
        self.chunks: Iterator[dict[str, Any]] | None = None
        self.watch: Watch | None = None  # the generation holding the lane, if any
        self.released = False

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        server = self.server
        close = getattr(self.chunks, "close", None)
        if close is not None:
            await anyio.to_thread.run_sync(close)  # stops llama-cpp-python's generator
        self.llama.watch = None
        server._live.discard(self.watch)
        server.lanes[self.lane].end()
        server.note_reader()
        if server.reconfigurer is not None:
            await anyio.to_thread.run_sync(server.maybe_reconfigure)  # still holding the model
        server._busy.difference_update(range(server.queue.n_lanes) if self.n > 1 else (self.lane,))
        server.queue.leave(self.ticket, self.n)


class _Authenticate:
    """The API-key check: ``Authorization: Bearer <key>``, compared in constant time."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        self.bearer = HTTPBearer(auto_error=False)  # FastAPI's parser of the Authorization header
        self.x_api_key = APIKeyHeader(name="x-api-key", auto_error=False)  # what Anthropic's clients send

    async def __call__(self, request: Request) -> None:
        if self.api_key is None:
            return
        credentials = await self.bearer(request)
        given = credentials.credentials if credentials is not None else (await self.x_api_key(request) or "")
        if not hmac.compare_digest(given.encode("utf-8"), self.api_key.encode("utf-8")):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def _reconfigurer(llama: GgmoeLlama, settings: ServeSettings) -> Reconfigurer | None:
    """The Reconfigurer the settings ask for, observing the model's routing."""
    from ggmoe.cache.hardware import load_profile
    from ggmoe.inspect import inspect_model
    from ggmoe.serve.reconfigure import Reconfigurer

    if llama.run_config is None:
        raise UsageError("--reconfigure-every needs a cache (--cache-slots, --vram or --config)")
    if settings.parallel > 1:
        raise UsageError("--reconfigure-every needs the model to itself between requests: not with --parallel > 1")
    r = Reconfigurer(inspect_model(settings.model_path), load_profile(settings.reconfigure_hw),
                     settings.reconfigure_every)
    llama.add_observer(r)
    return r


def create_app(llama: GgmoeLlama, settings: ServeSettings) -> FastAPI:
    """The app serving ``llama`` (which the caller owns and closes)."""
    server = Server(llama, settings)
    auth = [Depends(_Authenticate(settings.api_key))]
    app = FastAPI(title="ggmoe", version=_version(), docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = server
    errors.install(app)
    created = int(time.time())

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    @app.get("/healthz", include_in_schema=False)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_id, "queue_length": server.queue.waiting,
                "running": server.queue.running}

    @app.get("/v1/models", dependencies=auth)
    @app.get("/models", dependencies=auth, include_in_schema=False)
    async def models() -> dict[str, Any]:
        names = [settings.model_id, *(a for a in settings.aliases if a != settings.model_id)]
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "ggmoe", "permissions": [],
             "meta": {"n_ctx": server.n_ctx, "n_vocab": server.n_vocab, "aliases": names}} for name in names]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await server.generate(request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    @app.post("/chat/completions", dependencies=auth, include_in_schema=False)
    async def chat_completions(request: Request, body: ChatRequest) -> Any:
        return await server.generate(request, body, chat=True)

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(request: Request, body: EmbeddingRequest) -> Any:
        return await server.embed(request, body)

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_llama_server_routes(app, server, auth)
    add_anthropic_routes(app, server, auth)
    add_responses_routes(app, server, auth)

    # Outermost last: count every response, refuse foreign Hosts, then other sites' pages (a JSON body may come
    # as text/plain or a form, which browsers send cross-site without a preflight), then limit bodies.
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])
    app.add_middleware(SameOriginOnly, allowed=settings.cors_origins)
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
