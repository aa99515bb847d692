"""``ggmoe inspect``, ``ggmoe verify-hook`` and ``ggmoe policies``: facts about a model and the hook."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from ggmoe.cli.edge import edge
from ggmoe.cli.options import (
    make_engine,
    model_arg,
    model_path,
    verbose_opt,
)

if TYPE_CHECKING:
    from ggmoe.cache.tiers import TierSizes
    from ggmoe.inspect import ModelFacts


@click.command()
@model_arg
@click.option("--vram", help="With --host-ram or alone: the cache budget over all layers, e.g. 8GiB, for the three "
                             "tiers (GPU slots, host tier, disk).")
@click.option("--host-ram", "host_ram", help="The host tier for experts, e.g. 24GiB (default with --vram: what this "
                                             "machine can pin, leaving the OS a margin); experts beyond it stay on disk.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@edge
def inspect(model: str | None, vram: str | None, host_ram: str | None, as_json: bool) -> None:
    """Show a GGUF model's MoE facts without loading its weights (default: the embedded model).

    \b
    Examples:
      ggmoe inspect
      ggmoe inspect --json | python3 -c "import json,sys; print(json.load(sys.stdin)['expert_bytes_per_slot'])"
      ggmoe inspect Qwen3-235B-A22B-Q4_K_M.gguf --vram 16GiB --host-ram 48GiB
    """
    from ggmoe.inspect import inspect_model

    facts = inspect_model(model_path(model))
    tiers = _tiers(facts, vram, host_ram) if vram is not None or host_ram is not None else None
    if as_json:
        out = facts.to_dict()
        if tiers is not None:
            out["tiers"] = tiers.to_dict()
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(facts.render_text())
    if tiers is not None:
        click.echo("\nthree tiers (GPU slots from --vram, host tier from --host-ram, the rest in the file):")
        click.echo("\n".join(tiers.render_lines()))


def _tiers(facts: ModelFacts, vram: str | None, host_ram: str | None) -> TierSizes:
    """The tiers of --vram (0 GPU slots without it) and --host-ram (None: this machine's auto budget)."""
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.config import slots_for_budget
    from ggmoe.cache.tiers import tier_sizes

    gpu = 0
    if vram is not None:
        bpe = {layer.il: layer.bytes_per_expert for layer in facts.layers}
        gpu = next(iter(slots_for_budget(parse_bytes(vram), bpe, facts.n_expert, facts.n_expert_used).values()))
    return tier_sizes(facts, gpu, parse_bytes(host_ram) if host_ram is not None else None)


@click.command()
def policies() -> None:
    """List the expert cache eviction policies."""
    from ggmoe.cache.policies import POLICIES

    for name in POLICIES.names():
        cls = POLICIES.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        options = [p.describe() for p in cls.PARAMS if not p.internal]
        more = f" (options: {', '.join(options)})" if options else ""
        click.echo(f"{name:<12} {doc[0] if doc else ''}{more}")


@click.command("verify-hook")
@model_arg
@click.option("-p", "--prompt", default="The quick brown fox jumps over the lazy dog. def f(x): return x",
              show_default=True, help="Text to route.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@verbose_opt
@edge
def verify_hook(model: str | None, prompt: str, as_json: bool, verbose: bool) -> None:
    """Check the gate hook: the routers recomputed in numpy must pick the hooked experts.

    \b
    Example:
      ggmoe verify-hook
    """
    from dataclasses import asdict

    from ggmoe.base.context import check_prompt
    from ggmoe.engine.verify import check_hook
    from ggmoe.inspect import inspect_model
    from ggmoe.inspect.router import load_routers

    path = model_path(model)
    facts = inspect_model(path)
    routers = load_routers(path)
    with make_engine(path, 512, None, verbose) as eng:
        ids = eng.tokenize(prompt)
        check_prompt(len(ids), eng.n_ctx, "-p", room=0, hint="shorten it")  # before llama.cpp sees it
        res = check_hook(eng, routers, ids, facts.n_expert_used)
    if as_json:
        click.echo(json.dumps({**asdict(res), "ok": res.ok}, indent=2))
    else:
        logits = f", max |dlogit| {res.max_logit_diff:.2e}" if facts.gating.hook_gives_logits else ""
        click.echo(f"router: {facts.gating.describe()}")
        click.echo(f"{res.n_layers} MoE layers, {res.n_rows} token-layer rows: {res.n_mismatch} mismatches, "
                   f"{res.n_ties} near ties, max |dp| {res.max_prob_diff:.2e}{logits} -> {'OK' if res.ok else 'FAIL'}")
    if not res.ok:
        sys.exit(1)
