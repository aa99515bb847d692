"""``ggmoe plan``: the cache configuration for a VRAM budget on a machine, as a file --config loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import check_output
from ggmoe.cli.edge import edge
from ggmoe.cli.groups import option_group
from ggmoe.cli.options import FiniteFloat, model_arg, model_path

if TYPE_CHECKING:
    from ggmoe.cache.hardware import HardwareProfile
    from ggmoe.inspect.facts import ModelFacts
    from ggmoe.simulate.plan import Plan
    from ggmoe.trace.format import Trace


@dataclass(frozen=True)
class GpuFlags:
    """``plan --gpu``: the machine named by its parts, what to run on it answered from the GGUF header alone."""

    gpu: str | None  # a GPU of the parts file (None: the other mode, a plan file from routing)
    ram: str | None  # the host's RAM, e.g. "64GiB"
    disk: str | None  # the disk under the host tier
    link: str | None  # the link to the GPU (None: the card's own)
    host: str  # the host memory


@dataclass(frozen=True)
class RoutingFlags:
    """The routing a plan file is chosen for: traces (simulated) or saved statistics (estimated)."""

    traces: tuple[str, ...]
    stats_path: str | None
    predictor_s: float | None  # seconds per predictor call (None: measured while simulating)


_GPU = (
    click.option("--host", default="ddr5-5600x2", show_default=True,
                 help="With --gpu: the host memory (ddr4-3200x2, ddr5-5600x2, ddr5-6000x2, epyc7742)."),
    click.option("--link", help="With --gpu: the link to the GPU, e.g. pcie4x16, pcie3x4, tb4 (default: the card's own)."),
    click.option("--disk", help="With --gpu: the disk under the host tier (nvme5, nvme4, nvme3, sata; default nvme4)."),
    click.option("--ram", help="With --gpu: the host's RAM, e.g. 64GiB: a model larger than it plans three tiers "
                               "(GPU, host RAM less the OS's margin, disk)."),
    click.option("--gpu", help="What to run on this GPU (rtx3090, rtx4090, rtx5090, rtx4060ti16, rtx5060ti16, a6000, "
                               "l40s, h100): from the GGUF header alone, estimated beside llama.cpp's ways."),
)
_ROUTING = (
    click.option("--predictor-s", type=FiniteFloat(min=0.0),
                 help="Seconds per predictor call (default: measured on this machine while simulating)."),
    click.option("--stats", "stats_path", type=click.Path(dir_okay=False),
                 help="Routing statistics (--stats-out) instead of traces: a static plan, estimated analytically."),
    click.option("--traces", multiple=True, type=click.Path(),
                 help="Traces of the model (what ggmoe trace -o wrote: the directory or its trace.npz): "
                      "candidates are simulated on them."),
)
gpu_options = option_group(GpuFlags, "machine", *_GPU)
routing_options = option_group(RoutingFlags, "routing", *_ROUTING)


@click.command()
@model_arg
@gpu_options
@click.option("--host-ram", "host_ram", help="The host tier for experts, e.g. 24GiB: experts beyond it stay on "
                                             "disk (the three tiers are shown; with --gpu, estimated).")
@click.option("--vram", help="Budget for cached experts over all layers, e.g. 4GiB; with --gpu: the GPU's VRAM "
                             "to use (default: all of it).")
@click.option("--hw", default="pcie4", show_default=True, help="Hardware profile (pcie4, h100, egpu, GPU/LINK/HOST e.g. rtx4090/pcie4x16/ddr5-5600x2, a .toml).")
@routing_options
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="The plan file (.toml); not with --gpu.")
@click.option("--moepic", is_flag=True,
              help="Plan MoEpic's expert split instead: per-layer top shares and slots from its configurator, "
                   "policy lcp, bottoms prefetched by skip-gate (reuse when the traces have no hidden states); "
                   "simulated beside the even LRU split. Needs --traces.")
@click.option("--json", "as_json", is_flag=True, help="Print the choice and every candidate as JSON.")
@edge
def plan(model: str | None, machine: GpuFlags, host_ram: str | None, vram: str | None, hw: str,
         routing: RoutingFlags, out: str | None, moepic: bool, as_json: bool) -> None:
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
      ggmoe plan Qwen3-30B-A3B-Q4_K_M.gguf --gpu rtx4090 --ram 64GiB --link pcie4x16
      ggmoe plan Qwen3-30B-A3B-Q4_K_M.gguf --gpu rtx5060ti16 --link tb4 --json
      ggmoe plan Qwen3-235B-A22B-Q4_K_M.gguf --gpu rtx4090 --ram 64GiB --disk nvme4
    """
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.hardware import load_profile
    from ggmoe.inspect import inspect_model

    m, traces, stats_path, predictor_s = machine, routing.traces, routing.stats_path, routing.predictor_s
    if _gpu_mode(m.gpu, m.ram, m.link, m.disk, vram, out, bool(traces or stats_path or moepic)):
        _advise(model, m.gpu, vram, m.ram, m.link, m.host, as_json, host_ram, m.disk)
        return
    check_output(out, "-o", suffixes=(".toml",))
    if bool(traces) == (stats_path is not None):
        raise UsageError("give the routing to plan for: --traces FILE... or --stats FILE, one of them")
    if moepic and not traces:
        raise UsageError("--moepic measures hit curves and predictor recall on traces: give --traces")
    path = model_path(model)
    facts = inspect_model(path)
    profile = load_profile(hw)
    budget = parse_bytes(vram)
    host_slots = _host_slots(facts, budget, host_ram, as_json, bool(traces) and not moepic)
    trace = _model_traces(traces, path) if traces else None
    if moepic:
        _write_moepic(trace, facts, path, budget, profile, predictor_s, out, f"--vram {vram}, --hw {hw}", as_json)
        return
    p = _choose(trace, stats_path, facts, path, budget, profile, predictor_s, host_slots)
    disk = f", --host-ram {host_ram} (a disk tier)" if host_slots is not None else ""
    _write_chosen(p, out, f"{Path(path).name}, --vram {vram}, --hw {hw}{disk}", hw, stats_path)
    if as_json:
        click.echo(json.dumps({**_chosen_json(p, out), "host_slots": host_slots}, indent=2))
        return
    _echo_chosen(p, out)
    if host_slots is not None:
        click.echo(f"simulated with {host_slots} host slots per layer over the disk: run it with --host-ram {host_ram}")


