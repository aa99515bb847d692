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
from ggmoe.cli.quant_flags import (
    BudgetFlags,
    MeasureFlags,
    QualityFlags,
    budget_options,
    measure_options,
    output_options,
    quality_options,
)
from ggmoe.cli.simulate_flags import OutputFlags

if TYPE_CHECKING:
    from ggmoe.cache.hardware import HardwareProfile
    from ggmoe.cli.quant_quality import LevelRun, LiveSpec
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


def _pareto(points: list[tuple[float, float] | None]) -> list[bool]:
    """Which points no other point beats on both axes (lower is better on both); None is never marked."""
    def beaten(a: tuple[float, float]) -> bool:
        return any(b is not None and b[0] <= a[0] and b[1] <= a[1] and b != a for b in points)

    return [p is not None and not beaten(p) for p in points]


def _live_rows(rows: list[dict[str, Any]], out: list[dict[str, Any]], runs: list[LevelRun],
               ref_name: str) -> tuple[list[tuple[float, float] | None], bool]:
    """Add each level's measured and quality figures to its table row and JSON record; return the Pareto
    points (TPOT, mean KLD) and whether TPOT is measured."""
    measured = any(r.measured is not None for r in runs)
    points: list[tuple[float, float] | None] = []
    for row, rec, run in zip(rows, out, runs, strict=True):
        if run.measured is not None:
            m = run.measured
            row.update({"hit rate (meas.)": "-" if m.hit_rate is None else f"{m.hit_rate:.1%}",
                        "TPOT ms (meas.)": f"{m.tpot_s * 1e3:.3f}"})
            rec["measured"] = m.to_dict()
        q = run.quality
        if q is not None:
            row.update({"PPL": f"{q.ppl:.3f}", "KLD mean": f"{q.kld_mean:.5f}", "KLD median": f"{q.kld_median:.5f}",
                        "KLD p99": f"{q.kld_p99:.5f}", "same top": f"{q.top_agreement:.1%}"})
            rec["quality"] = {**q.to_dict(), "reference": ref_name}
        tpot = run.measured.tpot_s if measured and run.measured else rec.get("tpot_s_estimate")
        points.append((tpot, q.kld_mean) if q is not None and tpot is not None else None)
    return points, measured


