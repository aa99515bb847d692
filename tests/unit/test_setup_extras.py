"""``make setup`` installs the libraries tests/integrations needs and never leaves the engine replaced (issue 43)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _recipe(target: str) -> list[str]:
    """The commands of a Makefile target: its tab-indented lines up to the first line that is not one."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:")) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("\t")), len(lines))
    return [line.strip() for line in lines[start:end]]


def test_the_extras_hold_the_integration_libraries_and_the_engine_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = {re.split(r"[<>=\[;]", r)[0] for r in project["optional-dependencies"]["dev"]}
    assert {"langchain-community", "llama-index-llms-llama-cpp", "outlines", "numba"} <= dev
    assert any(re.fullmatch(r"llama-cpp-python(\[server\])?==[0-9.]+", d) for d in project["dependencies"])


def test_setup_installs_the_engine_again_after_the_extras():
    recipe = _recipe("setup")
    extras = next(i for i, cmd in enumerate(recipe) if "pip install" in cmd and ".[dev" in cmd)
    assert "build_engine.py --install" in recipe[-1] and len(recipe) - 1 > extras