def _model_traces(traces: tuple[str, ...], path: str) -> Trace:
    """The traces to plan on, refused when they were recorded on another model."""
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.trace import load_traces

    trace = load_traces(list(traces))
    if trace.meta.model_fingerprint != model_fingerprint(path):
        raise UsageError(f"the traces come from another model than {Path(path).name}")
    return trace


def _choose(trace: Trace | None, stats_path: str | None, facts: ModelFacts, path: str, budget: int,
            profile: HardwareProfile, predictor_s: float | None, host_slots: int | None = None) -> Plan:
    """The plan for the budget: candidates simulated on the traces, or estimated analytically from the
    statistics when there are no traces."""
    from ggmoe.cli.cache_flags import read_stats_in
    from ggmoe.simulate.plan import plan_from_stats, plan_from_traces

    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    if trace is not None:
        click.echo(f"simulating candidates on {trace.n_tokens} tokens...", err=True)
        return plan_from_traces(trace, bpe, budget, profile, predictor_s, host_slots)
    stats = read_stats_in(stats_path, facts, Path(path))
    return plan_from_stats(stats.frequencies(), tuple(stats.layers), facts.n_expert, facts.n_expert_used, bpe,
                           budget, profile)


def _baseline(p: Plan) -> str:
    """What the plan's TPOT is compared with: the design of llama.cpp's own expert cache (or, for an analytic
    plan, the even static split)."""
    return "static, even split" if p.analytic else "LRU, even split, no prefetching, misses waited for"


