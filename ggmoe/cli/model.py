"""``ggmoe inspect``, ``ggmoe verify-hook`` and ``ggmoe policies``: facts about a model and the hook."""

from __future__ import annotations

import json
import sys

import click

from ggmoe.cli.edge import edge
from ggmoe.cli.options import (
    make_engine,
    model_arg,
    model_path,
    verbose_opt,
)


@click.command()
@model_arg
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@edge
def inspect(model: str | None, as_json: bool) -> None:
    """Show a GGUF model's MoE facts without loading its weights (default: the embedded model).

    \b
    Examples:
      ggmoe inspect
      ggmoe inspect --json | python3 -c "import json,sys; print(json.load(sys.stdin)['expert_bytes_per_slot'])"
    """
    from ggmoe.inspect import inspect_model

    facts = inspect_model(model_path(model))
    click.echo(json.dumps(facts.to_dict(), indent=2) if as_json else facts.render_text())


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
