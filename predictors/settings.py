"""Training settings of the two predictor kinds, importable without torch or scikit-learn."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FitSettings:
    """The ProMoE MLP (``predictors.mlp``)."""

    hidden: int = 1024  # hidden units
    dropout: float = 0.5  # after the hidden layer, training only
    lr: float = 1e-3  # Adam
    weight_decay: float = 0.0
    batch_size: int = 256  # tokens per step
    max_epochs: int = 20
    patience: int = 3  # epochs without a better validation loss before stopping


@dataclass(frozen=True)
class LinearSettings:
    """The linear baseline (``predictors.linear``): ridge classifiers, the penalty chosen by grouped CV."""

    alphas: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0)  # L2 penalties tried
    cv_folds: int = 3  # GroupKFold folds over the training prompts (fewer when there are fewer prompts)
