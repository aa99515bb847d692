"""Models shipped inside the package: the embedded default is a tiny MoE ggmoe trains itself."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).with_name("tiny-moe.gguf")


def default_model_path() -> Path | None:
    """The embedded default model, or None when this install does not ship it."""
    return DEFAULT_MODEL if DEFAULT_MODEL.is_file() else None
