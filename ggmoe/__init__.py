"""ggmoe: GGUF Mixture-of-Experts inference with host-side experts and a predictive GPU expert cache."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def __getattr__(name: str) -> Any:
    # ``ggmoe.load`` imports llama-cpp-python on first use only, so ``import ggmoe`` (and the CLI) stay light.
    if name == "load":
        from ggmoe.serve import load

        return load
    raise AttributeError(f"module 'ggmoe' has no attribute {name!r}")