def _write_chosen(p: Plan, out: str, what: str, hw: str, stats_path: str | None) -> None:
    """The plan file ``--config`` loads, with its estimate and, in a comment, how it was made."""
    from ggmoe.cache.config import CacheConfig
    from ggmoe.cache.decode_mode import DecodeConfig
    from ggmoe.control.plan_file import write_plan
    from ggmoe.control.prefetch import PrefetchConfig
    from ggmoe.control.run_config import RunConfig

    c = p.config
    pre = PrefetchConfig(predictor=c.predictor, stride=c.stride) if c.predictor else None
    cfg = RunConfig(CacheConfig(layer_slots=dict(c.n_slots), policy=c.policy),
                    DecodeConfig(miss_policy=c.miss_policy, hw_profile=hw if c.miss_policy == "auto" else None),
                    prefetch=pre)
    estimate = {"tpot_s": p.tpot_s, "baseline_tpot_s": p.baseline_tpot_s}
    comment = (f"written by ggmoe plan for {what}\n"
               f"estimated TPOT {p.tpot_s * 1e3:.3f} ms ({'analytic' if p.analytic else 'simulated'}); "
               f"baseline ({_baseline(p)}) {p.baseline_tpot_s * 1e3:.3f} ms")
    if c.policy == "static":
        comment += "\nthe static policy needs the statistics at run time: add --stats-in " + str(stats_path)
    write_plan(out, cfg, estimate, comment)


def _chosen_json(p: Plan, out: str) -> dict[str, Any]:
    """``plan --json``: the choice and every candidate tried."""
    c = p.config
    return {"plan": out, "slots_per_layer": {str(k): v for k, v in c.n_slots.items()},
            "policy": c.policy, "predictor": c.predictor, "stride": c.stride,
            "miss_policy": c.miss_policy, "allocation": p.allocation,
            "tpot_s_estimate": p.tpot_s, "baseline_tpot_s_estimate": p.baseline_tpot_s,
            "baseline": _baseline(p), "hit_rate": p.hit_rate, "analytic": p.analytic,
            "candidates": [{"label": lab, "tpot_s_estimate": t} for lab, t in p.tried]}


def _echo_chosen(p: Plan, out: str) -> None:
    """The choice in words, its estimate against the baseline's, and how to use the file."""
    c = p.config
    sizes = sorted(set(c.n_slots.values()))
    click.echo(f"plan: {c.policy}, {p.allocation} split ({sizes[0]}-{sizes[-1]} slots per layer), "
               f"prefetch {c.predictor + f' stride {c.stride}' if c.predictor else 'off'}, "
               f"miss policy {c.miss_policy}")
    click.echo(f"estimated TPOT {p.tpot_s * 1e3:.3f} ms against {p.baseline_tpot_s * 1e3:.3f} ms for the "
               f"baseline ({_baseline(p)}): {p.baseline_tpot_s / p.tpot_s:.2f}x")
    click.echo(f"wrote {out}; use it with: ggmoe run --config {out} -p ...")


def _host_slots(facts: ModelFacts, budget: int, host_ram: str | None, as_json: bool, simulated: bool) -> int | None:
    """The host tier's slots per layer when --host-ram leaves experts on disk (None: no disk tier), its three
    tiers printed; a disk tier is planned on traces by simulation only."""
    if host_ram is None:
        return None
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.config import slots_for_budget
    from ggmoe.cache.tiers import tier_sizes

    bpe = {layer.il: layer.bytes_per_expert for layer in facts.layers}
    gpu = next(iter(slots_for_budget(budget, bpe, facts.n_expert, facts.n_expert_used).values()))
    tiers = tier_sizes(facts, gpu, parse_bytes(host_ram))
    if tiers.disk and not simulated:
        raise UsageError(f"--host-ram {host_ram} leaves {tiers.disk_experts} experts per layer on disk: the disk tier "
                         "is planned by simulating traces (--traces, without --moepic)")
    if not as_json:
        click.echo("tiers (--vram spread evenly):\n" + "\n".join(tiers.render_lines()))
    return tiers.host_slots if tiers.disk else None


