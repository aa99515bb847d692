"""``ggmoe simulate``: traces through the engine's cache, copy queue and prefetcher on a hardware cost model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import atomic_write, check_output
from ggmoe.cli.edge import edge
from ggmoe.cli.options import model_path, planner_config
from ggmoe.cli.simulate_flags import (
    MachineFlags,
    OutputFlags,
    PredictorFlags,
    SweepFlags,
    machine_options,
    output_options,
    predictor_options,
    sweep_options,
)

if TYPE_CHECKING:
    from ggmoe.cache.hardware import HardwareProfile
    from ggmoe.cache.tiers import TierSizes
    from ggmoe.inspect import ModelFacts
    from ggmoe.simulate.des import SimConfig, SimResult
    from ggmoe.trace import Trace
    from ggmoe.trace.imports import TraceShape
    from ggmoe.trace.routing_stats import RoutingStats

PLOT_SUFFIXES = (".png",)  # what every --plot writes
# --decode-mode: async-fill is async with in-graph fills; hybrid is sync with the CPU beside the link (miss policy auto)
SIM_MODES = ("sync", "async", "async-fill", "hybrid")


def _split(values: tuple[str, ...], flag: str = "") -> list[str]:
    """Repeated flags and comma lists alike: ("lru,lfu", "fmoe") -> ["lru", "lfu", "fmoe"]; an empty item
    (``--policy ''``, ``lru,,lfu``) is an error, never a silent default."""
    out = [v.strip() for value in values for v in value.split(",")]
    if "" in out:
        raise UsageError(f"{flag or 'a list flag'}: an empty value in {','.join(values)!r}")
    return out


def _numbers(values: tuple[str, ...], kind: type, flag: str) -> list:
    out = []
    for v in _split(values, flag):
        try:
            x = kind(v)
        except ValueError:
            raise UsageError(f"{flag} {v!r}: not a{'n integer' if kind is int else ' number'}") from None
        if kind is float and not 0.0 < x <= 1.0:
            raise UsageError(f"{flag} {v}: a share of the experts, in (0, 1]")
        out.append(x)
    return out


def sizes(facts: ModelFacts | TraceShape, cache_slots: tuple[str, ...], fractions: tuple[str, ...],
          vram: tuple[str, ...]) -> list[tuple[str, dict[int, int]]]:
    """(label, slots per layer) for every size asked for."""
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache import slots_for_budget

    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    out: list[tuple[str, dict[int, int]]] = []
    for n in _numbers(cache_slots, int, "--cache-slots"):
        if not facts.n_expert_used <= n <= facts.n_expert:
            raise UsageError(f"--cache-slots {n}: the model needs {facts.n_expert_used} to {facts.n_expert}")
        out.append((f"{n} slots", dict.fromkeys(bpe, n)))
    for f in _numbers(fractions, float, "--cache-fraction"):
        n = max(facts.n_expert_used, min(facts.n_expert, round(f * facts.n_expert)))
        out.append((f"{f:.0%} ({n} slots)", dict.fromkeys(bpe, n)))
    for v in _split(vram, "--vram"):
        slots = slots_for_budget(parse_bytes(v), bpe, facts.n_expert, facts.n_expert_used)
        out.append((f"{v} ({next(iter(slots.values()))} slots)", slots))
    if not out:
        raise UsageError("give a cache size: --cache-slots N, --cache-fraction F or --vram BYTES (repeatable)")
    return out


def _row(size: str, r: SimResult, theta: float = 1.0) -> dict[str, Any]:
    est = r.tpot_s is not None
    top = r.stats.get("total", {}).get("top_hit_rate", r.hit_rate)
    return {"size": size, "mode": r.decode_mode, "θ": f"{theta:.2g}", "policy": r.policy,
            "predictor": r.predictor or "-", "planner": r.planner or "-", "miss": r.miss_policy,
            "hit rate": f"{r.hit_rate:.1%}", "top hits": f"{top:.1%}" if theta < 1 else "-", "pred acc": f"{r.pred_accuracy:.1%}" if r.predictor else "-",
            "GoodPred": f"{r.goodpred:.1%}" if r.predictor else "-",
            "plan acc": f"{r.plan_accuracy:.1%}" if r.planner else "-",
            "exposed copy ms (est., total)": f"{r.exposed_copy_s * 1e3:.1f}" if est else "-",
            "CPU experts": r.host_computed,
            "TPOT ms (est.)": f"{r.tpot_s * 1e3:.3f}" if est else "-",
            "TTFT ms (est.)": f"{r.ttft_s * 1e3:.1f}" if r.ttft_s is not None else "-",
            "cache MiB": f"{r.cache_bytes / 2**20:.1f}", **_tier_columns(r)}


def _tier_columns(r: SimResult) -> dict[str, str]:
    """The host and disk tiers' columns of a row with a disk tier (none without one)."""
    host = r.tiers.get("host")
    if not host:
        return {}
    return {"host hits": f"{host['host_hit_rate']:.1%}", "disk MiB/tok": f"{host['disk_bytes_per_token'] / 2**20:.1f}",
            "predicted reads": f"{host['predicted_read_share']:.1%}"}


