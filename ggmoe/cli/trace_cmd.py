"""``ggmoe trace``: record per-token routing into a trace file."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import check_output_dir
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
    reader_behind_line,
    threads_opt,
    verbose_opt,
    write_stats,
)

if TYPE_CHECKING:
    from ggmoe.control.run_config import RunConfig
    from ggmoe.engine import Engine


@click.command("record")
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
@click.option("--lockstep/--no-lockstep", default=None,
              help="With --predictor in the async decode: each MoE layer waits until the predictor's reader has "
                   "read it, so the hit rate measures the predictor, not whether this machine had a core free "
                   "for it (the default on the CPU build; a GPU never waits). --no-lockstep: free-running, as "
                   "`ggmoe serve` runs it.")
@cache_options
@ctx_opt
@threads_opt
@verbose_opt
@edge
def record(model: str | None, prompts_file: str, out: str, max_tokens: int, mode: str, prefill_tokens: int,
           temp: float, seed: int, no_hidden: bool, lockstep: bool | None, n_ctx: int | None, threads: int | None,
           verbose: bool, cache: CacheFlags) -> None:
    """Record per-token routing (ids, router probabilities, MoE inputs) into OUT/trace.npz.

    With a cache that runs the async decode, the run is that decode (its stride prefetch included) and the
    trace holds expert ids only; --decode-mode sync records probabilities and MoE inputs.

    \b
    Examples (``ggmoe trace ...`` is ``ggmoe trace record ...``):
      ggmoe trace model.gguf --prompts prompts.jsonl -o traces/ --max-tokens 64
      ggmoe trace --prompts docs.jsonl -o traces/ --mode teacher --prefill-tokens 32
    """
    from ggmoe.engine.record import ASYNC_NOTE, RecordConfig, record_trace, records_ids_only
    from ggmoe.trace.prompts import read_prompts

    # Everything a user can get wrong fails here, before the first prompt runs.
    path = model_path(model)
    facts = model_facts(path)
    prompts = read_prompts(prompts_file)
    check_output_dir(out, "-o", members=("trace.npz",))
    cfg = RecordConfig(mode=mode, max_tokens=max_tokens, prefill_tokens=prefill_tokens, temp=temp, seed=seed,
                       keep_hidden=not no_hidden)
    config, routing_out = cache_from_flags(path, facts, cache)
    config = _with_lockstep(config, lockstep)
    with make_engine(path, n_ctx, threads, verbose, config) as eng:
        if routing_out is not None:
            eng.add_observer(routing_out.collector)
        if records_ids_only(eng):
            click.echo(f"note: {ASYNC_NOTE}", err=True)
        with click.progressbar(length=len(prompts), label="tracing", file=sys.stderr) as bar:
            written = record_trace(eng, prompts, cfg, Path(out) / "trace.npz", progress=bar.update)
        write_stats(eng, cache.stats_json, {"model": str(path), "prompts": len(prompts), "mode": mode})
        for line in (reader_behind_line(eng), _lockstep_line(eng, lockstep)):  # each said once, if at all
            if line:
                click.echo(line.strip(), err=True)
        if routing_out is not None:
            routing_out.save(eng.prefetcher, config.prefetch.predictor if config and config.prefetch else None)
    click.echo(str(written))


def _with_lockstep(config: RunConfig | None, lockstep: bool | None) -> RunConfig | None:
    """The predictor's reader in lockstep with the decode unless --no-lockstep, or on a GPU (whose kernels never
    wait for the host: there GGMOE_MAILBOX_LOCKSTEP stays in charge, and --lockstep is refused by the engine).
    A teacher-forced trace measures what a predictor is worth: on a 2-core machine whose decode threads take
    both cores, the free-running reader read 60 % of its layers too late and the mlp's gain over LRU fell
    from 25 points to none (docs/predictors.md)."""
    if config is None or config.prefetch is None:
        if lockstep is not None:
            raise UsageError("--lockstep and --no-lockstep set how the predictor's reader runs: they need "
                             "--predictor and a cache (--cache-slots or --vram)")
        return config
    if lockstep is None:
        from ggmoe.engine.loader import gpu_device

        if gpu_device() is not None:
            return config
        lockstep = True
    return dataclasses.replace(config, prefetch=dataclasses.replace(config.prefetch, lockstep=lockstep))


def _lockstep_line(eng: Engine, lockstep: bool | None) -> str:
    """How the predictor's reader ran, when the trace measured one on the mailbox (else empty); a --lockstep
    or --no-lockstep that did nothing (the sync decode runs the predictor in the route op) said so."""
    pre = eng.report().get("prefetch") or {}
    if pre.get("runs_on") != "mailbox":
        if lockstep is None:
            return ""
        flag = "--lockstep" if lockstep else "--no-lockstep"
        return f"note: {flag} does nothing here: the predictor runs in the route op (the sync decode), in step"
    if pre.get("lockstep"):
        return ("predictor: measured in lockstep (each MoE layer waited for its reader, as a host that keeps pace "
                "with the device); --no-lockstep measures this machine's free-running reader")
    return ""


class _TraceGroup(click.Group):
    """``ggmoe trace [record] ...`` records; ``ggmoe trace import ...`` imports a public routing log."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in (*self.commands, "-h", "--help"):
            args = ["record", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_TraceGroup)
