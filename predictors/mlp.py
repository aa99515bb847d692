"""ProMoE's predictor net and the training of one net.

The net maps the (normalised) MoE input of a source layer, ``[n_embd]``, to one
logit per expert of each target layer, ``[T * n_expert]``:
``fc2(dropout(relu(fc1(x))))``. Targets are multi-label (the k experts the router
selected), so the loss is binary cross-entropy on the logits. Training is seeded
and runs on the CPU; it stops when the validation loss has not improved for
``patience`` epochs and keeps the weights of the best epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .settings import FitSettings

__all__ = ["FitResult", "FitSettings", "PredictorMLP", "fit_arrays", "fit_net", "topk_accuracy"]


class PredictorMLP(nn.Module):
    def __init__(self, n_embd: int, hidden: int, n_out: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_embd, hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, n_embd] -> logits [n, T * n_expert]."""
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@dataclass(frozen=True)
class FitResult:
    state: dict[str, np.ndarray]  # fc1.weight [H, n_embd], fc1.bias [H], fc2.weight [T*E, H], fc2.bias [T*E]
    metrics: dict  # best_epoch, epochs, train_loss, val_loss, val_accuracy (per target list + mean)


def topk_accuracy(logits: torch.Tensor, target: torch.Tensor, n_expert: int, k: int) -> list[float]:
    """Per target layer: mean |top-k(logits) ∩ actual| / k. logits/target [n, T * n_expert]."""
    n_t = logits.shape[1] // n_expert
    out = []
    for t in range(n_t):
        blk = slice(t * n_expert, (t + 1) * n_expert)
        top = torch.topk(logits[:, blk], k, dim=1).indices
        out.append(float(torch.gather(target[:, blk], 1, top).sum() / (k * max(1, logits.shape[0]))))
    return out


def fit_net(x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
            n_expert: int, k: int, cfg: FitSettings, seed: int,
            on_epoch: Callable[[int, float, float], None] | None = None) -> FitResult:
    """Train one net. x [n, n_embd] float32 normalised, y [n, T * n_expert] float32 multi-hot."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    net = PredictorMLP(x_train.shape[1], cfg.hidden, y_train.shape[1], cfg.dropout)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_fn = nn.BCEWithLogitsLoss()
    best = (float("inf"), -1, copy.deepcopy(net.state_dict()), 0.0)  # (val loss, epoch, state, train loss)
    epochs = 0
    for epoch in range(cfg.max_epochs):
        net.train()
        perm = torch.randperm(x_train.shape[0], generator=gen)
        total = 0.0
        for i in range(0, x_train.shape[0], cfg.batch_size):
            b = perm[i:i + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x_train[b]), y_train[b])
            loss.backward()
            opt.step()
            total += loss.item() * b.shape[0]
        epochs = epoch + 1
        val_loss = _val_loss(net, x_val, y_val, loss_fn)
        if on_epoch is not None:
            on_epoch(epochs, total / x_train.shape[0], val_loss)
        if val_loss < best[0]:
            best = (val_loss, epoch, copy.deepcopy(net.state_dict()), total / x_train.shape[0])
        elif epoch - best[1] >= cfg.patience:
            break
    net.load_state_dict(best[2])
    net.eval()
    with torch.no_grad():
        acc = topk_accuracy(net(x_val), y_val, n_expert, k) if x_val.shape[0] else []
    state = {name: t.detach().numpy().copy() for name, t in net.state_dict().items()}
    metrics = {"best_epoch": best[1] + 1, "epochs": epochs, "train_loss": best[3],
               "val_loss": best[0] if x_val.shape[0] else None, "val_accuracy": acc,
               "val_accuracy_mean": float(np.mean(acc)) if acc else None}
    return FitResult(state=state, metrics=metrics)


def _val_loss(net: PredictorMLP, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module) -> float:
    if x.shape[0] == 0:
        return 0.0
    net.eval()
    with torch.no_grad():
        return float(loss_fn(net(x), y))


def fit_arrays(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, n_expert: int,
               k: int, cfg: FitSettings, seed: int, threads: int = 1,
               on_epoch: Callable[[int, float, float], None] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """``fit_net`` on numpy inputs; the weights under the file format's names (w1, b1, w2, b2) and the metrics."""
    torch.set_num_threads(threads)
    t = torch.from_numpy
    res = fit_net(t(x_train), t(y_train), t(x_val), t(y_val), n_expert, k, cfg, seed, on_epoch)
    st = res.state
    arrays = {"w1": st["fc1.weight"], "b1": st["fc1.bias"], "w2": st["fc2.weight"], "b2": st["fc2.bias"]}
    return arrays, res.metrics


def versions() -> dict[str, object]:
    """What the training ran with, for the file's metadata."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads()}