def _quality_plot(path: str, names: list[str], points: list[tuple[float, float] | None], ppl: list[float],
                  pareto: list[bool], measured: bool) -> None:
    """Mean KLD and perplexity against TPOT, one point per level; the Pareto levels filled and joined."""
    from ggmoe.base.outputs import atomic_write
    from ggmoe.cli.simulate import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    kept = [i for i, p in enumerate(points) if p is not None]
    for ax, ys, label in ((axes[0], [points[i][1] for i in kept], "mean KL divergence vs the reference"),
                          (axes[1], [ppl[i] for i in kept], "perplexity")):
        xs = [points[i][0] * 1e3 for i in kept]
        front = sorted((x, y) for x, y, i in zip(xs, ys, kept, strict=True) if pareto[i])
        if ax is axes[0] and front:
            ax.plot(*zip(*front, strict=True), "-", color="tab:green", alpha=0.5, label="Pareto front")
        for x, y, i in zip(xs, ys, kept, strict=True):
            ax.plot(x, y, "*" if pareto[i] else "o", ms=12 if pareto[i] else 7,
                    color="tab:green" if pareto[i] else "tab:gray")
            ax.annotate(names[i], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
        ax.set_xlabel(f"TPOT, ms ({'measured here' if measured else 'estimate'})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("quantization levels: quality against speed (lower is better on both; stars: Pareto)")
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


@click.command("compare-quants")
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--traces", multiple=True, required=True, type=click.Path(),
              help="Traces of one of the models (routing is taken as shared by the quantization levels).")
@budget_options
@quality_options
@measure_options
@output_options
@edge
def compare_quants(models: tuple[str, ...], traces: tuple[str, ...], budget: BudgetFlags, quality: QualityFlags,
                   measured: MeasureFlags, output: OutputFlags) -> None:
    """Quantization levels of one model at one VRAM budget: bytes per expert, experts that fit, hit rate,
    estimated TPOT; with --text, perplexity and KL divergence; with --measure, TPOT measured here.

    The traces give the routing, taken as the same for every level (quantization changes it little);
    the models must be levels of one model. TPOT (est.) is the simulator's estimate on --hw
    (docs/simulator.md). The quality pass runs each level through the engine with the cache at the
    budget (the cache is exact): windows of --ctx tokens, the second half of each scored, as
    llama-perplexity does; the KL divergence is over the reference's --kl-top tokens and the rest.

    \b
    Examples:
      ggmoe quantize ggmoe/models/tiny-moe.gguf -o q4.gguf --type Q4_K_M
      ggmoe quantize ggmoe/models/tiny-moe.gguf -o f16.gguf --type F16
      ggmoe trace --prompts prompts.jsonl -o traces/
      ggmoe compare-quants q4.gguf ggmoe/models/tiny-moe.gguf f16.gguf --traces traces/trace.npz --vram 4MiB
      ggmoe compare-quants q4.gguf f16.gguf --traces traces/ --vram 4MiB --text wiki.txt --measure \\
            --save-kl-base f16-ref.npz --plot q.png
      ggmoe compare-quants q5.gguf --traces traces/ --vram 4MiB --text wiki.txt --kl-base f16-ref.npz --json
    """
    from ggmoe.base.units import parse_bytes
    from ggmoe.cache.hardware import load_profile
    from ggmoe.trace import load_traces

    q, b, plot_path = quality, budget, output.plot_path
    _check_outputs(plot_path, q.save_kl_base, q.text_path, q.reference, q.kl_base)
    _check_names(b.policy, b.miss_policy)
    profile = load_profile(b.hw)
    n_bytes = parse_bytes(b.vram)
    paths = [model_path(m, "MODELS") for m in models]
    facts = _same_model(paths)
    trace = load_traces(list(traces))
    rows, results, out = [], [], []
    for path in paths:
        row, r, record = _level(path, trace, n_bytes, (b.policy, b.miss_policy), profile)
        rows.append(row)
        out.append(record)
        results.append(r)
    spec = _live_spec(paths, facts, q.text_path, q.n_ctx, q.chunks, q.kl_top, q.reference, q.kl_base,
                      measured.measure_tokens if measured.measure else None, measured.threads)
    runs = _run_live(paths, facts, out, spec, (b.policy, b.miss_policy), q.save_kl_base)
    ref_name = (paths[spec.reference].name if spec.reference is not None else
                f"{(spec.kl_base.meta.get('model') or {}).get('name')} (--kl-base {q.kl_base})" if spec.kl_base else "")
    points, measured_rows = _live_rows(rows, out, runs, ref_name) if runs else ([], False)
    _report(rows, out, results, points, measured_rows, plot_path, output.as_json,
            (b.vram, n_bytes, b.hw, b.policy, b.miss_policy, trace.n_tokens))


def _check_outputs(plot_path: str | None, save_kl_base: str | None, text_path: str | None,
                   reference: str | None, kl_base: str | None) -> None:
    """Output paths and the flags that need --text, before any file is read."""
    from ggmoe.cli.simulate import PLOT_SUFFIXES, pyplot

    if plot_path is not None:
        check_output(plot_path, "--plot", suffixes=PLOT_SUFFIXES)
        pyplot()  # matplotlib missing: say so before any work
    if save_kl_base is not None:
        check_output(save_kl_base, "--save-kl-base", suffixes=(".npz",))
    needs = next((f for f, v in (("--reference", reference), ("--kl-base", kl_base),
                                 ("--save-kl-base", save_kl_base)) if v is not None), None)
    if needs is not None and text_path is None:
        raise UsageError(f"{needs} needs --text (the text the KL divergence is measured on)")
    if kl_base is not None and (reference is not None or save_kl_base is not None):
        raise UsageError("--kl-base is the reference: give it without --reference and --save-kl-base")
    if text_path is not None and not Path(text_path).is_file():
        raise UsageError(f"--text {text_path}: no such file")


def _check_names(policy: str, miss_policy: str) -> None:
    from ggmoe.cache.miss import check_miss_policy
    from ggmoe.cache.policies import POLICIES

    POLICIES.get(policy)  # names against their registries, before any file is read
    check_miss_policy(miss_policy)


def _same_model(paths: list[Path]) -> list[ModelFacts]:
    from ggmoe.cli.quant_quality import check_same_model
    from ggmoe.inspect import inspect_model

    facts = [inspect_model(p) for p in paths]
    check_same_model(paths, facts)
    return facts


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--text {path}: not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"--text {path}: {e.strerror}") from None


