"""The ``ggmoe`` command line: thin click commands (parse, build config, call the library, print).

Domain errors become one-line messages and exit code 2 here, and only here.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import GgmoeError, UsageError


def _edge(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn domain errors into ``error: ...`` and exit code 2; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GgmoeError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def _model_path(model: str | None) -> Path:
    if model:
        return Path(model)
    from .models import default_model_path

    path = default_model_path()
    if path is None:
        raise UsageError("no MODEL given and this install has no embedded default model")
    return path


def _engine(model: Path, n_ctx: int, threads: int | None, verbose: bool, cache=None):
    from .engine import Engine, EngineConfig

    kw = {"n_threads": threads} if threads else {}
    return Engine(EngineConfig(model_path=model, n_ctx=n_ctx, verbose=verbose, cache=cache, **kw))


def _cache_config(cache_slots: int | None, vram: str | None, policy: str | None):
    """A CacheConfig from the flags, or None when no cache flag was given."""
    if cache_slots is None and vram is None:
        if policy is not None:
            raise UsageError("--policy needs a cache size: --cache-slots N or --vram BYTES")
        return None
    from .cache import CacheConfig
    from .policy import POLICIES
    from .units import parse_bytes

    if cache_slots is not None and vram is not None:
        raise UsageError("give either --cache-slots or --vram, not both")
    POLICIES.get(policy or "lru")  # an unknown name fails here, listing the choices
    return CacheConfig(n_slots=cache_slots, vram_bytes=parse_bytes(vram) if vram is not None else None,
                       policy=policy or "lru")


def _cache_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--stats-json", type=click.Path(dir_okay=False),
                      help="Write cache statistics (hit rate per layer, bytes copied, copy waits) here.")(fn)
    fn = click.option("--policy", help="Cache eviction policy (default lru; see `ggmoe policies`).")(fn)
    fn = click.option("--vram", help="Expert cache budget in bytes over all layers, e.g. 4GiB.")(fn)
    fn = click.option("--cache-slots", type=click.IntRange(min=1),
                      help="Expert cache slots per MoE layer (needs the patched engine).")(fn)
    return fn


def _write_stats(eng: Any, path: str | None, extra: dict) -> None:
    if path is None:
        return
    if eng.cache_stats is None:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    d = {"policy": eng.config.cache.policy, "slots_per_layer": {str(k): v for k, v in eng.cache_slots.items()},
         **extra, **eng.cache_stats.to_dict()}
    Path(path).write_text(json.dumps(d, indent=2))


_model_arg = click.argument("model", required=False, type=click.Path(dir_okay=False))
_ctx_opt = click.option("--n-ctx", default=1024, show_default=True, type=click.IntRange(min=8),
                        help="Context length in tokens.")
_threads_opt = click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: all cores).")
_verbose_opt = click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ggmoe")
def main() -> None:
    """ggmoe: run GGUF Mixture-of-Experts models with experts in host RAM.

    \b
    Examples:
      ggmoe inspect model.gguf
      ggmoe run -p "def fib(n):" -n 32
      ggmoe trace model.gguf --prompts prompts.jsonl -o traces/
    """


@main.command()
@_model_arg
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_edge
def inspect(model: str | None, as_json: bool) -> None:
    """Show a GGUF model's MoE facts without loading its weights (default: the embedded model).

    \b
    Examples:
      ggmoe inspect model.gguf
      ggmoe inspect model.gguf --json | jq .bytes_per_expert
    """
    from .inspect import inspect_model

    facts = inspect_model(_model_path(model))
    click.echo(json.dumps(facts.to_dict(), indent=2) if as_json else facts.render_text())


@main.command()
@_model_arg
@click.option("-p", "--prompt", required=True, help="The prompt text.")
@click.option("-n", "--max-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Sampling temperature (0: greedy).")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed.")
@click.option("--json", "as_json", is_flag=True, help="Print text, token ids and timings as JSON.")
@click.option("--trace-out", type=click.Path(file_okay=False),
              help="Also record this run's routing into DIR/trace.npz (prefill routes every token).")
@_cache_options
@_ctx_opt
@_threads_opt
@_verbose_opt
@_edge
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
    path = _model_path(model)
    cache = _cache_config(cache_slots, vram, policy)
    if stats_json and cache is None:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    with _engine(path, n_ctx, threads, verbose, cache) as eng:
        if trace_out:
            from .inspect import inspect_model
            from .record import trace_generation

            facts = inspect_model(path)
            gen = trace_generation(eng, prompt, max_tokens, temp, seed, Path(trace_out) / "trace.npz",
                                   facts.arch, facts.n_expert, facts.n_expert_used)
        else:
            gen = eng.generate(prompt, max_tokens, temp=temp, seed=seed)
        _write_stats(eng, stats_json, {"model": str(path), "prompt_tokens": len(gen.prompt_ids),
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


@main.command()
@_model_arg
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False),
              help='JSONL file, one {"prompt": ...} or {"text": ...} per line.')
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Decode steps per prompt.")
@click.option("--mode", type=click.Choice(["greedy", "sample", "teacher"]), default="greedy", show_default=True,
              help="greedy/sample decode, or teacher forcing: prefill part of each text, feed the rest.")
@click.option("--prefill-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Teacher mode: tokens of each text used as the prefill.")
@click.option("--temp", default=0.8, show_default=True, type=click.FloatRange(min=0.0),
              help="Sample mode temperature.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sample mode seed (prompt i uses seed+i).")
@click.option("--no-hidden", is_flag=True, help="Do not store MoE input hidden states (smaller traces).")
@_cache_options
@_ctx_opt
@_threads_opt
@_verbose_opt
@_edge
def trace(model: str | None, prompts_file: str, out: str, max_tokens: int, mode: str, prefill_tokens: int,
          temp: float, seed: int, no_hidden: bool, cache_slots: int | None, vram: str | None, policy: str | None,
          stats_json: str | None, n_ctx: int, threads: int | None, verbose: bool) -> None:
    """Record per-token routing (ids, router probabilities, MoE inputs) into OUT/trace.npz.

    \b
    Examples:
      ggmoe trace model.gguf --prompts prompts.jsonl -o traces/ --max-tokens 64
      ggmoe trace --prompts docs.jsonl -o traces/ --mode teacher --prefill-tokens 32
    """
    from .inspect import inspect_model
    from .record import RecordConfig, read_prompts, record_trace

    path = _model_path(model)
    facts = inspect_model(path)
    prompts = read_prompts(prompts_file)
    cfg = RecordConfig(mode=mode, max_tokens=max_tokens, prefill_tokens=prefill_tokens, temp=temp, seed=seed,
                       keep_hidden=not no_hidden)
    cache = _cache_config(cache_slots, vram, policy)
    if stats_json and cache is None:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    with _engine(path, n_ctx, threads, verbose, cache) as eng:
        with click.progressbar(length=len(prompts), label="tracing", file=sys.stderr) as bar:
            written = record_trace(eng, prompts, cfg, Path(out) / "trace.npz", arch=facts.arch,
                                   n_expert=facts.n_expert, n_expert_used=facts.n_expert_used,
                                   progress=bar.update)
        _write_stats(eng, stats_json, {"model": str(path), "prompts": len(prompts), "mode": mode})
    click.echo(str(written))


@main.command()
def policies() -> None:
    """List the expert cache eviction policies."""
    from .policy import POLICIES

    for name in POLICIES.names():
        doc = (POLICIES.get(name).__doc__ or "").strip().splitlines()
        click.echo(f"{name:<12} {doc[0] if doc else ''}")


@main.command("verify-hook")
@_model_arg
@click.option("-p", "--prompt", default="The quick brown fox jumps over the lazy dog. def f(x): return x",
              show_default=True, help="Text to route.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_verbose_opt
@_edge
def verify_hook(model: str | None, prompt: str, as_json: bool, verbose: bool) -> None:
    """Check the gate hook: the routers recomputed in numpy must pick the hooked experts.

    \b
    Example:
      ggmoe verify-hook model.gguf
    """
    from dataclasses import asdict

    from .inspect import inspect_model
    from .router import load_routers
    from .verify import check_hook

    path = _model_path(model)
    facts = inspect_model(path)
    routers = load_routers(path)
    with _engine(path, 512, None, verbose) as eng:
        res = check_hook(eng, routers, eng.tokenize(prompt), facts.n_expert_used)
    if as_json:
        click.echo(json.dumps({**asdict(res), "ok": res.ok}, indent=2))
    else:
        click.echo(f"{res.n_layers} MoE layers, {res.n_rows} token-layer rows: {res.n_mismatch} mismatches, "
                   f"{res.n_ties} near ties, max |dp| {res.max_prob_diff:.2e} -> {'OK' if res.ok else 'FAIL'}")
    if not res.ok:
        sys.exit(1)

from .cli_predict import eval_predictor, train_predictor  # noqa: E402

main.add_command(train_predictor)
main.add_command(eval_predictor)
