"""``ggmoe serve`` (the OpenAI-compatible server) and ``ggmoe chat`` (the terminal chat)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ggmoe.base.errors import ContextLengthError, UsageError
from ggmoe.base.outputs import write_text_atomic
from ggmoe.cli.cache_flags import StatsOut, cache_from_flags
from ggmoe.cli.edge import edge
from ggmoe.cli.options import SEED, CacheFlags, FiniteFloat, cache_options, model_arg, model_facts, model_path
from ggmoe.cli.serve_flags import (
    MAX_DEFAULT_CTX,
    EngineFlags,
    HttpFlags,
    ServerFlags,
    TemplateFlags,
    engine_options,
    http_options,
    server_options,
    template_options,
)

if TYPE_CHECKING:
    from ggmoe.engine.llama import GgmoeLlama
    from ggmoe.serve.app import ServeSettings

MIN_LANE_CTX = 16  # tokens per slot at least (ggmoe.engine.parallel.MIN_LANE_CTX)


def default_n_ctx(path: Path) -> int:
    """The model's training context (``{arch}.context_length``), capped at MAX_DEFAULT_CTX."""
    from ggmoe.inspect.reader import read_header

    kv = read_header(path).kv
    n_train = kv.get(f"{kv.get('general.architecture')}.context_length")
    return min(int(n_train), MAX_DEFAULT_CTX) if isinstance(n_train, int) and n_train > 0 else MAX_DEFAULT_CTX


@dataclass(frozen=True)
class LoadOptions:
    """What serve and chat share: the model, its context and threads, and the cache flags."""

    model: str | None
    engine: EngineFlags
    cache: CacheFlags


def _load(opts: LoadOptions, **extra: Any) -> tuple[GgmoeLlama, StatsOut | None]:
    """The model as a GgmoeLlama and the --stats-out writer, every flag checked before the model loads."""
    from ggmoe.engine.llama import load

    path = model_path(opts.model)
    facts = model_facts(path)
    run, out = cache_from_flags(path, facts, opts.cache)
    eng = opts.engine
    kw: dict[str, Any] = {"n_ctx": eng.n_ctx or default_n_ctx(path), "verbose": eng.verbose, **extra}
    if eng.threads:
        kw.update(n_threads=eng.threads, n_threads_batch=eng.threads)
    if out is not None:
        kw["observers"] = [out.collector]
    return load(path, run=run, **kw), out


def _write_stats(llama: GgmoeLlama, opts: LoadOptions, out: StatsOut | None) -> None:
    """--stats-json (the cache statistics) and --stats-out (routing statistics) when serve or chat stops."""
    if opts.cache.stats_json is not None:
        write_text_atomic(opts.cache.stats_json, json.dumps(llama.stats()["cache"], indent=2))
    if out is not None:
        run = llama.run_config
        out.save(llama.prefetcher, run.prefetch.predictor if run and run.prefetch else None)


def check_listen(host: str, port: int) -> None:
    """Fail before the model loads when ``host:port`` cannot be listened on (in use, not this machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: cannot resolve it ({e.strerror})") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def _model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What serve and chat share: the engine's flags (context, threads, the log), the cache and warm-start flags."""
    return cache_options(engine_options(fn))


class _Stopped(Exception):
    """SIGTERM, raised where uvicorn re-raises the signal it caught once it has shut down."""


