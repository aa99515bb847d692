#!/usr/bin/env python3
"""``make engine``: the patched engine build from a clone, before ggmoe is installed.

The build itself is ``ggmoe/base/engine_build.py`` (standard library only, shipped in
the package as ``ggmoe engine build``); this script runs that file without
importing the ``ggmoe`` package, and as a module (``from tools import build_engine``)
is that file's module.

Usage:
    python tools/build_engine.py [--install] [--cuda] [--rebuild] [--check-patches]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_FILE = Path(__file__).resolve().parent.parent / "ggmoe" / "base" / "engine_build.py"
_NAME = "tools.build_engine"
_spec = importlib.util.spec_from_file_location(_NAME, _FILE)
_module = importlib.util.module_from_spec(_spec)
sys.modules[_NAME] = _module  # `from tools import build_engine` gets the build module itself
_spec.loader.exec_module(_module)

if __name__ == "__main__":
    sys.exit(_module.main())
