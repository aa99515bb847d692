"""The engine: llama.cpp through llama-cpp-python with the experts in host memory and the gate hook.

The only subpackage that touches ctypes. Importing the package is light: ``Engine`` and its records load
llama-cpp-python on first use (``from ggmoe.engine import Engine``), so ``ggmoe.engine.build`` (which must
not load the engine it is about to replace) and the other light modules import without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ggmoe.engine.engine import Engine, EngineConfig, Generation, Timings, gpu_device_name

__all__ = ["Engine", "EngineConfig", "Generation", "Timings", "gpu_device_name"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("ggmoe.engine.engine"), name)
    raise AttributeError(f"module 'ggmoe.engine' has no attribute {name!r}")