def _live_spec(paths: list[Path], facts: list[ModelFacts], text_path: str | None, n_ctx: int | None,
               chunks: int | None, kl_top: int, reference: str | None, kl_base: str | None,
               measure_tokens: int | None, threads: int | None) -> LiveSpec:
    from ggmoe.cli.quant_quality import LiveSpec, QualitySpec, check_ctx, reference_index
    from ggmoe.simulate.quality import load_reference

    window = check_ctx(paths[0], facts[0], n_ctx)
    quality = None
    if text_path is not None:
        quality = QualitySpec(_read_text(text_path), text_path, window, chunks, kl_top)
    ref_index = reference_index(paths, facts, reference) if text_path is not None and kl_base is None else None
    base = load_reference(kl_base) if kl_base is not None else None
    return LiveSpec(quality, window, ref_index, base, kl_base, measure_tokens, threads)


def _run_live(paths: list[Path], facts: list[ModelFacts], out: list[dict[str, Any]], spec: LiveSpec,
              policies: tuple[str, str], save_kl_base: str | None) -> list[LevelRun]:
    """The engine passes (none without --text and --measure); the reference written when asked."""
    from ggmoe.cache.config import CacheConfig
    from ggmoe.cache.decode_mode import DecodeConfig
    from ggmoe.cli.quant_quality import run_levels
    from ggmoe.control.run_config import RunConfig
    from ggmoe.simulate.quality import save_reference

    if spec.quality is None and spec.measure_tokens is None:
        return []
    caches = [RunConfig(CacheConfig(n_slots=r["slots_per_layer"], policy=policies[0]),
                        DecodeConfig(miss_policy=policies[1])) if r["fits"] else None for r in out]
    runs = run_levels(paths, facts, caches, spec)
    built = next((r.reference for r in runs if r.reference is not None), None)
    if save_kl_base is not None and built is not None:
        save_reference(save_kl_base, built)
    return runs


def _report(rows: list[dict[str, Any]], out: list[dict[str, Any]], results: list[SimResult | None],
            points: list[tuple[float, float] | None], measured: bool, plot_path: str | None, as_json: bool,
            head: tuple[str, int, str, str, str, int]) -> None:
    """The table (or JSON) and the picture."""
    from ggmoe.cli.simulate import plot, render_table

    vram, budget, hw, policy, miss, n_tokens = head
    pareto = _pareto(points)
    if points:
        for row, rec, p in zip(rows, out, pareto, strict=True):
            row["Pareto"] = "*" if p else ""
            rec["pareto"] = p
    if plot_path is not None and points:
        ppl = [rec["quality"]["ppl"] if "quality" in rec else 0.0 for rec in out]
        _quality_plot(plot_path, [r["model"] for r in rows], points, ppl, pareto, measured)
    elif plot_path is not None and any(r is not None for r in results):
        fitting = [(row, r) for row, r in zip(rows, results, strict=True) if r is not None]
        plot(plot_path, [{"size": row["model"], "policy": policy, "predictor": row["expert types"],
                          "miss": miss} for row, _ in fitting], [r for _, r in fitting])
    if as_json:
        click.echo(json.dumps({"vram": budget, "profile": hw, "policy": policy,
                               "estimates": "tpot_s_estimate comes from the profile's cost model",
                               "pareto_axes": ["tpot_s (measured)" if measured else "tpot_s_estimate",
                                               "quality.kld_mean"] if points else None,
                               "models": out}, indent=2))
        return
    click.echo(f"--vram {vram}, profile {hw}, policy {policy}; routing from {n_tokens} traced tokens")
    click.echo(render_table(rows))
