"""``ggmoe plan``: the cache configuration for a VRAM budget on a machine, as a file --config loads."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ggmoe.cli.edge import edge
from ggmoe.cli.options import FiniteFloat, model_arg, model_path
from ggmoe.errors import UsageError
from ggmoe.outputs import check_output


@click.command()
@model_arg
@click.option("--vram", required=True, help="Budget for cached experts over all layers, e.g. 4GiB.")
@click.option("--hw", default="pcie4", show_default=True, help="Hardware profile (pcie4, h100, egpu, a .toml).")
@click.option("--traces", multiple=True, type=click.Path(),
              help="Traces of the model (what ggmoe trace -o wrote: the directory or its trace.npz): "
                   "candidates are simulated on them.")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False),
              help="Routing statistics (--stats-out) instead of traces: a static plan, estimated analytically.")
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="The plan file (.toml).")
@click.option("--predictor-s", type=FiniteFloat(min=0.0),
              help="Seconds per predictor call (default: measured on this machine while simulating).")
@click.option("--moepic", is_flag=True,
              help="Also estimate MoEpic's expert split (top segments cached, bottoms prefetched; per-layer "
                   "ratio and VRAM from its configurator) beside the even split. Needs --traces; the engine "
                   "does not run split experts, so the plan file does not hold it.")
@click.option("--json", "as_json", is_flag=True, help="Print the choice and every candidate as JSON.")
@edge
def plan(model: str | None, vram: str, hw: str, traces: tuple[str, ...], stats_path: str | None, out: str,
         predictor_s: float | None, moepic: bool, as_json: bool) -> None:
    """Choose slots per layer, policy, predictor and miss policy for a VRAM budget, by simulation.

    The plan is written as TOML that run, trace, serve and chat take with --config FILE; the estimated
    TPOT of the choice is printed beside that of the even LRU split without prefetching (the design of
    llama.cpp's own expert cache). Estimates come from the hardware profile (docs/simulator.md).

    \b
    Examples:
      ggmoe trace --prompts prompts.jsonl -o traces/
      ggmoe plan --vram 6MiB --traces traces/trace.npz -o plan.toml
      ggmoe run -p "def fib(n):" --config plan.toml
      ggmoe plan model.gguf --vram 8GiB --hw egpu --stats routing.npz -o plan.toml
    """
    from ggmoe.cache.config import CacheConfig
    from ggmoe.cache.hardware import load_profile
    from ggmoe.cli.warm import read_stats_in
    from ggmoe.control.plan_file import write_plan
    from ggmoe.control.prefetch import PrefetchConfig
    from ggmoe.inspect import inspect_model
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.simulate.plan import plan_from_stats, plan_from_traces
    from ggmoe.trace import load_traces
    from ggmoe.units import parse_bytes

    check_output(out, "-o", suffixes=(".toml",))
    if bool(traces) == (stats_path is not None):
        raise UsageError("give the routing to plan for: --traces FILE... or --stats FILE, one of them")
    if moepic and not traces:
        raise UsageError("--moepic measures hit curves and predictor recall on traces: give --traces")
    path = model_path(model)
    facts = inspect_model(path)
    profile = load_profile(hw)
    budget = parse_bytes(vram)
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    if traces:
        trace = load_traces(list(traces))
        if trace.meta.model_fingerprint != model_fingerprint(path):
            raise UsageError(f"the traces come from another model than {Path(path).name}")
        click.echo(f"simulating candidates on {trace.n_tokens} tokens...", err=True)
        p = plan_from_traces(trace, bpe, budget, profile, predictor_s)
    else:
        stats = read_stats_in(stats_path, facts, Path(path))
        p = plan_from_stats(stats.frequencies(), tuple(stats.layers), facts.n_expert, facts.n_expert_used, bpe,
                            budget, profile)
    c = p.config
    pre = PrefetchConfig(predictor=c.predictor, stride=c.stride) if c.predictor else None
    cfg = CacheConfig(layer_slots=dict(c.n_slots), policy=c.policy, miss_policy=c.miss_policy,
                      hw_profile=hw if c.miss_policy == "auto" else None, prefetch=pre)
    baseline = "static, even split" if p.analytic else "LRU, even split, no prefetching, misses waited for"
    estimate = {"tpot_s": p.tpot_s, "baseline_tpot_s": p.baseline_tpot_s}
    comment = (f"written by ggmoe plan for {Path(path).name}, --vram {vram}, --hw {hw}\n"
               f"estimated TPOT {p.tpot_s * 1e3:.3f} ms ({'analytic' if p.analytic else 'simulated'}); "
               f"baseline ({baseline}) {p.baseline_tpot_s * 1e3:.3f} ms")
    if c.policy == "static":
        comment += "\nthe static policy needs the statistics at run time: add --stats-in " + str(stats_path)
    write_plan(out, cfg, estimate, comment)
    split = None
    if moepic:
        from ggmoe.simulate.moepic import configure, measure_curves

        split = configure(measure_curves(trace, "reuse", 1), bpe, budget, profile,
                          max(1, sum(bpe.values()) // len(bpe) // 4))
    if as_json:
        click.echo(json.dumps({"plan": out, "slots_per_layer": {str(k): v for k, v in c.n_slots.items()},
                               "policy": c.policy, "predictor": c.predictor, "stride": c.stride,
                               "miss_policy": c.miss_policy, "allocation": p.allocation,
                               "tpot_s_estimate": p.tpot_s, "baseline_tpot_s_estimate": p.baseline_tpot_s,
                               "baseline": baseline, "hit_rate": p.hit_rate, "analytic": p.analytic,
                               "candidates": [{"label": lab, "tpot_s_estimate": t} for lab, t in p.tried],
                               "moepic": None if split is None else {
                                   "waited_s_per_token": split.exposed_s,
                                   "even_waited_s_per_token": split.even_exposed_s,
                                   "layers": {str(il): vars(c) for il, c in split.layers.items()}}},
                              indent=2))
        return
    sizes = sorted(set(c.n_slots.values()))
    click.echo(f"plan: {c.policy}, {p.allocation} split ({sizes[0]}-{sizes[-1]} slots per layer), "
               f"prefetch {c.predictor + f' stride {c.stride}' if c.predictor else 'off'}, "
               f"miss policy {c.miss_policy}")
    click.echo(f"estimated TPOT {p.tpot_s * 1e3:.3f} ms against {p.baseline_tpot_s * 1e3:.3f} ms for the "
               f"baseline ({baseline}): {p.baseline_tpot_s / p.tpot_s:.2f}x")
    click.echo(f"wrote {out}; use it with: ggmoe run --config {out} -p ...")
    if split is not None:
        thetas = sorted({c.theta for c in split.layers.values()})
        click.echo(f"MoEpic split (estimate, reuse predictor at stride 1; PH = H x P): copies waited for "
                   f"{split.exposed_s * 1e3:.3f} ms per token against {split.even_exposed_s * 1e3:.3f} ms for the "
                   f"even split without it; top shares {', '.join(f'{t:g}' for t in thetas)} "
                   f"({split.iterations} configurator steps)")
