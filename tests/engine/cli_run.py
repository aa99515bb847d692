"""The ``ggmoe`` command as a user runs it, for the engine tier's end-to-end tests."""

from __future__ import annotations

import subprocess
import sys


def ggmoe(*args: str, ok: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m ggmoe ARGS``; with ``ok``, assert it succeeded (stderr in the message)."""
    r = subprocess.run([sys.executable, "-m", "ggmoe", *args], capture_output=True, text=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stderr
    return r
