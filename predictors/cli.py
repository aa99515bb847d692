"""``ggmoe train-predictor``: the ``predictors`` package's command, added to ``ggmoe`` as a plugin.

Registered in the ``ggmoe.commands`` entry-point group (pyproject.toml). Importing
this module never imports torch: the command checks for it and says how to get it.
"""

from __future__ import annotations

import click

from ggmoe.cli.edge import edge
from ggmoe.errors import UsageError


def _int_list(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected comma-separated layer indices, e.g. 0,1,2") from None



@click.command("train-predictor")
@click.argument("traces", nargs=-1, required=True, type=click.Path())
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
@edge
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
    from ggmoe.trace.data import load_traces
    from predictors.mlp import FitSettings
    from predictors.train import TrainConfig, export, train

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
