"""``ggmoe trace``: record per-token routing into a trace file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ggmoe.cli.edge import edge
from ggmoe.cli.options import (
    FiniteFloat,
    cache_config,
    cache_options,
    check_stats_json,
    ctx_opt,
    make_engine,
    model_arg,
    model_facts,
    model_path,
    prefetch_config,
    threads_opt,
    verbose_opt,
    write_stats,
)
from ggmoe.cli.warm import read_stats_in, stats_options, stats_out, warm_start
from ggmoe.outputs import check_output_dir


@click.command()
@model_arg
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False),
              help='JSONL file, one {"prompt": ...} or {"text": ...} per line.')
@click.option("-o", "--out", required=True, type=click.Path(), help="Output directory (gets trace.npz).")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1, max=1 << 24),
              help="Decode steps per prompt.")
@click.option("--mode", type=click.Choice(["greedy", "sample", "teacher"]), default="greedy", show_default=True,
              help="greedy/sample decode, or teacher forcing: prefill part of each text, feed the rest.")
@click.option("--prefill-tokens", default=64, show_default=True, type=click.IntRange(min=1, max=1 << 24),
              help="Teacher mode: tokens of each text used as the prefill.")
@click.option("--temp", default=0.8, show_default=True, type=FiniteFloat(min=0.0),
              help="Sample mode temperature.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0, max=2**31),
              help="Sample mode seed (prompt i uses seed+i).")
@click.option("--no-hidden", is_flag=True, help="Do not store MoE input hidden states (smaller traces).")
@cache_options
@stats_options
@ctx_opt
@threads_opt
@verbose_opt
@edge
def trace(model: str | None, prompts_file: str, out: str, max_tokens: int, mode: str, prefill_tokens: int,
          temp: float, seed: int, no_hidden: bool, cache_slots: int | None, vram: str | None, policy: str | None,
          stats_json: str | None, decode_mode: str | None, miss_policy: str | None, predictor: str | None,
          stride: int,
        n_prefetch: int | None, prefetch_threshold: float | None, predictor_train: tuple[str, ...],
        predict_background: bool, hw: str | None, config: str | None, stats_in: str | None, stats_out_path: str | None,
        n_ctx: int | None, threads: int | None, verbose: bool) -> None:
    """Record per-token routing (ids, router probabilities, MoE inputs) into OUT/trace.npz.

    \b
    Examples:
      ggmoe trace model.gguf --prompts prompts.jsonl -o traces/ --max-tokens 64
      ggmoe trace --prompts docs.jsonl -o traces/ --mode teacher --prefill-tokens 32
    """
    from ggmoe.trace.record import RecordConfig, read_prompts, record_trace

    # Everything a user can get wrong fails here, before the first prompt runs.
    path = model_path(model)
    facts = model_facts(path)
    prompts = read_prompts(prompts_file)
    check_output_dir(out, "-o", members=("trace.npz",))
    cfg = RecordConfig(mode=mode, max_tokens=max_tokens, prefill_tokens=prefill_tokens, temp=temp, seed=seed,
                       keep_hidden=not no_hidden)
    cache = cache_config(cache_slots, vram, policy, facts, miss_policy,
                         prefetch_config(predictor, stride, n_prefetch, prefetch_threshold, predictor_train,
                                         predict_background), hw, config, decode_mode)
    warm = read_stats_in(stats_in, facts, path)
    cache = warm_start(cache, warm)
    routing_out = stats_out(stats_out_path, warm, facts, path)
    check_stats_json(stats_json, cache)
    with make_engine(path, n_ctx, threads, verbose, cache) as eng:
        if routing_out is not None:
            eng.add_observer(routing_out.collector)
        with click.progressbar(length=len(prompts), label="tracing", file=sys.stderr) as bar:
            written = record_trace(eng, prompts, cfg, Path(out) / "trace.npz", progress=bar.update)
        write_stats(eng, stats_json, {"model": str(path), "prompts": len(prompts), "mode": mode})
        if routing_out is not None:
            routing_out.save(eng.prefetcher, cache.prefetch.predictor if cache and cache.prefetch else None)
    click.echo(str(written))
