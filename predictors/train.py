"""Train expert predictors from traces and export them to one ``.npz`` (format: ``ggmoe.predict.mlp_file``).

Two kinds (``TrainConfig.kind``): ``mlp``, ProMoE's two-layer MLPs (torch,
``predictors.mlp``), and ``linear``, the ridge baseline without a hidden layer
(scikit-learn, ``predictors.linear``); each is imported only when used, so this
module needs neither. One training run writes one file holding every net it trained:

- per stride s (``strides``, several allowed): one net per source MoE layer at
  position j predicting position j + s;
- ``multi``: one net per source layer predicting the next ``n_targets`` (6) MoE
  layers at once (fewer near the last layer);
- ``mode="token"`` (cross-token): one net per source MoE layer il predicting layer
  il's experts at the NEXT token from token t's input at il, trained on the pairs of
  consecutive decode tokens of one sequence (``ggmoe.trace.data.next_token_pairs``:
  never across a prompt boundary, never from a prefill token). Strides and ``multi``
  do not apply; the file records mode token (one token ahead).

The trace's prompts are split 9:1 BY PROMPT (``ggmoe.trace.data.split_prompts``,
seeded): the 90 % train the nets and give the input normalisation (mean/std per
feature of each source layer), the 10 % drive early stopping (mlp) and the
metrics stored in the file. The linear kind chooses its penalty by grouped K-fold
over the training prompts only (``predictors.linear``), so both kinds hold out the
same prompts, the ones ``ggmoe eval-predictor`` scores without ``--train``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ggmoe.base.errors import UsageError
from ggmoe.predict.mlp_file import FORMAT, KINDS, MODES, VERSION, write_predictor_file
from ggmoe.trace import Trace
from ggmoe.trace.data import next_token_pairs, select_prompts, split_prompts

from .settings import FitSettings, LinearSettings

N_TARGETS = 6  # layers ahead a multi-target net predicts (ProMoE's l+1..l+6)


@dataclass(frozen=True)
class TrainConfig:
    fit: FitSettings = FitSettings()  # kind mlp
    kind: str = "mlp"  # mlp | linear
    linear: LinearSettings = LinearSettings()  # kind linear
    strides: tuple[int, ...] = (1,)  # ignored when multi
    multi: bool = False
    mode: str = "layer"  # layer: il -> il + s within a token; token: il at t -> il at t + 1 (strides, multi ignored)
    sources: tuple[int, ...] | None = None  # source layers il; None: every MoE layer that has a target
    val_frac: float = 0.1  # held-out share of the prompts
    seed: int = 0
    dtype: str = "float32"  # stored weights: float32 | float16
    # torch intra-op (mlp) or BLAS (linear) threads. One by default: with two threads on a 2-core machine where another
    # process holds a core, a training step was measured 16x slower (threads spin on the busy core).
    threads: int = 1


@dataclass(frozen=True)
class NetPlan:
    il: int  # source MoE layer
    targets: tuple[int, ...]  # target MoE layers


def plan_nets(layers: list[int], cfg: TrainConfig) -> list[NetPlan]:
    """The nets a run trains, in order (source ascending, then stride)."""
    n = len(layers)
    if cfg.sources is not None:
        unknown = sorted(set(cfg.sources) - set(layers))
        if unknown:
            raise UsageError(f"--layers {unknown} are not MoE layers of the trace ({layers})")
    if not cfg.multi and cfg.mode == "layer":
        for s in cfg.strides:
            if not 1 <= s < n:
                raise UsageError(f"stride {s} needs at least {s + 1} MoE layers; the trace has {n}")
    plans = []
    for j, il in enumerate(layers):
        if cfg.sources is not None and il not in cfg.sources:
            continue
        if cfg.mode == "token":  # its own layer, one token ahead
            plans.append(NetPlan(il, (il,)))
        elif cfg.multi:
            targets = tuple(layers[j + 1:j + 1 + N_TARGETS])
            if targets:
                plans.append(NetPlan(il, targets))
        else:
            plans.extend(NetPlan(il, (layers[j + s],)) for s in sorted(set(cfg.strides)) if j + s < n)
    if not plans:
        raise UsageError("no net to train: the chosen layers have no later MoE layer at that stride")
    return plans


def _multi_hot(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids [n, T, k] -> [n, T * n_expert] float32 with 1 at the selected experts."""
    n, n_t, _ = ids.shape
    y = np.zeros((n, n_t, n_expert), dtype=np.float32)
    np.put_along_axis(y, ids.astype(np.int64), 1.0, axis=2)
    return y.reshape(n, n_t * n_expert)


