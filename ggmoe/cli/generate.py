"""``ggmoe run``: generate text, optionally from the expert cache and with a trace."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ggmoe.cli.edge import edge
from ggmoe.cli.options import (
    cache_config,
    cache_options,
    ctx_opt,
    make_engine,
    model_arg,
    model_path,
    threads_opt,
    verbose_opt,
    write_stats,
)
from ggmoe.errors import UsageError


@click.command()
@model_arg
@click.option("-p", "--prompt", required=True, help="The prompt text.")
@click.option("-n", "--max-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Sampling temperature (0: greedy).")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed.")
@click.option("--json", "as_json", is_flag=True, help="Print text, token ids and timings as JSON.")
@click.option("--trace-out", type=click.Path(file_okay=False),
              help="Also record this run's routing into DIR/trace.npz (prefill routes every token).")
@cache_options
@ctx_opt
@threads_opt
@verbose_opt
@edge
def run(model: str | None, prompt: str, max_tokens: int, temp: float, seed: int, as_json: bool,
        trace_out: str | None, cache_slots: int | None, vram: str | None, policy: str | None,
        stats_json: str | None, n_ctx: int, threads: int | None, verbose: bool) -> None:
    """Generate text (the embedded default model when MODEL is omitted).

    \b
    Examples:
      ggmoe run -p "The quick brown fox" -n 32
      ggmoe run model.gguf -p "def main():" --temp 0.7 --seed 1 --json
      ggmoe run -p "def fib(n):" --cache-slots 4 --policy lru --stats-json stats.json
    """
    path = model_path(model)
    cache = cache_config(cache_slots, vram, policy)
    if stats_json and cache is None:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    with make_engine(path, n_ctx, threads, verbose, cache) as eng:
        if trace_out:
            from ggmoe.trace.record import trace_generation

            gen = trace_generation(eng, prompt, max_tokens, temp, seed, Path(trace_out) / "trace.npz")
        else:
            gen = eng.generate(prompt, max_tokens, temp=temp, seed=seed)
        write_stats(eng, stats_json, {"model": str(path), "prompt_tokens": len(gen.prompt_ids),
                                       "generated_tokens": len(gen.token_ids)})
    if as_json:
        t = gen.timings
        click.echo(json.dumps({
            "model": str(path), "prompt": prompt, "text": gen.text,
            "prompt_ids": list(gen.prompt_ids), "token_ids": list(gen.token_ids),
            "stopped_on_eog": gen.stopped_on_eog,
            "timings": {"prefill_tokens": t.prefill_tokens, "prefill_s": t.prefill_s,
                        "prefill_tokens_per_s": t.prefill_tps, "decode_tokens": t.decode_tokens,
                        "decode_s": t.decode_s, "decode_tokens_per_s": t.decode_tps},
        }, indent=2))
    else:
        click.echo(prompt + gen.text)
