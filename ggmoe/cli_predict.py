"""``ggmoe train-predictor`` and ``ggmoe eval-predictor``: thin click commands over predictors/ and
``ggmoe.predict_eval`` (registered on the main group at the end of ``ggmoe.cli``)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .errors import UsageError


def _edge(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``ggmoe.cli._edge``, looked up at call time: ``ggmoe.cli`` imports this module at its end."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from .cli import _edge as edge

        return edge(fn)(*args, **kwargs)

    return wrapper


def _int_list(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected comma-separated layer indices, e.g. 0,1,2") from None


def _options(pairs: tuple[str, ...]) -> dict[str, object]:
    """KEY=VALUE pairs; values parsed as JSON where they can be (numbers, true/false), else strings."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--opt {pair!r}: expected KEY=VALUE, e.g. capacity=512")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


_traces_arg = click.argument("traces", nargs=-1, required=True, type=click.Path())


@click.command("train-predictor")
@_traces_arg
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="Predictor file to write (.npz).")
@click.option("--stride", "strides", multiple=True, type=click.IntRange(min=1), default=(1,), show_default=True,
              help="Predict MoE layer l+S from layer l; repeat for several strides in one file.")
@click.option("--multi", is_flag=True, help="Multi-target nets: layers l+1..l+6 from layer l (ignores --stride).")
@click.option("--layers", help="Source MoE layers il, comma-separated (default: all).")
@click.option("--hidden", default=1024, show_default=True, type=click.IntRange(min=1), help="Hidden units.")
@click.option("--dropout", default=0.5, show_default=True, type=click.FloatRange(0.0, 1.0, max_open=True),
              help="Dropout after the hidden layer.")
@click.option("--epochs", default=20, show_default=True, type=click.IntRange(min=1),
              help="Most epochs per net (early stopping usually ends sooner).")
@click.option("--patience", default=3, show_default=True, type=click.IntRange(min=1),
              help="Epochs without a better validation loss before stopping.")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1), help="Tokens per step.")
@click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              help="Adam learning rate.")
@click.option("--val-frac", default=0.1, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True,
              max_open=True), help="Share of the prompts held out for early stopping (split by prompt).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the split and the training.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Stored weight type.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="torch CPU threads (more only on an otherwise idle machine).")
@_edge
def train_predictor(traces: tuple[str, ...], out: str, strides: tuple[int, ...], multi: bool, layers: str | None,
                    hidden: int, dropout: float, epochs: int, patience: int, batch_size: int, lr: float,
                    val_frac: float, seed: int, dtype: str, threads: int) -> None:
    """Train ProMoE MLP predictors on TRACES (one or more trace files or directories) into OUT.

    \b
    Examples:
      ggmoe train-predictor traces/ -o pred-s1.npz
      ggmoe train-predictor a/trace.npz b/trace.npz -o pred.npz --stride 1 --stride 2 --stride 3
      ggmoe train-predictor traces/ -o multi.npz --multi --hidden 512 --dtype float16
    """
    try:
        import torch  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError:
        raise UsageError("train-predictor needs torch and tqdm: install ggmoe[train] "
                         "(pip install 'ggmoe[train]')") from None
    from predictors.mlp import FitSettings
    from predictors.train import TrainConfig, export, train

    from .predict_data import load_traces

    trace = load_traces(list(traces))
    cfg = TrainConfig(fit=FitSettings(hidden=hidden, dropout=dropout, lr=lr, batch_size=batch_size,
                                      max_epochs=epochs, patience=patience),
                      strides=strides, multi=multi, sources=_int_list(layers), val_frac=val_frac, seed=seed,
                      dtype=dtype, threads=threads)
    arrays, meta = train(trace, cfg, progress=True)
    path = export(out, arrays, meta)
    accs = [n["metrics"]["val_accuracy_mean"] for n in meta["nets"] if n["metrics"]["val_accuracy_mean"] is not None]
    click.echo(f"{path}: {len(meta['nets'])} nets, mean validation accuracy "
               f"{sum(accs) / len(accs) if accs else float('nan'):.3f}, {meta['training']['seconds']:.1f} s")


@click.command("eval-predictor")
@_traces_arg
@click.option("-p", "--predictor", "specs", multiple=True, required=True,
              help="A PRED.npz file (mlp) or a name: skip-gate, token, reuse, eam, expert-map, oracle; "
                   "repeat to compare several.")
@click.option("--train", "train_paths", multiple=True, type=click.Path(),
              help="Training traces for the data-driven predictors (token, eam, expert-map); TRACES are then "
                   "all held out. Without it TRACES are split by prompt (--val-frac, --seed) as train-predictor "
                   "splits them, so an mlp trained on TRACES is scored on its own validation prompts.")
@click.option("--stride", default=1, show_default=True, type=click.IntRange(min=1),
              help="Predict MoE layer l+S at layer l.")
@click.option("--prefetch", type=click.IntRange(min=1), help="Prefetch set size m (default: 2 x n_expert_used).")
@click.option("--stage", type=click.Choice(["all", "prefill", "decode"]), default="all", show_default=True,
              help="Which tokens are scored (all are replayed).")
@click.option("--model", type=click.Path(dir_okay=False), help="The GGUF (skip-gate reads its routers).")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE",
              help="Predictor option, e.g. capacity=512 (eam, expert-map), n_match=3, decay=0.5.")
@click.option("--val-frac", default=0.1, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True,
              max_open=True), help="Held-out share of the prompts when --train is not given.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the split by prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write accuracy per layer, predictors side by side.")
@_edge
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
    from .predict import ModelShape
    from .predict_data import load_traces, select_prompts, split_prompts
    from .predict_eval import build_predictor, check_options, evaluate, json_safe, plot_accuracy, render_text

    options = _options(opts)
    check_options(list(specs), options)
    if model is not None:
        options["model"] = model
    test = load_traces(list(traces))
    if train_paths:
        train = load_traces(list(train_paths))
        if train.meta.model_fingerprint != test.meta.model_fingerprint:
            raise UsageError("--train traces come from another model than TRACES")
    else:
        tr_p, va_p = split_prompts(test.n_prompts, val_frac, seed)
        train, test = select_prompts(test, tr_p), select_prompts(test, va_p)
    shape = ModelShape.from_trace(test.meta, test.layers)
    m = prefetch if prefetch is not None else min(2 * shape.n_expert_used, shape.n_expert)
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
        if plot:
            click.echo(f"\nplot: {Path(plot)}")