def _net_seed(seed: int, plan: NetPlan) -> int:
    """A seed per net that does not depend on which other nets the run trains."""
    return int(np.random.SeedSequence([seed, plan.il, *plan.targets]).generate_state(1)[0])


def _check(trace: Trace, cfg: TrainConfig) -> None:
    """What training needs of the trace and the configuration, before any work."""
    if trace.hidden is None:
        raise UsageError("the trace has no hidden states (recorded with --no-hidden): "
                         f"the {cfg.kind} predictor learns from them")
    if cfg.dtype not in ("float32", "float16"):
        raise UsageError(f"dtype {cfg.dtype!r}: choose float32 or float16")
    if cfg.kind not in KINDS:
        raise UsageError(f"kind {cfg.kind!r}: choose one of {', '.join(KINDS)}")
    if cfg.mode not in MODES:
        raise UsageError(f"mode {cfg.mode!r}: choose one of {', '.join(MODES)}")
    if cfg.mode == "token" and cfg.multi:
        raise UsageError("--multi predicts later layers of the same token: it does not go with --mode token")
    if cfg.mode == "token" and next_token_pairs(trace).size == 0:
        raise UsageError("--mode token learns from consecutive decode tokens of one sequence: the traces have "
                         "none (record them with decode steps, e.g. ggmoe trace -n 32)")