def _gpu_mode(gpu: str | None, ram: str | None, link: str | None, disk: str | None, vram: str | None,
              out: str | None, routing: bool) -> bool:
    """Whether this is ``plan --gpu`` (what to run on a GPU); UsageError for flags of the other mode."""
    if gpu is not None:
        if routing or out:
            raise UsageError("--gpu answers from the GGUF header alone: leave out --traces, --stats, --moepic and -o")
        return True
    for flag, value in (("--ram", ram), ("--link", link), ("--disk", disk)):
        if value is not None:
            raise UsageError(f"{flag} goes with --gpu")
    if vram is None or out is None:
        raise UsageError("give --vram and -o (or --gpu NAME to ask what to run on a GPU)")
    return False


def _advise(model: str | None, gpu: str, vram: str | None, ram: str | None, link: str | None, host: str,
            as_json: bool, host_ram: str | None = None, disk: str | None = None) -> None:
    """``plan --gpu``: the ways to run the model on the GPU, estimated (ggmoe.simulate.advise)."""
    import dataclasses

    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.parts import DEFAULT_DISK
    from ggmoe.inspect import inspect_model
    from ggmoe.simulate.advise import advise

    facts = inspect_model(model_path(model))
    a = advise(facts, gpu, parse_bytes(vram) if vram else None, parse_bytes(ram) if ram else None, link, host,
               host_ram=parse_bytes(host_ram) if host_ram else None, disk=disk or DEFAULT_DISK)
    if as_json:
        d = dataclasses.asdict(a)
        d["tiers"] = a.tiers.to_dict() if a.tiers is not None else None
        d["estimates"] = "decode_tok_s and prefill_tok_s are simulator estimates (docs/simulator.md)"
        click.echo(json.dumps(d, indent=2))
        return
    click.echo(f"{Path(a.model).name} on {a.profile} (link {a.link}), {a.vram_bytes / 2**30:.1f} GiB VRAM: "
               f"{a.expert_budget_bytes / 2**30:.1f} GiB for experts")
    if a.tiers is not None:
        click.echo("tiers:\n" + "\n".join(a.tiers.render_lines()))
    click.echo(f"routing replayed: {a.routing}")
    click.echo("estimates (simulator; not measured):")
    for w in a.ways:
        dec = f"{w.decode_tok_s:7.1f}" if w.decode_tok_s else "      -"
        pre = f"{w.prefill_tok_s:8.0f}" if w.prefill_tok_s else "       -"
        click.echo(f"  {w.name:<54} decode {dec} tok/s  prefill {pre} tok/s  {w.detail}")
    for n in a.notes:
        click.echo(f"note: {n}")
    click.echo(f"run ({a.choice.name}, est. {a.choice.decode_tok_s:.1f} tok/s decode):\n  {a.choice.run}")


MOEPIC_BASELINE = "LRU, whole experts, even split, no prefetching"


