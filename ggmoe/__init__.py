"""ggmoe: GGUF Mixture-of-Experts inference with host-side experts and a predictive GPU expert cache."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from ggmoe.base.version import __version__

__all__ = ["CacheConfig", "DecodeConfig", "RunConfig", "TierConfig", "__version__", "load", "models"]

# ``ggmoe.load(path, run=ggmoe.RunConfig(ggmoe.CacheConfig(...), decode=ggmoe.DecodeConfig(...)))``: the run
# configuration's records, each from the module that owns it
_RECORDS = {"RunConfig": "ggmoe.control.run_config", "CacheConfig": "ggmoe.cache.config",
            "DecodeConfig": "ggmoe.cache.decode_mode", "TierConfig": "ggmoe.cache.tiers"}


def __getattr__(name: str) -> Any:
    # ``ggmoe.load`` imports llama-cpp-python on first use only, so ``import ggmoe`` (and the CLI) stay light.
    if name == "load":
        from ggmoe.engine.llama import load

        return load
    if name in _RECORDS:
        return getattr(importlib.import_module(_RECORDS[name]), name)
    if name == "models":  # the embedded model's path (a pathlib import, nothing heavier)
        return importlib.import_module("ggmoe.models")
    raise AttributeError(f"module 'ggmoe' has no attribute {name!r}")


def _engine_before_numpy() -> None:
    """On a CUDA build of llama-cpp-python, load its libraries before anything imports numpy.

    On a CUDA build (CUDA 13, driver 580, numpy 2.5), numpy and ggmoe's other imports loaded before libllama
    make llama.cpp segfault inside std::regex while it loads a model's vocabulary (a C++ runtime call bound
    into libggml-cuda); with ``import llama_cpp`` first, or with libstdc++ preloaded, every load runs. ``import llama_cpp`` maps libllama before it imports numpy itself.
    The check is a look at llama_cpp's lib folder: a CPU build, or no engine, costs nothing here.
    """
    if "llama_cpp" in sys.modules or "numpy" in sys.modules:
        return  # too late to choose the order (numpy first: see docs/engine.md, "CUDA builds")
    try:
        spec = importlib.util.find_spec("llama_cpp")
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        if not any(next((Path(d) / "lib").glob("libggml-cuda*"), None) for d in places):
            return
        import llama_cpp  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is reported where ggmoe loads the engine
        return


_engine_before_numpy()