def trace() -> None:
    """Routing traces: record them through the engine, or import public routing logs.

    \b
    Examples:
      ggmoe trace model.gguf --prompts prompts.jsonl -o traces/        # = ggmoe trace record ...
      ggmoe trace import routing/intent routing/law -o traces/ds2lite --n-expert 64 --top-k 6
      ggmoe trace import routing.jsonl -o traces/mine --model model.gguf
    """


trace.add_command(record)


@trace.command("import")
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", required=True, type=click.Path(), help="Output directory (gets trace.npz).")
@click.option("--form", type=click.Choice(["auto", "layer-files", "jsonl"]), default="auto", show_default=True,
              help="The log's form: a directory of per-layer text files, or per-token JSONL records.")
@click.option("--model", "model", help="The GGUF the routing belongs to: its header gives the shape, checked "
                                       "against the log, and ties the trace to it (no weights are read).")
@click.option("--n-expert", type=click.IntRange(1, 1 << 16), help="Routed experts per layer (without --model).")
@click.option("--top-k", type=click.IntRange(1, 1 << 16), help="Experts selected per token (without --model).")
@click.option("--n-layer", type=click.IntRange(1, 1 << 16),
              help="Layers of the model, dense ones included (without --model; default: the log's last + 1).")
@click.option("--note", default="", help="Where the log comes from (origin, licence): kept in the trace.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@edge
def import_(sources: tuple[str, ...], out: str, form: str, model: str | None, n_expert: int | None,
            top_k: int | None, n_layer: int | None, note: str, as_json: bool) -> None:
    """Import public routing logs (SOURCES, merged in order) into OUT/trace.npz.

    Forms and their mapping to the trace: docs/simulator.md, "Real routing in". An imported trace holds
    ids (and the selected experts' weights when given), never hidden states; commands that need what it
    lacks refuse it in one line.

    \b
    Examples:
      ggmoe trace import /data/esft/intent /data/esft/law -o traces/ds2 --n-expert 64 --top-k 6 --n-layer 27
      ggmoe trace import routing.jsonl.gz -o traces/q3 --model Qwen3-30B-A3B-Q4_K_M.gguf --json
    """
    import json

    from ggmoe.trace.data import merge_traces
    from ggmoe.trace.format import LACKS, write_trace
    from ggmoe.trace.imports import import_routing, source_form

    check_output_dir(out, "-o", members=("trace.npz",))
    for s in sources:  # a path of an unknown form fails before the shape is asked for
        source_form(Path(s), form)
    shape = _import_shape(model, n_expert, top_k, n_layer)
    parts = [import_routing(s, shape, form) for s in sources]
    tr = merge_traces(parts)
    tr = dataclasses.replace(tr, meta=dataclasses.replace(
        tr.meta, source="; ".join(p.meta.source for p in parts) + (f" ({note})" if note else ""),
        max_tokens=int(np.diff(tr.prompt_offsets).max())))
    written = write_trace(tr, Path(out) / "trace.npz", compress=True)  # probabilities: mostly zeros
    info = {"trace": str(written), "tokens": tr.n_tokens, "sequences": tr.n_prompts,
            "layers": tr.layers.tolist(), "n_expert": tr.meta.n_expert, "top_k": tr.meta.n_expert_used,
            "source": tr.meta.source, "lacks": {k: LACKS[k] for k in tr.meta.lacks}}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"{written}: {tr.n_tokens} tokens, {tr.n_prompts} sequences, {len(tr.layers)} MoE layers, "
               f"{tr.meta.n_expert} experts, top-{tr.meta.n_expert_used}")
    for k in tr.meta.lacks:
        click.echo(f"  lacks {LACKS[k]}")


def _import_shape(model: str | None, n_expert: int | None, top_k: int | None, n_layer: int | None):
    """The model's shape: from the GGUF header of --model, or from --n-expert/--top-k[/--n-layer]."""
    from ggmoe.trace.imports import RoutingShape

    if model is not None:
        if n_expert or top_k or n_layer:
            raise UsageError("--n-expert, --top-k and --n-layer come from --model's header: give one or the other")
        from ggmoe.inspect.fingerprint import model_fingerprint

        path = model_path(model, "--model")
        f = model_facts(path)
        return RoutingShape(n_layer=f.n_layer, n_expert=f.n_expert, n_expert_used=f.n_expert_used,
                            moe_layers=f.moe_layers, fingerprint=model_fingerprint(path), name=f.name, arch=f.arch,
                            n_embd=f.n_embd)
    if n_expert is None or top_k is None:
        raise UsageError("give the model's shape: --model MODEL.gguf, or --n-expert and --top-k")
    if top_k > n_expert:
        raise UsageError(f"--top-k {top_k} is above --n-expert {n_expert}")
    return RoutingShape(n_layer=n_layer or 0, n_expert=n_expert, n_expert_used=top_k)