def _run_until_stopped(run: Callable[[], object]) -> None:
    """Run the server until Ctrl-C or SIGTERM, then return so the model is closed and stats written.

    uvicorn shuts down gracefully on either signal, then raises it again in the process; a handler turns
    that second one into a return instead of death by signal (exit status 0, nothing lost).
    """
    def stop(signum: int, frame: object) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        run()
    except (_Stopped, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _fit(path: Path, cache: CacheFlags, threads: int | None) -> CacheFlags:
    """--fit: the cache flags ``ggmoe.cli.fit`` plans on this machine (it checks the flags first)."""
    from ggmoe.cli.fit import CACHE_FLAGS, fit, read_nvidia_smi
    from ggmoe.engine.loader import gpu_device_name

    if any(getattr(cache, k) is not None for k in CACHE_FLAGS):
        return fit(None, cache, threads, click.echo, None, None)  # refuses them, before anything loads
    gpu = gpu_device_name()
    return fit(model_facts(path), cache, threads, click.echo, gpu, read_nvidia_smi() if gpu else None)


@click.command()
@model_arg
@http_options
@server_options
@template_options
@click.option("--fit", is_flag=True,
              help="Choose the cache as `ggmoe plan MODEL --gpu` does, on this machine: the GPU found by name in the "
                   "parts file (or --hw GPU/LINK/HOST), its free VRAM and link from nvidia-smi, the CPU measured; "
                   "prints every way's estimate. Without a GPU it says so and serves from host memory.")
@_model_options
@edge
def serve(model: str | None, http: HttpFlags, server: ServerFlags, template: TemplateFlags, fit: bool,
          engine: EngineFlags, cache: CacheFlags) -> None:
    """Serve a model over HTTP: OpenAI's API, llama-server's routes, Anthropic's Messages API (--parallel N: N
    generations decoding together).

    \b
    Routes (docs/serving.md):
      OpenAI:        POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses;
                     GET /v1/models
      llama-server:  POST /completion (and /completions), /infill, /embedding(s), /tokenize,
                     /detokenize, /apply-template, /slots/{id}?action=save|restore|erase;
                     GET /props, /slots; /chat/completions and /models without /v1
      Anthropic:     POST /v1/messages, /v1/messages/count_tokens
      Server:        GET /health (no key needed), GET /metrics (Prometheus)
    \b
    Examples:
      ggmoe serve                                  # the embedded model on 127.0.0.1:8080
      ggmoe serve model.gguf --cache-slots 16 --predictor reuse --api-key secret
      ggmoe serve model.gguf --config plan.toml --reconfigure-every 2048   # MoEpic's split, re-planned
      ggmoe serve --parallel 4 --n-ctx 1024        # 4 slots of 256 tokens, decoded together
      ggmoe serve Qwen3-30B-A3B-Q4_K_M.gguf --fit   # the cache plan --gpu would choose, on this machine
      curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
           -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
    """
    from ggmoe.serve.app import create_app
    from ggmoe.serve.runner import run_app

    max_body_bytes = _check_http_options(http.api_key, http.model_name, http.max_body)
    template_text, template_kwargs = _chat_template_options(template)
    path = model_path(model)
    if fit:
        cache = _fit(path, cache, engine.threads)
    check_listen(http.host, http.port)
    _check_server_side(server, cache)
    engine = replace(engine, n_ctx=engine.n_ctx or default_n_ctx(path))
    _check_parallel(server.parallel, server.reconfigure_every, engine.n_ctx)
    settings = _settings(http, server, path, max_body_bytes, template_kwargs)
    opts = LoadOptions(str(path), engine, cache)
    extra: dict[str, Any] = {"n_seq_max": server.parallel, "kv_unified": server.kv_unified} if server.parallel > 1 else {}
    if template_text is not None:
        extra["chat_template"] = template_text
    llama, out = _load(opts, logits_all=server.logprobs, **extra)
    with llama:
        app = create_app(llama, settings)
        _announce(settings.model_id, http.host, http.port, http.api_key)
        _announce_cache(llama.stats().get("cache"))
        _run_until_stopped(lambda: run_app(app, http.host, http.port, "info" if engine.verbose else "warning"))
        app.state.server.close()
        _write_stats(llama, opts, out)
    click.echo("ggmoe serve: stopped")


def _settings(http: HttpFlags, server: ServerFlags, path: Path, max_body_bytes: int,
              template_kwargs: dict[str, Any]) -> ServeSettings:
    """The app's settings from the checked flags."""
    from ggmoe.serve.app import ServeSettings

    return ServeSettings(model_id=http.model_name or Path(path).stem, api_key=http.api_key,
                         max_queue=http.max_queue, max_body_bytes=max_body_bytes,
                         loopback_only=_loopback(http.host, http.api_key), cors_origins=http.cors_origin,
                         aliases=http.aliases, strict_openai=http.strict_openai, model_path=str(path),
                         reconfigure_every=server.reconfigure_every or 0, reconfigure_hw=server.reconfigure_hw,
                         slot_save_path=server.slot_save_path, parallel=server.parallel,
                         chat_template_kwargs=template_kwargs)


def _check_http_options(api_key: str | None, model_name: str | None, max_body: str) -> int:
    """The HTTP side's options, checked before anything loads; the largest request body in bytes."""
    from ggmoe.base.units import parse_bytes

    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty")
    if model_name is not None and not model_name.strip():
        raise UsageError("--model-name is empty: leave it out for the file's name")
    max_body_bytes = parse_bytes(max_body)
    if max_body_bytes < 1:
        raise UsageError("--max-body 0 would refuse every request: give a size such as 1MiB")
    return max_body_bytes


def _reasoning(budget: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """--reasoning-budget as llama-server takes it: -1 leaves the template's thinking as it is, 0 renders every
    chat with enable_thinking false (unless --chat-template-kwargs says otherwise: then one clear error)."""
    if budget == -1:
        return kwargs
    if budget != 0:
        raise UsageError(f"--reasoning-budget {budget}: ggmoe cuts no thinking at a token budget; give -1 "
                         "(think) or 0 (no thinking)")
    if kwargs.get("enable_thinking", False) is not False:
        raise UsageError("--reasoning-budget 0 turns thinking off, but --chat-template-kwargs sets enable_thinking")
    return {**kwargs, "enable_thinking": False}


def _chat_template_options(flags: TemplateFlags) -> tuple[str | None, dict[str, Any]]:
    """--chat-template or --chat-template-file (a Jinja template, checked), and --chat-template-kwargs (a JSON
    object) with --reasoning-budget's, before anything loads."""
    template, path, kwargs = flags.chat_template, flags.chat_template_file, flags.chat_template_kwargs
    reasoning_budget = flags.thinking
    from ggmoe.engine.llama import chat_template_of, check_chat_template
    from ggmoe.serve.schema import check_template_kwargs

    if template is not None and path is not None:
        raise UsageError("give --chat-template or --chat-template-file, not both")
    if path is not None:
        try:
            template = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template-file {path}: {getattr(e, 'strerror', None) or e}") from e
    if template is not None:
        template = chat_template_of(template)
        check_chat_template(template)
    if kwargs is None:
        return template, _reasoning(reasoning_budget, {})
    try:
        parsed = json.loads(kwargs)
    except ValueError as e:
        raise UsageError(f"--chat-template-kwargs is not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise UsageError("--chat-template-kwargs must be a JSON object, such as '{\"enable_thinking\": false}'")
    try:
        check_template_kwargs(parsed)
    except ValueError as e:
        raise UsageError(f"--chat-template-kwargs: {e}") from e
    return template, _reasoning(reasoning_budget, parsed)


def _loopback(host: str, api_key: str | None) -> bool:
    """Whether ``host`` is a loopback address (the server then checks the Host header); a warning when the
    server is open to the network with no key."""
    from ggmoe.serve.asgi import is_loopback

    loopback = is_loopback(host)
    if not loopback and api_key is None:
        click.echo(f"warning: serving on {host} (not loopback) without an API key: anyone who can reach this "
                   "port can use the model; set --api-key or GGMOE_API_KEY", err=True)
    return loopback


def _check_server_side(server: ServerFlags, cache: CacheFlags) -> None:
    """What the server's own options need, checked (the slot directory made) before the model loads."""
    reconfigure_hw, slot_save_path = server.reconfigure_hw, server.slot_save_path
    if server.reconfigure_every is not None:
        if all(v is None for v in (cache.cache_slots, cache.vram, cache.config)):
            raise UsageError("--reconfigure-every needs a cache: --cache-slots N, --vram BYTES or --config FILE")
        from ggmoe.cache.hardware import load_profile

        load_profile(reconfigure_hw)  # a bad profile fails now, before the model loads
    if slot_save_path is not None:
        try:
            Path(slot_save_path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--slot-save-path {slot_save_path}: {e.strerror}") from e


def _check_parallel(parallel: int, reconfigure_every: int | None, n_ctx: int) -> None:
    """--parallel's rules, before the model loads: a share of the context per slot, no reconfiguration."""
    if parallel > 1 and reconfigure_every is not None:
        raise UsageError("--reconfigure-every needs the model to itself between requests: not with --parallel > 1")
    if n_ctx // parallel < MIN_LANE_CTX:
        raise UsageError(f"--n-ctx {n_ctx} gives each of {parallel} slots {n_ctx // parallel} tokens: give at least "
                         f"{MIN_LANE_CTX * parallel}")


def _announce_cache(cache: dict[str, Any] | None) -> None:
    """What the expert cache chose and why: the decode mode, the miss policy, where prefetching runs."""
    if not cache:
        return
    click.echo(f"cache: {cache.get('decode_mode_in_effect')} decode ({cache.get('decode_mode_reason')}); "
               f"misses: {cache.get('miss_policy_in_effect')}"
               + (f" ({cache['miss_policy_note']})" if cache.get("miss_policy_note") else ""))
    tier = cache.get("host_tier")
    if tier:
        from ggmoe.base.units import format_bytes

        click.echo(f"disk tier: the experts do not fit --host-ram {format_bytes(tier['host_ram'])}: "
                   f"{tier['host_slots_per_layer']} host slots per layer hold the hot ones, the rest are read "
                   f"from the model file ({'O_DIRECT' if tier['direct_io'] else 'page cache, dropped after use'})")
    pf = cache.get("prefetch")
    if pf:
        click.echo(f"prefetch: {pf['predictor']}, stride {pf['stride']}, on the {pf['runs_on']}, "
                   f"{pf['experts_per_layer']} experts per layer ahead")


def _announce(model_id: str, host: str, port: int, api_key: str | None) -> None:
    """Where the server listens, and a curl line to try it (the key named, not printed)."""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    key = "$GGMOE_API_KEY" if os.environ.get("GGMOE_API_KEY") == api_key else "KEY"
    auth = f' -H "Authorization: Bearer {key}"' if api_key else ""
    click.echo(f"ggmoe serve: {model_id} at {url}/v1  (health: {url}/health, metrics: {url}/metrics)")
    click.echo(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
               "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 32}'")
    sys.stdout.flush()


@click.command()
@model_arg
@click.option("-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Tokens per answer at most.")
@click.option("--temp", default=0.7, show_default=True, type=FiniteFloat(min=0.0),
              help="Sampling temperature (0: greedy).")
@click.option("--seed", type=SEED, help="Sampling seed (default: a new one per answer).")
@click.option("--system", help="A system message opening the conversation.")
@_model_options
@edge
def chat(model: str | None, max_tokens: int, temp: float, seed: int | None, system: str | None,
         engine: EngineFlags, cache: CacheFlags) -> None:
    """Chat with a model in the terminal; answers stream as they are generated.

    \b
    In the chat: /reset forgets the conversation, /stats prints the cache
    statistics, Ctrl-C stops the current answer, Ctrl-D or /quit leaves.
    \b
    Examples:
      ggmoe chat
      ggmoe chat model.gguf --cache-slots 16 --system "You are terse."
    """
    from ggmoe.serve.chat import ChatOptions, run_chat

    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    opts = LoadOptions(model, engine, cache)
    llama, out = _load(opts)
    with llama:
        try:
            run_chat(llama, ChatOptions(max_tokens=max_tokens, temperature=temp, seed=seed, system=system), input,
                     write)
        except ContextLengthError:  # the conversation outgrew the context: the stats so far, then the error
            _write_stats(llama, opts, out)
            raise
        _write_stats(llama, opts, out)
