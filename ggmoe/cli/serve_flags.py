"""``ggmoe serve``'s option groups, each handed to the command as one record: the HTTP side, the server's own
work, the chat template, and the engine (shared with ``ggmoe chat``)."""

from __future__ import annotations

from dataclasses import dataclass

import click

from ggmoe.cli.groups import option_group
from ggmoe.cli.options import threads_opt, verbose_opt

MAX_DEFAULT_CTX = 4096  # tokens: the default context is the model's training context, at most this
MAX_PARALLEL = 64  # slots (ggmoe.engine.llama.MAX_SEQUENCES)


@dataclass(frozen=True)
class HttpFlags:
    """Where the server listens and what it lets in."""

    host: str  # the address to bind
    port: int
    api_key: str | None  # required as a Bearer token on every route but /health; None: no key
    model_name: str | None  # the model id /v1/models lists first; None: the file's stem
    aliases: tuple[str, ...]  # more names /v1/models lists
    strict_openai: bool  # refuse a max_tokens beyond the context instead of clamping it
    max_queue: int  # requests that may wait while one generates
    max_body: str  # the largest request body, e.g. "1MiB"
    cors_origin: tuple[str, ...]  # browser origins allowed


@dataclass(frozen=True)
class ServerFlags:
    """What the server does besides answering: lanes, MoEpic's reconfiguration, slot files, prompt logprobs."""

    logprobs: bool  # keep every position's logits (the prompt's logprobs with echo)
    reconfigure_every: int | None  # generated tokens between MoEpic's reconfigurations; None: never
    slot_save_path: str | None  # the directory of slot files; None: save and restore refused
    parallel: int  # lanes decoding together
    reconfigure_hw: str  # the hardware profile the reconfiguration estimates with
    kv_unified: bool  # the lanes share one KV cache


@dataclass(frozen=True)
class TemplateFlags:
    """The chat template: the model's, a named or given one, and the variables every rendering gets."""

    chat_template: str | None  # a Jinja template or a name (chatml, llama3, mistral-v1)
    chat_template_file: str | None
    chat_template_kwargs: str | None  # a JSON object
    thinking: int  # --reasoning-budget: -1 thinks, 0 does not


@dataclass(frozen=True)
class EngineFlags:
    """The model's context and threads, and llama.cpp's log."""

    n_ctx: int | None  # tokens; None: the model's training context, at most MAX_DEFAULT_CTX
    threads: int | None  # None: llama-cpp-python's default
    verbose: bool


_HTTP = (
    click.option("--cors-origin", multiple=True, help="Allow browser requests from this origin, such as "
                                                      "http://localhost:3000 (repeatable; '*': any). Without it a "
                                                      "request whose Origin is another site is refused (403)."),
    click.option("--max-body", default="1MiB", show_default=True, help="Largest request body; larger gets 413."),
    click.option("--max-queue", default=16, show_default=True, type=click.IntRange(min=0),
                 help="Requests that may wait while one generates; more get 429."),
    click.option("--strict-openai", is_flag=True, help="Refuse (400) a max_tokens beyond the context, as OpenAI "
                                                       "does, instead of clamping it as llama-server does."),
    click.option("--alias", "aliases", multiple=True, help="Another name /v1/models lists for the model (repeatable)."),
    click.option("--model-name", help="Model id listed first in /v1/models (default: the file's stem); requests "
                                      "may name any model."),
    click.option("--api-key", envvar="GGMOE_API_KEY", show_envvar=True,
                 help="Require 'Authorization: Bearer KEY' on every route but /health."),
    click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="TCP port."),
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind."),
)
_SERVER = (
    click.option("--kv-unified/--no-kv-unified", default=True, show_default=True,
                 help="With --parallel > 1: the slots' sequences share one KV cache (llama-server's --kv-unified), or "
                      "each has its own stream of n_ctx / N cells (a slot's text at temperature 0 is then the same "
                      "whatever the other slots do; see docs/serving.md)."),
    click.option("--reconfigure-hw", default="pcie4", show_default=True,
                 help="Hardware profile (pcie4, h100, egpu, GPU/LINK/HOST, or a .toml) the reconfiguration estimates with."),
    click.option("-np", "--parallel", default=1, show_default=True, type=click.IntRange(1, MAX_PARALLEL),
                 help="Slots: requests that decode together, one llama_decode per step for all of them (llama-server's "
                      "flag); each slot holds n_ctx / N tokens. More requests wait in the queue."),
    click.option("--slot-save-path", type=click.Path(file_okay=False, dir_okay=True), metavar="DIR",
                 help="Directory where POST /slots/{id}?action=save|restore keeps slot files (llama-server's flag); "
                      "created when missing. Without it, save and restore are refused."),
    click.option("--reconfigure-every", type=click.IntRange(min=1), metavar="TOKENS",
                 help="MoEpic's reconfiguration: every TOKENS generated tokens, between requests, run its configurator "
                      "on the recent routing and replace the cache (slots and top shares per layer, same VRAM) when "
                      "the estimate says it waits less. Needs a cache."),
    click.option("--logprobs", is_flag=True, help="Keep every position's logits so completions with echo may ask "
                                                  "for the prompt's logprobs (n_ctx x n_vocab x 4 bytes of RAM); "
                                                  "generated tokens' logprobs need no flag."),
)
_TEMPLATE = (
    click.option("--reasoning-budget", "thinking", type=int, default=-1, show_default=True, metavar="N",
                 help="llama-server's flag: -1 lets a reasoning model think; 0 turns thinking off (the chat template "
                      "gets enable_thinking false). ggmoe cuts no thinking at a token budget, so only -1 and 0 are taken."),
    click.option("--chat-template-kwargs", metavar="JSON",
                 help="Variables every chat template rendering gets, as a JSON object, e.g. '{\"enable_thinking\": "
                      "false}' (llama-server's flag); a request's chat_template_kwargs override them."),
    click.option("--chat-template-file", type=click.Path(dir_okay=False), metavar="FILE",
                 help="The chat template from a file (llama-server's flag)."),
    click.option("--chat-template", metavar="JINJA_TEMPLATE",
                 help="A Jinja chat template instead of the model's (llama-server's flag), or a name: chatml, llama3, "
                      "mistral-v1."),
)
_CTX = click.option("--n-ctx", type=click.IntRange(min=16, max=1 << 24),
                    help=f"Context length in tokens, prompt and answer (default: the model's training "
                         f"context, at most {MAX_DEFAULT_CTX}).")

http_options = option_group(HttpFlags, "http", *_HTTP)
server_options = option_group(ServerFlags, "server", *_SERVER)
template_options = option_group(TemplateFlags, "template", *_TEMPLATE)
engine_options = option_group(EngineFlags, "engine", verbose_opt, threads_opt, _CTX)
