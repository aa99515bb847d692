"""The linear baseline predictor (scikit-learn): what ProMoE's MLP gains from its hidden layer.

Per source layer and target list, a multi-label ridge classifier
(``sklearn.linear_model.RidgeClassifier``: one least-squares fit of all
``T * n_expert`` targets in {-1, +1} on the normalised MoE input) maps
``[n_embd]`` to one score per expert. Ridge rather than one-vs-rest logistic
regression: on the embedded model's traces one logistic net took 80 s (lbfgs,
not converged) for 3 points more top-k accuracy, a ridge net 0.2 s.

The penalty ``alpha`` is chosen among ``LinearSettings.alphas`` by
``sklearn.model_selection.GroupKFold`` over the TRAINING prompts (groups = prompt,
so a fold never sees tokens of a prompt it is scored on), by mean top-k accuracy;
the net is then refitted on all training prompts. The held-out prompts of
``ggmoe.trace.data.split_prompts`` (the split eval-predictor uses too) only give
the metrics stored in the file. Exported as kind ``linear`` of
``ggmoe.predict.mlp_file``: scores ``sigmoid(w x + b)``, a monotone map of the ridge
decision values, so the top-k ranking is the classifier's.
"""

from __future__ import annotations

import numpy as np
import sklearn
from sklearn.linear_model import RidgeClassifier
from sklearn.model_selection import GroupKFold
from threadpoolctl import threadpool_limits

from .settings import LinearSettings


def topk_accuracy(scores: np.ndarray, target: np.ndarray, n_expert: int, k: int) -> list[float]:
    """Per target layer: mean |top-k(scores) ∩ actual| / k. scores/target [n, T * n_expert]."""
    out = []
    for t in range(scores.shape[1] // n_expert):
        blk = slice(t * n_expert, (t + 1) * n_expert)
        top = np.argpartition(-scores[:, blk], k - 1, axis=1)[:, :k]
        out.append(float(np.take_along_axis(target[:, blk], top, axis=1).sum() / (k * max(1, scores.shape[0]))))
    return out


def _fit(x: np.ndarray, y: np.ndarray, alpha: float) -> RidgeClassifier:
    return RidgeClassifier(alpha=alpha).fit(x, y.astype(np.int8))


def choose_alpha(x: np.ndarray, y: np.ndarray, groups: np.ndarray, n_expert: int, k: int,
                 cfg: LinearSettings) -> tuple[float, dict[str, float]]:
    """The alpha with the best mean top-k accuracy over GroupKFold folds of the prompts; all the scores."""
    n_groups = np.unique(groups).size
    if len(cfg.alphas) == 1 or n_groups < 2:
        return float(cfg.alphas[0]), {}
    folds = list(GroupKFold(n_splits=min(cfg.cv_folds, n_groups)).split(x, y, groups))
    cv: dict[str, float] = {}
    for alpha in cfg.alphas:
        accs = [np.mean(topk_accuracy(_fit(x[a], y[a], alpha).decision_function(x[b]).reshape(len(b), -1),
                                      y[b], n_expert, k)) for a, b in folds]
        cv[repr(float(alpha))] = float(np.mean(accs))
    best = max(cv, key=lambda a: cv[a])  # first of equals: the grid's order
    return float(best), cv


def fit_linear(x_train: np.ndarray, y_train: np.ndarray, groups: np.ndarray, x_val: np.ndarray,
               y_val: np.ndarray, n_expert: int, k: int, cfg: LinearSettings,
               threads: int = 1) -> tuple[dict[str, np.ndarray], dict]:
    """One linear net. x [n, n_embd] float32 normalised, y [n, T * n_expert] float32 multi-hot, groups [n]
    the prompt of each training row. Returns the arrays under the file format's names (w, b) and metrics."""
    with threadpool_limits(limits=threads):  # BLAS threads, as --threads limits torch's
        alpha, cv = choose_alpha(x_train, y_train, groups, n_expert, k, cfg)
        clf = _fit(x_train, y_train, alpha)
        val = clf.decision_function(x_val).reshape(len(x_val), -1) if len(x_val) else None
    acc = topk_accuracy(val, y_val, n_expert, k) if val is not None else []
    w = np.asarray(clf.coef_, dtype=np.float32).reshape(y_train.shape[1], x_train.shape[1])  # [T*E, n_embd]
    b = np.asarray(clf.intercept_, dtype=np.float32).reshape(y_train.shape[1])  # [T*E]
    metrics = {"alpha": alpha, "cv_accuracy": cv, "val_accuracy": acc,
               "val_accuracy_mean": float(np.mean(acc)) if acc else None}
    return {"w": w, "b": b}, metrics


def versions() -> dict[str, object]:
    """What the training ran with, for the file's metadata."""
    return {"sklearn": sklearn.__version__}
