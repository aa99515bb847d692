"""``ggmoe run``: generate text, optionally from the expert cache and with a trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ggmoe.base.context import check_prompt
from ggmoe.base.errors import UsageError
from ggmoe.cli.cache_flags import cache_from_flags
from ggmoe.cli.edge import edge
from ggmoe.cli.options import (
    CacheFlags,
    FiniteFloat,
    cache_options,
    ctx_opt,
    make_engine,
    model_arg,
    model_facts,
    model_path,
    stats_summary,
    threads_opt,
    toy_notice,
    verbose_opt,
    write_stats,
)

if TYPE_CHECKING:
    from ggmoe.engine.engine import Generation
from ggmoe.base.outputs import check_output_dir

MAX_PROMPT_BYTES = 16 << 20  # a prompt file larger than this is surely a mistake


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from -p TEXT, -p - (standard input) or --prompt-file FILE; UTF-8 text only."""
    if (prompt is None) == (prompt_file is None):
        raise UsageError("give the prompt with -p TEXT, -p - (read standard input) or --prompt-file FILE")
    if prompt is not None and prompt != "-":
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("the prompt is not valid UTF-8 text") from None
        return prompt
    if prompt_file is not None:
        p = Path(prompt_file)
        if not p.is_file():
            raise UsageError(f"prompt file not found (or not a regular file): {p}")
        if p.stat().st_size > MAX_PROMPT_BYTES:
            raise UsageError(f"prompt file {p} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
        raw = p.read_bytes()
    else:
        raw = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        if len(raw) > MAX_PROMPT_BYTES:
            raise UsageError(f"the prompt on standard input is larger than {MAX_PROMPT_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"the prompt is not UTF-8 text (byte {e.start})") from None
    if not text:
        raise UsageError("the prompt is empty")
    return text


@click.command()
@model_arg
@click.option("-p", "--prompt", help="The prompt text; - reads it from standard input.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from this UTF-8 file.")
@click.option("-n", "--max-tokens", default=64, show_default=True, type=click.IntRange(min=1, max=1 << 24),
              help="Tokens to generate (stops earlier at the end of the context, with a warning).")
@click.option("--temp", default=0.0, show_default=True, type=FiniteFloat(min=0.0),
              help="Sampling temperature (0: greedy).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0, max=2**32 - 1),
              help="Sampling seed.")
@click.option("--json", "as_json", is_flag=True, help="Print text, token ids and timings as JSON.")
@click.option("--trace-out", type=click.Path(),
              help="Also record this run's routing into DIR/trace.npz (prefill routes every token).")
@cache_options
@ctx_opt
@threads_opt
@verbose_opt
@edge
def run(model: str | None, prompt: str | None, prompt_file: str | None, max_tokens: int, temp: float, seed: int,
        as_json: bool, trace_out: str | None, n_ctx: int | None, threads: int | None, verbose: bool,
        cache: CacheFlags) -> None:
    """Generate text, streamed as it comes (the embedded default model when MODEL is omitted).

    \b
    Examples:
      ggmoe run -p "The quick brown fox" -n 32
      echo "def main():" | ggmoe run -p - --temp 0.7 --seed 1 --json
      ggmoe run -p "def fib(n):" --cache-slots 4 --policy lru --stats-json stats.json
      ggmoe run -p "def fib(n):" --cache-slots 8 --stats-out routing.npz     # then, warm:
      ggmoe run -p "def fib(n):" --cache-slots 8 --policy static --stats-in routing.npz
    """
    path = model_path(model)
    facts = model_facts(path)
    text = read_prompt(prompt, prompt_file)
    config, routing_out = cache_from_flags(path, facts, cache)
    if trace_out:
        check_output_dir(trace_out, "--trace-out", members=("trace.npz",))
    if not as_json:
        toy_notice(path)
    with make_engine(path, n_ctx, threads, verbose, config) as eng:
        check_prompt(len(eng.tokenize(text)), eng.n_ctx)  # before llama.cpp sees it
        stream = None if as_json else _echo_stream(text)
        if routing_out is not None:
            eng.add_observer(routing_out.collector)
        if trace_out:
            from ggmoe.engine.record import trace_generation

            gen = trace_generation(eng, text, max_tokens, temp, seed, Path(trace_out) / "trace.npz", on_text=stream)
        else:
            gen = eng.generate(text, max_tokens, temp=temp, seed=seed, on_text=stream)
        write_stats(eng, cache.stats_json, {"model": str(path), "prompt_tokens": len(gen.prompt_ids),
                                            "generated_tokens": len(gen.token_ids)})
        summary = stats_summary(eng)
        if routing_out is not None:
            routing_out.save(eng.prefetcher, config.prefetch.predictor if config and config.prefetch else None)
    _report(gen, str(path), text, eng.n_ctx, summary, as_json)


def _report(gen: Generation, model: str, text: str, n_ctx: int, summary: str | None, as_json: bool) -> None:
    """After a run: the context warning, then the JSON record (``--json``) or one line of timings and
    the cache's summary on standard error."""
    if gen.stopped_on_ctx:
        click.echo(f"\nwarning: stopped after {len(gen.token_ids)} tokens: the context of {n_ctx} tokens is "
                   "full (raise --n-ctx)", err=True)
    t = gen.timings
    if as_json:
        click.echo(json.dumps({
            "model": model, "prompt": text, "text": gen.text,
            "prompt_ids": list(gen.prompt_ids), "token_ids": list(gen.token_ids),
            "stopped_on_eog": gen.stopped_on_eog, "stopped_on_ctx": gen.stopped_on_ctx,
            "timings": {"prefill_tokens": t.prefill_tokens, "prefill_s": t.prefill_s,
                        "prefill_tokens_per_s": t.prefill_tps, "decode_tokens": t.decode_tokens,
                        "decode_s": t.decode_s, "decode_tokens_per_s": t.decode_tps},
        }, indent=2))
        return
    click.echo()
    line = (f"{t.prefill_tokens} prompt tokens at {t.prefill_tps:.1f} tok/s, "
            f"{t.decode_tokens} generated at {t.decode_tps:.1f} tok/s")
    click.echo(line + (f"; {summary}" if summary else ""), err=True)


def _echo_stream(prompt: str):
    """Print the prompt, then each piece of text as the engine produces it."""
    click.echo(prompt, nl=False)

    def on_text(piece: str) -> None:
        click.echo(piece, nl=False)
        sys.stdout.flush()

    return on_text
