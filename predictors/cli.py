"""``ggmoe train-predictor``: the ``predictors`` package's command, added to ``ggmoe`` as a plugin.

Registered in the ``ggmoe.commands`` entry-point group (pyproject.toml). Importing
this module never imports torch or scikit-learn: the command checks for what its
``--kind`` needs (mlp: torch, linear: scikit-learn) and says how to get it.
"""

from __future__ import annotations

import click

from ggmoe.base.errors import UsageError
from ggmoe.cli.edge import edge
from ggmoe.cli.groups import option_group
from ggmoe.cli.options import SEED, FiniteFloat
from predictors.settings import FitSettings


def _int_list(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected comma-separated layer indices, e.g. 0,1,2") from None


_NEEDS = {"mlp": ("torch", "tqdm"), "linear": ("sklearn", "tqdm")}  # modules each kind trains with


def _check_dependencies(kind: str) -> None:
    """The kind's training modules import, or one UsageError saying how to get them."""
    import importlib

    for module in _NEEDS[kind]:
        try:
            importlib.import_module(module)
        except ImportError:
            names = " and ".join("scikit-learn" if m == "sklearn" else m for m in _NEEDS[kind])
            raise UsageError(f"train-predictor --kind {kind} needs {names}: install ggmoe[train] "
                             "(pip install 'ggmoe[train]')") from None


# The MLP's training settings, handed to the command as one ``FitSettings`` (weight decay keeps its default)
_FIT = (
    click.option("--lr", default=1e-3, show_default=True, type=FiniteFloat(min=0.0, min_open=True),
                 help="Adam learning rate."),
    click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1), help="Tokens per step."),
    click.option("--patience", default=3, show_default=True, type=click.IntRange(min=1),
                 help="Epochs without a better validation loss before stopping."),
    click.option("--epochs", "max_epochs", default=20, show_default=True, type=click.IntRange(min=1),
                 help="Most epochs per net (early stopping usually ends sooner)."),
    click.option("--dropout", default=0.5, show_default=True, type=FiniteFloat(0.0, 1.0, max_open=True),
                 help="Dropout after the hidden layer (mlp)."),
    click.option("--hidden", default=1024, show_default=True, type=click.IntRange(min=1, max=65536),
                 help="Hidden units (mlp)."),
)
fit_options = option_group(FitSettings, "fit", *_FIT)


@click.command("train-predictor")
@click.argument("traces", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", required=True, type=click.Path(), help="Predictor file to write (.npz).")
@click.option("--kind", type=click.Choice(["mlp", "linear"]), default="mlp", show_default=True,
              help="mlp: ProMoE's two-layer MLP (torch); linear: a ridge baseline without a hidden layer "
                   "(scikit-learn), the same file format.")
@click.option("--mode", type=click.Choice(["layer", "token"]), default="layer", show_default=True,
              help="layer: predict a later MoE layer of the same token (the stride prefetcher, --predictor); "
                   "token: predict each layer's experts at the next token, trained on consecutive decode tokens "
                   "(the planner between tokens, --plan-predictor).")
@click.option("--stride", "strides", multiple=True, type=click.IntRange(min=1), default=(1,), show_default=True,
              help="Predict MoE layer l+S from layer l; repeat for several strides in one file (--mode layer).")
@click.option("--multi", is_flag=True, help="Multi-target nets: layers l+1..l+6 from layer l (ignores --stride).")
@click.option("--layers", help="Source MoE layers il, comma-separated (default: all).")
@fit_options
@click.option("--val-frac", default=0.1, show_default=True, type=FiniteFloat(0.0, 1.0, min_open=True,
              max_open=True), help="Share of the prompts held out for early stopping (split by prompt).")
@click.option("--alpha", "alphas", multiple=True, type=FiniteFloat(min=0.0, min_open=True),
              help="linear: L2 penalty; repeat to let grouped K-fold over the training prompts choose "
                   "[default: 0.1 1 10 100 1000].")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the split and the training.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Stored weight type.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="torch (mlp) or BLAS (linear) CPU threads (more only on an otherwise idle machine).")
@edge
def train_predictor(traces: tuple[str, ...], out: str, kind: str, mode: str, strides: tuple[int, ...], multi: bool,
                    layers: str | None, fit: FitSettings, val_frac: float, alphas: tuple[float, ...], seed: int,
                    dtype: str, threads: int) -> None:
    """Train ProMoE MLP (or linear baseline) predictors on TRACES (trace files or directories) into OUT.

    The file records the model, the mode and the strides; a run that needs another refuses it in one line.

    \b
    Examples:
      ggmoe train-predictor traces/ -o pred-s1.npz
      ggmoe train-predictor a/trace.npz b/trace.npz -o pred.npz --stride 1 --stride 2 --stride 3
      ggmoe train-predictor traces/ -o multi.npz --multi --hidden 512 --dtype float16
      ggmoe train-predictor traces/ -o linear-s1.npz --kind linear
      ggmoe train-predictor traces/ -o next-token.npz --mode token
    """
    _check_dependencies(kind)
    from ggmoe.predict.mlp_file import check_predictor_output
    from ggmoe.trace.data import load_traces
    from predictors.settings import LinearSettings
    from predictors.train import TrainConfig, export, train

    check_predictor_output(out)  # before any training: a bad -o fails now, not after the run
    if alphas and kind != "linear":
        raise UsageError("--alpha is a setting of --kind linear")
    if mode == "token" and (multi or strides != (1,)):
        raise UsageError("--mode token predicts the next token of each layer: --stride and --multi are --mode layer's")
    trace = load_traces(list(traces))
    cfg = TrainConfig(fit=fit, kind=kind, linear=LinearSettings(alphas=alphas) if alphas else LinearSettings(),
                      strides=strides, multi=multi, mode=mode, sources=_int_list(layers), val_frac=val_frac, seed=seed,
                      dtype=dtype, threads=threads)
    arrays, meta = train(trace, cfg, progress=True)
    path = export(out, arrays, meta)
    accs = [n["metrics"]["val_accuracy_mean"] for n in meta["nets"] if n["metrics"]["val_accuracy_mean"] is not None]
    click.echo(f"{path}: {len(meta['nets'])} nets (mode {mode}), mean validation accuracy "
               f"{sum(accs) / len(accs) if accs else float('nan'):.3f}, {meta['training']['seconds']:.1f} s")
