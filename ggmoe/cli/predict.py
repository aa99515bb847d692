"""``ggmoe eval-predictor``: score predictors on held-out prompts of traces (``ggmoe.predict.evaluate``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import check_output
from ggmoe.base.params import parse_pairs
from ggmoe.cli.edge import edge
from ggmoe.cli.options import SEED, FiniteFloat, model_path
from ggmoe.cli.simulate import PLOT_SUFFIXES, pyplot

_traces_arg = click.argument("traces", nargs=-1, required=True, type=click.Path())


@click.command("eval-predictor")
@_traces_arg
@click.option("-p", "--predictor", "specs", multiple=True, required=True,
              help="A PRED.npz file (mlp) or a name: skip-gate, token, reuse, eam, expert-map, transition, oracle; "
                   "repeat to compare several.")
@click.option("--train", "train_paths", multiple=True, type=click.Path(),
              help="Training traces for the data-driven predictors (token, eam, expert-map, transition); TRACES are then "
                   "all held out. Without it TRACES are split by prompt (--val-frac, --seed) as train-predictor "
                   "splits them, so an mlp trained on TRACES is scored on its own validation prompts.")
@click.option("--stride", default=1, show_default=True, type=click.IntRange(min=1),
              help="Predict MoE layer l+S at layer l.")
@click.option("--prefetch", type=click.IntRange(min=1), help="Prefetch set size m (default: 2 x n_expert_used).")
@click.option("--stage", type=click.Choice(["all", "prefill", "decode"]), default="all", show_default=True,
              help="Which tokens are scored (all are replayed).")
@click.option("--model", type=click.Path(dir_okay=False),
              help="The GGUF (skip-gate reads its routers); default: the embedded model if the traces are its.")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE",
              help="Predictor option, e.g. capacity=512 (eam, expert-map), n_match=3, decay=0.5.")
@click.option("--val-frac", default=0.1, show_default=True, type=FiniteFloat(0.0, 1.0, min_open=True,
              max_open=True), help="Held-out share of the prompts when --train is not given.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the split by prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write accuracy per layer, predictors side by side.")
@edge
def eval_predictor(traces: tuple[str, ...], specs: tuple[str, ...], train_paths: tuple[str, ...], stride: int,
                   prefetch: int | None, stage: str, model: str | None, opts: tuple[str, ...], val_frac: float,
                   seed: int, as_json: bool, plot: str | None) -> None:
    """Score predictors on held-out prompts of TRACES: accuracy, recall/precision@m, latency per layer.

    \b
    Examples:
      ggmoe eval-predictor traces/ -p reuse -p token -p eam -p expert-map -p oracle
      ggmoe eval-predictor held-out/ --train train/ -p pred.npz -p skip-gate --model m.gguf --plot acc.png
      ggmoe eval-predictor traces/ -p pred-s2.npz --stride 2 --prefetch 16 --json
    """
    from ggmoe.control.prefetch import default_n_prefetch
    from ggmoe.predict import ModelShape
    from ggmoe.predict.evaluate import (
        build_predictor,
        check_options,
        default_model,
        evaluate,
        held_out_warning,
        json_safe,
        plot_accuracy,
        render_summary,
        render_text,
    )
    from ggmoe.trace.data import load_traces, select_prompts, split_prompts

    # Everything a user can get wrong fails here, before any trace is read: options, the model, the plot.
    options = check_options(list(specs), parse_pairs(opts))
    if model is not None:
        options["model"] = str(model_path(model, "--model"))
    if plot is not None:
        check_output(plot, "--plot", suffixes=PLOT_SUFFIXES)
        pyplot()  # matplotlib missing: say so before scoring
    test = load_traces(list(traces))
    if train_paths:
        train = load_traces(list(train_paths))
        if train.meta.model_fingerprint != test.meta.model_fingerprint:
            raise UsageError("--train traces come from another model than TRACES")
    else:
        tr_p, va_p = split_prompts(test.n_prompts, val_frac, seed)
        train, test = select_prompts(test, tr_p), select_prompts(test, va_p)
    if model is None and "skip-gate" in specs and (embedded := default_model(test.meta.model_fingerprint)):
        options["model"] = str(embedded)
    shape = ModelShape.from_trace(test.meta, test.layers)
    m = prefetch if prefetch is not None else default_n_prefetch(shape.n_expert_used, shape.n_expert)
    results = []
    for spec in specs:
        pred = build_predictor(spec, shape, stride, train, options)
        results.append(evaluate(pred, test, m, stage, label=spec))
    if plot:
        plot_accuracy(results, plot)
    if as_json:
        click.echo(json.dumps({"stage": stage, "results": [json_safe(r.to_dict()) for r in results]}, indent=2))
    else:
        click.echo("\n\n".join(render_text(r) for r in results))
        click.echo("\n" + render_summary(results))
        if plot:
            click.echo(f"\nplot: {Path(plot)}")
    if warning := held_out_warning(test):
        click.echo(warning, err=True)


