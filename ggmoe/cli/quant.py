"""``ggmoe quantize`` and ``ggmoe compare-quants``: quantization levels of one model side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import check_output
from ggmoe.cli.edge import edge
from ggmoe.cli.options import model_path, threads_opt

if TYPE_CHECKING:
    from ggmoe.cache.hardware import HardwareProfile
    from ggmoe.inspect import ModelFacts
    from ggmoe.simulate.des import SimResult
    from ggmoe.trace import Trace


@click.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="The quantized GGUF.")
@click.option("--type", "type_name", required=True, help="Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16, ... (llama-quantize's).")
@threads_opt
@edge
def quantize(src: str, out: str, type_name: str, threads: int | None) -> None:
    """Quantize a GGUF with llama.cpp's quantizer (requantizing a quantized model is allowed).

    \b
    Examples:
      ggmoe quantize ggmoe/models/tiny-moe.gguf -o tiny-Q4_K_M.gguf --type Q4_K_M
      ggmoe quantize model-F16.gguf -o model-Q5_K_M.gguf --type Q5_K_M
    """
    from ggmoe.engine.quantize import quantize as run
    from ggmoe.inspect import inspect_model

    path = model_path(src, "SRC")
    inspect_model(path)  # a bad file fails here, with ggmoe's message
    check_output(out, "-o", suffixes=(".gguf",))
    if Path(out).resolve() == path.resolve():
        raise UsageError("-o is the source file: write the quantized model elsewhere")
    written = run(path, Path(out), type_name, threads or 0)
    click.echo(f"wrote {written} ({written.stat().st_size / 2**20:.1f} MiB)")


def _level(path: Path, trace: Trace, budget: int, policies: tuple[str, str],
           profile: HardwareProfile) -> tuple[dict[str, Any], SimResult | None, dict[str, Any]]:
    """One quantization level at ``budget`` bytes under ``policies`` (policy, miss policy): its table row,
    its simulation (None: no cache fits) and its JSON record."""
    from ggmoe.cache.config import slots_for_budget
    from ggmoe.inspect import inspect_model
    from ggmoe.simulate.des import SimConfig, simulate

    facts = inspect_model(path)
    shape = (tuple(facts.moe_layers), facts.n_expert, facts.n_expert_used)
    if shape != (tuple(int(il) for il in trace.layers), trace.meta.n_expert, trace.meta.n_expert_used):
        raise UsageError(f"{path.name}: its MoE layers, experts or top-k differ from the traces'")
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    mean_bpe = sum(bpe.values()) / len(bpe)
    row: dict[str, Any] = {"model": path.name, "expert types": _types(facts), "bytes/expert": f"{mean_bpe:,.0f}",
                           "slots/layer": "-", "hit rate": "-", "TPOT ms (est.)": "-", "cache MiB": "-"}
    try:
        slots = slots_for_budget(budget, bpe, facts.n_expert, facts.n_expert_used)
    except UsageError:
        row["slots/layer"] = "does not fit"
        return row, None, {"model": str(path), "bytes_per_expert": mean_bpe, "fits": False}
    r = simulate(trace, SimConfig(n_slots=slots, policy=policies[0], miss_policy=policies[1]), bpe, profile)
    row.update({"slots/layer": next(iter(slots.values())), "hit rate": f"{r.hit_rate:.1%}",
                "TPOT ms (est.)": f"{r.tpot_s * 1e3:.3f}", "cache MiB": f"{r.cache_bytes / 2**20:.2f}"})
    return row, r, {"model": str(path), "bytes_per_expert": mean_bpe, "fits": True,
                    "slots_per_layer": next(iter(slots.values())), "hit_rate": r.hit_rate,
                    "tpot_s_estimate": r.tpot_s, "cache_bytes": r.cache_bytes}


def _types(facts: ModelFacts) -> str:
    names = sorted({t.ggml_type for layer in facts.layers for t in layer.tensors})
    return "/".join(names)


@click.command("compare-quants")
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--traces", multiple=True, required=True, type=click.Path(),
              help="Traces of one of the models (routing is taken as shared by the quantization levels).")
@click.option("--vram", required=True, help="Budget for cached experts over all layers, e.g. 4GiB.")
@click.option("--hw", default="pcie4", show_default=True, help="Hardware profile (pcie4, h100, egpu, GPU/LINK/HOST e.g. rtx4090/pcie4x16/ddr5-5600x2, a .toml).")
@click.option("--policy", default="lru", show_default=True)
@click.option("--miss-policy", default="wait", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of hit rate and TPOT.")
@edge
def compare_quants(models: tuple[str, ...], traces: tuple[str, ...], vram: str, hw: str, policy: str,
                   miss_policy: str, as_json: bool, plot_path: str | None) -> None:
    """Quantization levels of one model at one VRAM budget: bytes per expert, experts that fit, hit rate,
    estimated TPOT.

    The traces give the routing, taken as the same for every level (quantization changes it little);
    the models must share layers, experts and top-k. TPOT is an estimate (docs/simulator.md).

    \b
    Examples:
      ggmoe quantize ggmoe/models/tiny-moe.gguf -o q4.gguf --type Q4_K_M
      ggmoe quantize ggmoe/models/tiny-moe.gguf -o f16.gguf --type F16
      ggmoe trace --prompts prompts.jsonl -o traces/
      ggmoe compare-quants q4.gguf ggmoe/models/tiny-moe.gguf f16.gguf --traces traces/trace.npz --vram 4MiB
    """
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.hardware import load_profile
    from ggmoe.cache.miss import check_miss_policy
    from ggmoe.cache.policies import POLICIES
    from ggmoe.cli.simulate import PLOT_SUFFIXES, plot, pyplot, render_table
    from ggmoe.trace import load_traces

    if plot_path is not None:
        check_output(plot_path, "--plot", suffixes=PLOT_SUFFIXES)
        pyplot()  # matplotlib missing: say so before simulating
    POLICIES.get(policy)  # names against their registries, before any file is read
    check_miss_policy(miss_policy)
    profile = load_profile(hw)
    budget = parse_bytes(vram)
    paths = [model_path(m, "MODELS") for m in models]
    trace = load_traces(list(traces))
    rows, results, out = [], [], []
    for path in paths:
        row, r, record = _level(path, trace, budget, (policy, miss_policy), profile)
        rows.append(row)
        out.append(record)
        if r is not None:
            results.append(r)
    if plot_path is not None and results:
        fitting = [r for r in rows if r["hit rate"] != "-"]
        plot(plot_path, [{"size": r["model"], "policy": policy, "predictor": r["expert types"],
                          "miss": miss_policy} for r in fitting], results)
    if as_json:
        click.echo(json.dumps({"vram": budget, "profile": hw, "policy": policy,
                               "estimates": "tpot_s_estimate comes from the profile's cost model", "models": out},
                              indent=2))
        return
    click.echo(f"--vram {vram}, profile {hw}, policy {policy}; routing from {trace.n_tokens} traced tokens")
    click.echo(render_table(rows))