def render_table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(width[c]) for c in cols)
    return "\n".join([line, "  ".join("-" * width[c] for c in cols),
                      *("  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows)])


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or UsageError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ggmoe[train]' or pip install matplotlib") from None
    return plt


def plot(path: str, rows: list[dict[str, Any]], results: list[SimResult]) -> None:
    plt = pyplot()
    labels = [f"{r['size']}\n{r['policy']}/{r['predictor']}/{r['miss']}" for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(rows)), 4.5))
    ax[0].bar(range(len(rows)), [x.hit_rate for x in results])
    ax[0].set_ylabel("hit rate")
    tpot = [x.tpot_s * 1e3 if x.tpot_s is not None else 0 for x in results]
    ax[1].bar(range(len(rows)), tpot)
    ax[1].set_ylabel("TPOT, ms (estimate)")
    for a in ax:
        a.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    with atomic_write(path) as f:  # a crash or Ctrl-C leaves no half-written image
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


_SHARED: tuple = ()  # what every configuration of one simulate call shares (set before the workers fork)


def _run_one(cfg: SimConfig) -> SimResult:
    from ggmoe.simulate.des import simulate as run

    trace, bpe, profile, train, model = _SHARED
    return run(trace, cfg, bpe, profile, train, model_path=model)


def run_configs(configs: list[SimConfig], shared: tuple, jobs: int | None) -> list[SimResult]:
    """``des.simulate`` of every configuration, in order; ``jobs`` worker processes (forked, so the traces are
    not copied; default: the CPUs this process may use), one process for one configuration or ``jobs=1``."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    global _SHARED
    _SHARED = shared
    n = min(jobs or len(os.sched_getaffinity(0)), len(configs))
    with click.progressbar(length=len(configs), label="simulating", file=sys.stderr) as bar:
        if n <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            out = []
            for cfg in configs:
                out.append(_run_one(cfg))
                bar.update(1)
            return out
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as ex:
            # the likely longest first, so that no long one starts last while the other workers idle
            order = sorted(range(len(configs)), key=lambda i: _cost_rank(configs[i]), reverse=True)
            futures = {i: ex.submit(_run_one, configs[i]) for i in order}
            for _ in as_completed(futures.values()):
                bar.update(1)
            return [futures[i].result() for i in range(len(configs))]


def _cost_rank(cfg: SimConfig) -> tuple:
    """What makes a replay long, most first: the async decode (admissions submitted and cancelled at every
    token), a predictor, a policy reading the future, fewer slots (more misses)."""
    from ggmoe.cache.policies import POLICIES

    slots = sum(cfg.n_slots.values()) / max(len(cfg.n_slots), 1)
    return (cfg.decode_mode == "async", cfg.predictor is not None,
            bool(getattr(POLICIES.get(cfg.policy), "needs_future", False)), -slots)


def trace_model(trace: Trace, model: str | None, need_bytes: bool,
                counts_flag: str) -> tuple[ModelFacts | TraceShape, Path | None]:
    """(facts, GGUF path) of the model the traces route: ``--model`` (or the embedded model), checked by
    fingerprint; an imported trace made without a GGUF is checked by shape, and runs without one for counts
    (its shape from the trace, no bytes: ``need_bytes`` refuses that, naming ``counts_flag``)."""
    from ggmoe.inspect import inspect_model
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.trace.imports import TraceShape, check_trace_fits

    imported = bool(trace.meta.source) and not trace.meta.model_fingerprint
    if imported and model is None:
        if need_bytes:
            raise UsageError(f"the trace was imported without a model ({trace.meta.source}): give the GGUF its "
                             f"routing belongs to with --model for times, or {counts_flag} for counts")
        return TraceShape.of(trace), None
    path = model_path(model, "--model")
    facts = inspect_model(path)
    if imported:
        check_trace_fits(trace, facts.n_expert, facts.n_expert_used, facts.moe_layers, Path(path).name)
    elif trace.meta.model_fingerprint != model_fingerprint(path):
        raise UsageError(f"the traces come from another model than {Path(path).name}: give it with --model")
    return facts, path


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path())
@click.option("--model", "model", help="The GGUF the traces come from (bytes per expert); default: the "
                                       "embedded model.")
@sweep_options
@predictor_options
@machine_options
@output_options
@edge
def simulate(traces: tuple[str, ...], model: str | None, sweep: SweepFlags, predictors: PredictorFlags,
             machine: MachineFlags, output: OutputFlags) -> None:
    """Replay traces through the cache, copy queue and prefetcher on a hardware cost model.

    Every combination of the sizes, policies, predictors and miss policies given is simulated and shown
    side by side: hit rate, prediction accuracy, GoodPred, exposed copy time, experts computed on the
    CPU, and estimated TPOT and TTFT (estimates from the profile: see docs/simulator.md).

    \b
    Examples:
      ggmoe trace --prompts prompts.jsonl -o traces/
      ggmoe simulate traces/trace.npz --cache-fraction 0.25,0.5 --policy lru,lfu,lcp
      ggmoe simulate traces/trace.npz --cache-slots 16 --predictor none,reuse,oracle --stride 1 --hw egpu
      ggmoe simulate traces/trace.npz --vram 4MiB --miss-policy wait,auto --json
      ggmoe simulate traces/trace.npz --cache-fraction 0.5 --decode-mode sync,async,async-fill --hw h100
      ggmoe simulate traces/trace.npz --cache-slots 8 --decode-mode async --plan-predictor none,reuse,next.npz
      ggmoe simulate traces/trace.npz --cache-fraction 0.25 --theta 1,0.5 --decode-mode async --hw h100
      ggmoe simulate traces/trace.npz --vram 8GiB --host-ram 24GiB --hw rtx4090/pcie4x16/ddr5-5600x2/nvme4
      ggmoe trace import esft/intent esft/law -o ds2/ --n-expert 64 --top-k 6 && \
        ggmoe simulate ds2/ --hw none --cache-fraction 0.125,0.25,0.5 --policy lru,belady --jobs 2
    """
    sw, pr, plot_path = sweep, predictors, output.plot_path
    if plot_path is not None:
        check_output(plot_path, "--plot", suffixes=PLOT_SUFFIXES)
    choices = _check_choices(sw.policy, sw.predictor, sw.miss_policy, sw.decode_mode, sw.theta, sw.plan_predictor)
    inputs = _load_inputs(traces, model, machine.hw, pr.predictor_train, pr.stats_in, bool(sw.vram), choices.thetas)
    tiers = _host_tiers(inputs, machine.host_ram)
    options = _policy_options(choices.policies, inputs.warm)
    combos = _combinations(inputs.facts, sw.cache_slots, sw.cache_fraction, sw.vram, choices)
    _check_predictors(choices.predictors, choices.planners, combos, pr.stride, inputs)
    if plot_path is not None:
        pyplot()  # matplotlib missing: say so before simulating, not after
    configs = _sim_configs(combos, inputs, options, pr.stride, pr.n_prefetch, pr.predictor_s)
    if tiers is not None and tiers.disk:
        configs = [dataclasses.replace(c, host_slots=tiers.host_slots) for c in configs]
    results = run_configs(configs, inputs.shared(), machine.jobs)
    _report(traces, machine.hw, inputs, combos, results, plot_path, output.as_json)
    if tiers is not None and not output.as_json:
        click.echo("tiers (GPU slots: the rows' sizes):\n" + "\n".join(tiers.render_lines()[1:]))


def _host_tiers(inputs: _Inputs, host_ram: str | None) -> TierSizes | None:
    """The host tier that --host-ram buys (``ggmoe.cache.tiers``), or None without the flag."""
    if host_ram is None:
        return None
    if inputs.path is None:
        raise UsageError("--host-ram needs the model's bytes per expert: give --model")
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.tiers import tier_sizes

    return tier_sizes(inputs.facts, inputs.facts.n_expert_used, parse_bytes(host_ram))


@dataclasses.dataclass(frozen=True)
class _Choices:
    """The names and shares of one simulate call, checked against their registries."""

    policies: list[str]
    predictors: list[str | None]  # None: no prefetching
    misses: list[str]
    modes: list[str]  # sync, async, async-fill, hybrid
    thetas: list[float]  # MoEpic's top shares; 1.0: whole experts
    planners: list[str | None]  # cross-token predictors planning between tokens; None: no planner


def _check_choices(policy: tuple[str, ...], predictor: tuple[str, ...], miss_policy: tuple[str, ...],
                   decode_mode: tuple[str, ...], theta: tuple[str, ...], plan_predictor: tuple[str, ...]) -> _Choices:
    """The lists the flags give (with their defaults), every name checked: a typo fails before any file is
    read."""
    from ggmoe.cache.miss import check_miss_policy
    from ggmoe.cache.policies import POLICIES
    from ggmoe.predict.base import check_predictor

    policies = _split(policy, "--policy") or ["lru"]
    predictors = [None if p == "none" else p for p in (_split(predictor, "--predictor") or ["none"])]
    misses = _split(miss_policy, "--miss-policy") or ["wait"]
    for pol in policies:
        POLICIES.get(pol)
    for pred in predictors:
        if pred is not None:
            check_predictor(pred)
    planners = [None if p == "none" else p for p in (_split(plan_predictor, "--plan-predictor") or ["none"])]
    for pl in planners:
        planner_config(pl)  # a name that cannot plan, or a missing file, fails now
    for miss in misses:
        check_miss_policy(miss)
    modes = _split(decode_mode, "--decode-mode") or ["sync"]
    for mode in modes:
        if mode not in SIM_MODES:
            raise UsageError(f"unknown decode mode {mode!r} for the simulator; choose {', '.join(SIM_MODES)}")
    thetas = _numbers(theta, float, "--theta") or [1.0]
    return _Choices(policies, predictors, misses, modes, thetas, planners)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What every configuration of one simulate call reads: the traces, the model, the profile, the
    predictors' training traces and the saved statistics."""

    trace: Trace  # the traces, merged
    facts: ModelFacts | TraceShape  # the trace's shape for an imported trace without a model
    path: Path | str | None  # the GGUF (None: an imported trace, counts only)
    profile: HardwareProfile | None  # None for counts only
    train: Trace | None  # training traces for predictors that learn, or None
    warm: RoutingStats | None  # the statistics of --stats-in, or None

    def learnt(self, pred: str | None) -> Any:
        """What the predictor saved in --stats-in learnt, for that predictor (None for any other)."""
        warm = self.warm
        return (warm.predictor_state or None) if warm is not None and pred and warm.predictor == pred else None

    def model(self) -> str | None:
        return str(self.path) if self.path else None

    def shared(self) -> tuple:
        """What ``_run_one`` reads for every configuration: (trace, bytes per expert, profile, train, model)."""
        bpe = {il: self.facts.bytes_per_expert(il) for il in self.facts.moe_layers}
        return (self.trace, bpe, self.profile, self.train, self.model())


def _load_inputs(traces: tuple[str, ...], model: str | None, hw: str, predictor_train: tuple[str, ...],
                 stats_in: str | None, vram: bool, thetas: list[float]) -> _Inputs:
    """The profile, traces, model and statistics, each checked as it is read (the cheap ones first)."""
    from ggmoe.cache.hardware import load_profile
    from ggmoe.cli.cache_flags import read_stats_in
    from ggmoe.trace import load_traces

    profile = None if hw == "none" else load_profile(hw)
    trace = load_traces(list(traces))
    facts, path = trace_model(trace, model, profile is not None, "--hw none")
    if path is None and (vram or stats_in or thetas != [1.0]):
        raise UsageError("--vram, --stats-in and --theta need the model's bytes per expert: give --model")
    train = load_traces(list(predictor_train)) if predictor_train else None
    warm = read_stats_in(stats_in, facts, Path(path)) if path is not None else None
    if profile is not None and path is not None:  # the CPU's rate for the model's expert types
        profile = profile.for_expert_types(expert_types(facts))
    return _Inputs(trace, facts, path, profile, train, warm)


def expert_types(facts: ModelFacts) -> dict[str, int]:
    """Bytes of the cached expert weights per ggml type, one expert of every MoE layer summed."""
    out: dict[str, int] = {}
    for il in facts.moe_layers:
        for t in facts.layer(il).cached:
            out[t.ggml_type] = out.get(t.ggml_type, 0) + t.bytes_per_expert
    return out


def _policy_options(policies: list[str], warm: RoutingStats | None) -> dict[str, dict]:
    """Options per policy that the call's inputs give: static pins the hottest experts of --stats-in."""
    options: dict[str, dict] = {}
    if "static" in policies:
        if warm is None:
            raise UsageError("--policy static pins the hottest experts of saved statistics: give --stats-in FILE")
        options["static"] = {"counts": warm.counts_by_layer()}
    return options


def _combinations(facts: ModelFacts | TraceShape, cache_slots: tuple[str, ...], cache_fraction: tuple[str, ...],
                  vram: tuple[str, ...], choices: _Choices) -> list[tuple]:
    """Every (size, policy, predictor, miss policy, decode mode, θ) that can run, in the order of the flags."""
    # async reads misses over the link (wait) or computes some on the CPU in its host part (cpu, auto), as the
    # engine's; a predictor there prefetches from the mailbox (the engine's stride prefetch into free slots);
    # split layers (θ < 1) read what is not cached from host memory, so they need wait
    c = choices
    combos = [k for k in itertools.product(sizes(facts, cache_slots, cache_fraction, vram), c.policies,
                                           c.predictors, c.misses, c.modes, c.thetas, c.planners)
              if _mode_runs(k[4], k[3]) and (k[5] == 1.0 or k[3] == "wait")]
    for mode in c.modes:
        if mode != "sync" and not any(k[4] == mode for k in combos):
            raise UsageError(f"--decode-mode {mode} needs --miss-policy auto among the choices")
    return combos


def _mode_runs(mode: str, miss: str) -> bool:
    """Whether a decode mode runs with a miss policy: hybrid splits a layer's misses between the link and the CPU
    (auto); sync and async run every policy (async computes the CPU's share in its host part)."""
    return mode != "hybrid" or miss == "auto"


def _check_predictors(predictors: list[str | None], planners: list[str | None], combos: list[tuple], stride: int,
                      inputs: _Inputs) -> None:
    """Build every predictor once, unfitted: one that cannot run is refused before any is simulated."""
    from ggmoe.simulate.des import SimConfig, sim_predictor

    for pred in predictors:
        if pred is not None:
            check = SimConfig(n_slots=combos[0][0][1], predictor=pred, stride=stride,
                              predictor_state=inputs.learnt(pred))
            sim_predictor(check, inputs.trace, inputs.train, inputs.model(), fit=False)
    for pl in planners:
        if pl is not None:
            sim_predictor(SimConfig(n_slots={}, planner=pl), inputs.trace, inputs.train, inputs.model(),
                            fit=False, planner=True)


def _sim_configs(combos: list[tuple], inputs: _Inputs, options: dict[str, dict], stride: int,
                 n_prefetch: int | None, predictor_s: float | None) -> list[SimConfig]:
    """One ``SimConfig`` per combination; a split row gets the VRAM of its whole-expert row."""
    from ggmoe.cache.split import split_at
    from ggmoe.simulate.des import SimConfig

    configs = []
    for (_, slots), pol, pred, miss, mode, th, pl in combos:
        split, n_slots = split_at(inputs.facts, slots, th)  # the same VRAM as the whole-expert row
        configs.append(SimConfig(n_slots=n_slots, policy=pol, policy_options=options.get(pol), predictor=pred,
                                 stride=stride, n_prefetch=n_prefetch, miss_policy=miss, predictor_s=predictor_s,
                                 predictor_state=inputs.learnt(pred),
                                 decode_mode="sync" if mode in ("sync", "hybrid") else "async", split=split,
                                 planner=pl, fills=mode == "async-fill", hybrid=mode == "hybrid"))
    return configs


def _report(traces: tuple[str, ...], hw: str, inputs: _Inputs, combos: list[tuple], results: list[SimResult],
            plot_path: str | None, as_json: bool) -> None:
    """The results: the plot if asked, then JSON or the table."""
    rows = [_row(label, r, th) for ((label, _), *_rest, th, _pl), r in zip(combos, results, strict=True)]
    if plot_path is not None:
        plot(plot_path, rows, results)
    trace = inputs.trace
    if as_json:
        click.echo(json.dumps({"traces": list(traces), "model": inputs.model(), "profile": hw,
                               "routing": trace.meta.source or "recorded by ggmoe",
                               "estimates": "tpot_s and ttft_s are estimates from the profile's cost model",
                               "results": [dataclasses.asdict(r) for r in results]}, indent=2))
        return
    if trace.meta.source:
        click.echo(f"routing: {trace.meta.source}")
    click.echo(f"{trace.n_tokens} tokens of {trace.n_prompts} prompts; profile {hw}"
               + ("" if inputs.profile else " (counts only: no times)"))
    click.echo(render_table(rows))