def training_rows(trace: Trace, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(source rows, target rows) [n] int64 of ``trace``: the same rows in mode layer (a token's input -> its own
    later layers); in mode token, each pair of consecutive decode tokens of one sequence (r -> r + 1)."""
    if mode == "token":
        src = next_token_pairs(trace)
        return src, src + 1
    rows = np.arange(trace.n_tokens, dtype=np.int64)
    return rows, rows


def train(trace: Trace, cfg: TrainConfig, progress: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """Train the planned nets; returns the arrays and the metadata of the export."""
    _check(trace, cfg)
    fit, versions = _fitter(cfg)
    t_start = time.perf_counter()
    layers = [int(il) for il in trace.layers]
    plans = plan_nets(layers, cfg)
    tr_p, va_p = split_prompts(trace.n_prompts, cfg.val_frac, cfg.seed)
    tr, va = select_prompts(trace, tr_p), select_prompts(trace, va_p)
    (src_tr, dst_tr), (src_va, dst_va) = training_rows(tr, cfg.mode), training_rows(va, cfg.mode)
    groups = np.repeat(np.arange(tr.n_prompts), np.diff(tr.prompt_offsets))[src_tr]  # [n rows] prompt of each
    m = trace.meta
    arrays: dict[str, np.ndarray] = {}
    entries = []
    inputs: dict[int, tuple] = {}  # source il -> (x_train, x_val, mean, std): shared by that source's nets
    bar = tqdm(total=len(plans), desc=f"training {cfg.kind} predictors", unit="net", file=sys.stderr,
               disable=not progress)
    for i, plan in enumerate(plans):
        j = layers.index(plan.il)
        if plan.il not in inputs:
            inputs.clear()  # one source layer's inputs at a time: plans are ordered by source
            inputs[plan.il] = _inputs(tr.hidden[src_tr, j], va.hidden[src_va, j])
        x_tr, x_va, mean, std = inputs[plan.il]
        cols = [layers.index(t) for t in plan.targets]
        y_tr, y_va = _multi_hot(tr.ids[dst_tr][:, cols], m.n_expert), _multi_hot(va.ids[dst_va][:, cols], m.n_expert)

        def on_epoch(epoch: int, train_loss: float, val_loss: float, plan: NetPlan = plan) -> None:
            bar.set_postfix(il=plan.il, targets=",".join(map(str, plan.targets)), epoch=epoch,
                            val_loss=f"{val_loss:.4f}")

        weights, metrics = fit(x_tr, y_tr, groups, x_va, y_va, m.n_expert, m.n_expert_used,
                               _net_seed(cfg.seed, plan), on_epoch)
        arrays |= {f"net{i}.{key}": w.astype(cfg.dtype) for key, w in weights.items()}
        arrays[f"net{i}.mean"], arrays[f"net{i}.std"] = mean, std
        entries.append({"il": plan.il, "targets": list(plan.targets), "metrics": metrics}
                       | ({"strides": [layers.index(t) - j for t in plan.targets]} if cfg.mode == "layer" else {}))
        bar.update(1)
    bar.close()
    split = {"n_train_prompts": int(tr_p.size), "n_val_prompts": int(va_p.size), "val_prompts": va_p.tolist(),
             "n_train_tokens": tr.n_tokens, "n_val_tokens": va.n_tokens,
             "n_train_rows": int(src_tr.size), "n_val_rows": int(src_va.size),
             "seconds": round(time.perf_counter() - t_start, 2), **versions()}
    return arrays, _meta(trace, cfg, layers, entries, split)


def _meta(trace: Trace, cfg: TrainConfig, layers: list[int], entries: list[dict], split: dict) -> dict:
    """The file's metadata (``ggmoe.predict.mlp_file``): the model, the mode, the nets, how they were trained."""
    m = trace.meta
    return {
        "format": FORMAT, "version": VERSION, "kind": cfg.kind, "mode": cfg.mode,
        "model_fingerprint": m.model_fingerprint, "model_name": m.model_name, "arch": m.arch,
        "layers": layers, "n_expert": m.n_expert, "n_expert_used": m.n_expert_used, "n_embd": m.n_embd,
        "dtype": cfg.dtype, "hidden": cfg.fit.hidden if cfg.kind == "mlp" else 0,
        "activation": "relu" if cfg.kind == "mlp" else None, "output": "sigmoid",
        "normalisation": "x = (hidden - mean) / std, per feature, from the training prompts",
        "pairs": ("consecutive decode tokens of one sequence (ggmoe.trace.data.next_token_pairs)"
                  if cfg.mode == "token" else "each token with its own later layers"),
        "nets": entries,
        "training": {
            **(asdict(cfg.fit) if cfg.kind == "mlp" else asdict(cfg.linear)),
            "strides": list(cfg.strides) if cfg.mode == "layer" else [], "multi": cfg.multi, "seed": cfg.seed,
            "val_frac": cfg.val_frac, "split": "by prompt (ggmoe.trace.data.split_prompts)", **split,
        },
    }


def _fitter(cfg: TrainConfig) -> tuple[Callable[..., tuple[dict[str, np.ndarray], dict]], Callable[[], dict]]:
    """The kind's ``fit(x_tr, y_tr, groups, x_va, y_va, n_expert, k, seed, on_epoch) -> (weights, metrics)``
    and ``versions()``; imports torch or scikit-learn only for the kind asked for."""
    if cfg.kind == "mlp":
        from . import mlp

        def fit_mlp(x_tr, y_tr, groups, x_va, y_va, n_expert, k, seed, on_epoch):
            return mlp.fit_arrays(x_tr, y_tr, x_va, y_va, n_expert, k, cfg.fit, seed, cfg.threads, on_epoch)

        return fit_mlp, mlp.versions
    from . import linear

    def fit_linear(x_tr, y_tr, groups, x_va, y_va, n_expert, k, seed, on_epoch):  # deterministic: no seed
        return linear.fit_linear(x_tr, y_tr, groups, x_va, y_va, n_expert, k, cfg.linear, cfg.threads)

    return fit_linear, linear.versions


def _inputs(h_tr: np.ndarray, h_va: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Normalised inputs of one source layer and the statistics (from the training rows)."""
    x_tr = h_tr.astype(np.float32)
    mean = x_tr.mean(axis=0, dtype=np.float64).astype(np.float32)  # [n_embd]
    std = np.maximum(x_tr.std(axis=0, dtype=np.float64), 1e-6).astype(np.float32)  # [n_embd] > 0

    def norm(h: np.ndarray) -> np.ndarray:  # the same float32 arithmetic as ggmoe.predict.mlp_file.Net
        return (h.astype(np.float32) - mean) / std

    return norm(h_tr), norm(h_va), mean, std


def export(path: str | Path, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write the ``.npz`` through the format's writer (atomic, read back before it replaces ``path``)."""
    return write_predictor_file(path, meta, arrays)