def _write_moepic(trace: Trace, facts: ModelFacts, path: str, budget: int, profile: HardwareProfile,
                  predictor_s: float | None, out: str,
                  how: str, as_json: bool) -> None:
    """``plan --moepic``: MoEpic's configuration (ggmoe.simulate.moepic.moepic_plan) as a plan file."""
    from ggmoe.cache.config import CacheConfig
    from ggmoe.control.plan_file import write_plan
    from ggmoe.control.prefetch import PrefetchConfig
    from ggmoe.control.run_config import RunConfig
    from ggmoe.simulate.moepic import POLICY, moepic_plan

    click.echo(f"measuring curves and configuring MoEpic's split on {trace.n_tokens} tokens...", err=True)
    m = moepic_plan(trace, facts, budget, profile, path, predictor_s)
    pre = PrefetchConfig(predictor=m.predictor, stride=1, n_prefetch=m.n_prefetch) if m.predictor else None
    cfg = RunConfig(CacheConfig(layer_slots=m.slots, policy=POLICY, layer_theta=m.theta or None), prefetch=pre)
    cfg.check_model(facts)  # what run --config will check: layers, splits, slot ranges
    thetas = sorted({*m.theta.values(), *([1.0] if len(m.theta) < len(m.slots) else [])})
    sizes = sorted(set(m.slots.values()))
    tops = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    prefetch = (f"{m.predictor} stride 1, {m.n_prefetch} experts per layer ({m.n_prefetch} bottom buffers of "
                f"whole-expert size per split layer)" if m.predictor else
                "off" + (" (split layers read bottoms from host memory)" if m.theta else ""))
    base = (f"{m.baseline_tpot_s * 1e3:.3f} ms for the baseline ({MOEPIC_BASELINE}, {m.baseline_slots} slots "
            "per layer)" if m.baseline_tpot_s is not None else
            f"no baseline: whole experts do not fit n_expert_used = {facts.n_expert_used} slots per layer")
    what = (f"MoEpic split: top shares {', '.join(f'{t:.3g}' for t in thetas)} "
            f"({len(m.theta)} of {len(m.slots)} layers split), {tops} tops cached per layer, "
            f"policy {POLICY}, prefetch {prefetch}, {m.vram_bytes} bytes")
    est = (f"estimated TPOT {m.tpot_s * 1e3:.3f} ms (simulated) against {base}"
           + (f": {m.baseline_tpot_s / m.tpot_s:.2f}x" if m.baseline_tpot_s is not None else ""))
    ana = (f"configurator's estimate (analytic, PH = H x P): copies waited for {m.split.exposed_s * 1e3:.3f} ms "
           "per token" + (f" against {m.split.even_exposed_s * 1e3:.3f} ms for the even split without it"
                          if m.split.even_exposed_s is not None else ""))
    estimate = {"tpot_s": m.tpot_s, "waited_s_per_token": m.split.exposed_s}
    if m.baseline_tpot_s is not None:
        estimate["baseline_tpot_s"] = m.baseline_tpot_s
    if m.split.even_exposed_s is not None:
        estimate["even_waited_s_per_token"] = m.split.even_exposed_s
    write_plan(out, cfg, estimate, f"written by ggmoe plan --moepic for {Path(path).name}, {how}\n{what}\n{est}\n{ana}")
    if as_json:
        click.echo(json.dumps({
            "plan": out, "slots_per_layer": {str(il): n for il, n in m.slots.items()},
            "theta_per_layer": {str(il): t for il, t in m.theta.items()}, "policy": POLICY,
            "predictor": m.predictor, "stride": 1, "n_prefetch": m.n_prefetch, "miss_policy": "wait",
            "allocation": "moepic", "vram_bytes": m.vram_bytes, "tpot_s_estimate": m.tpot_s,
            "baseline_tpot_s_estimate": m.baseline_tpot_s, "baseline": MOEPIC_BASELINE,
            "baseline_slots_per_layer": m.baseline_slots, "hit_rate": m.hit_rate,
            "top_hit_rate": m.top_hit_rate, "analytic": False,
            "moepic": {"waited_s_per_token": m.split.exposed_s, "even_waited_s_per_token": m.split.even_exposed_s,
                       "y": m.split.y, "iterations": m.split.iterations,
                       "tried": [{"y": y, "waited_s_per_token": s} for y, s in m.split.tried],
                       "layers": {str(il): vars(c) for il, c in m.split.layers.items()}}}, indent=2))
        return
    click.echo(what)
    click.echo(est)
    click.echo(ana)
    click.echo(f"wrote {out}; use it with: ggmoe run --config {out} -p ...")
