"""The whole predictor evaluation in one command: train the MLPs, score every predictor, write a report.

    python -m predictors.report --train TRAIN_TRACES... --eval HELD_OUT_TRACES... \\
        [--model MODEL.gguf] --out docs/predictors [--strides 1 2 3] [--prefetch M]

Steps: (1) train one ``.npz`` with the single-target MLPs for every stride, one
with the multi-target MLPs and, with ``--linear``, one with the linear baseline
(``predictors.train``; kept in OUT and reused when ``--reuse`` is given and they exist); (2) for each stride, replay the held-out
traces through every predictor (``ggmoe.predict.evaluate``): mlp, mlp-multi, (linear),
skip-gate (with ``--model``), token, reuse, eam, expert-map, oracle; (3) write
OUT/results.json, OUT/accuracy-s{S}.png and OUT/README.md (tables, the machine,
the command). Run it under ``flock /tmp/ggmoe-heavy.lock`` on the shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from ggmoe.predict import ModelShape
from ggmoe.predict.evaluate import (
    EvalResult,
    build_predictor,
    evaluate,
    json_safe,
    plot_accuracy,
    render_text,
)
from ggmoe.trace.data import load_traces

from .mlp import FitSettings
from .train import TrainConfig, export, train

BASELINES = ("token", "reuse", "eam", "expert-map", "oracle")


def _train_files(trace, out: Path, strides: list[int], fit: FitSettings, seed: int, reuse: bool,
                 linear: bool) -> dict[str, Path]:
    files = {"mlp": out / "pred-strides.npz", "mlp-multi": out / "pred-multi.npz"}
    if linear:
        files["linear"] = out / "pred-linear.npz"
    for label, path in files.items():
        if reuse and path.is_file():
            continue
        cfg = TrainConfig(fit=fit, kind="linear" if label == "linear" else "mlp", strides=tuple(strides),
                          multi=label == "mlp-multi", seed=seed)
        arrays, meta = train(trace, cfg, progress=True)
        export(path, arrays, meta)
        print(f"{path}: {len(meta['nets'])} nets in {meta['training']['seconds']:.0f} s", file=sys.stderr)
    return files


def _table(results: list[EvalResult]) -> list[str]:
    r0 = results[0]
    rows = [f"| predictor | accuracy | recall@{r0.prefetch} | precision@{r0.prefetch} | p50 µs | p99 µs |",
            "|---|---|---|---|---|---|"]
    for r in results:
        o = r.overall
        rows.append(f"| {r.predictor} | {o.accuracy:.3f} | {o.recall:.3f} | {o.precision:.3f} | "
                    f"{o.latency_us_p50:.1f} | {o.latency_us_p99:.1f} |")
    return rows


def _machine() -> str:
    import torch

    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", nargs="+", required=True, help="training traces")
    ap.add_argument("--eval", nargs="+", required=True, help="held-out traces (other prompts, same model)")
    ap.add_argument("--model", help="the GGUF, for skip-gate")
    ap.add_argument("--out", required=True, help="report directory")
    ap.add_argument("--strides", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--prefetch", type=int, help="prefetch set size m (default 2 x n_expert_used)")
    ap.add_argument("--hidden", type=int, default=FitSettings.hidden)
    ap.add_argument("--dropout", type=float, default=FitSettings.dropout)
    ap.add_argument("--epochs", type=int, default=FitSettings.max_epochs)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="keep predictor files already in OUT")
    ap.add_argument("--linear", action="store_true", help="also train and score the linear baseline (scikit-learn)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_tr, test = load_traces(a.train), load_traces(a.eval)
    if train_tr.meta.model_fingerprint != test.meta.model_fingerprint:
        sys.exit("error: --train and --eval traces come from different models")
    fit = FitSettings(hidden=a.hidden, dropout=a.dropout, max_epochs=a.epochs)
    files = _train_files(train_tr, out, a.strides, fit, a.seed, a.reuse, a.linear)
    shape = ModelShape.from_trace(test.meta, test.layers)
    m = a.prefetch or min(2 * shape.n_expert_used, shape.n_expert)
    specs = [(label, str(path), {}) for label, path in files.items()]
    if a.model:
        specs.append(("skip-gate", "skip-gate", {"model": a.model}))
    specs += [(name, name, {}) for name in BASELINES]
    report: dict = {"command": " ".join(sys.argv), "machine": _machine(), "prefetch": m, "strides": {}}
    md = ["# Expert predictor evaluation", "", f"Command: `python -m predictors.report {' '.join(sys.argv[1:])}`", "",
          f"Machine: {_machine()}", "",
          f"Model {test.meta.model_name} ({test.meta.model_fingerprint}): {shape.n_layer} MoE layers, "
          f"{shape.n_expert} experts, k = {shape.n_expert_used}; training {train_tr.n_prompts} prompts / "
          f"{train_tr.n_tokens} tokens, held out {test.n_prompts} prompts / {test.n_tokens} tokens.", ""]
    for s in a.strides:
        results = []
        for label, spec, opts in specs:
            pred = build_predictor(spec, shape, s, train_tr, opts)
            results.append(evaluate(pred, test, m, label=label))
            print(render_text(results[-1]), file=sys.stderr)
        plot_accuracy(results, out / f"accuracy-s{s}.png")
        report["strides"][str(s)] = [r.to_dict() for r in results]
        md += [f"## Stride {s}", "", *_table(results), "", f"![accuracy per layer](accuracy-s{s}.png)", ""]
    md += ["Accuracy = |top-k ∩ actual| / k (ProMoE); recall/precision of a top-m prefetch; latency = "
           "observe + predict per layer and token in numpy on this CPU; overall pools the layers that have a "
           f"source layer. Total time {time.perf_counter() - t0:.0f} s.", ""]
    (out / "results.json").write_text(json.dumps(json_safe(report), indent=2))
    (out / "README.md").write_text("\n".join(md))
    print(out / "README.md")


if __name__ == "__main__":
    main()
