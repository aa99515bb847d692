"""The engine: llama.cpp through llama-cpp-python with the experts in host memory and the gate hook.

The only subpackage that touches ctypes. Importing the package is light: ``Engine`` and its records load
llama-cpp-python on first use (``from ggmoe.engine import Engine``), so its light modules import without
it. The engine's build (``ggmoe.base.engine_build``) lives outside: it must not load what it replaces.
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
