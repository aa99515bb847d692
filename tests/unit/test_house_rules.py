"""The house rules the code review used to check by eye: small functions (at most 60 lines, docstring and
comments included) in every module of ``ggmoe`` and every script under ``tools``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# The scripts under tools/ are read and changed as often as the package, so the same limit holds there.
CHECKED = (REPO / "ggmoe", REPO / "tools")
MAX_LINES = 60


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > limit]


def test_the_counter_finds_a_long_function():
    planted = "def long():\n" + "    x = 1\n" * MAX_LINES + "\nasync def short():\n    pass\n"
    assert long_functions(planted) == [("long", MAX_LINES + 1)]


def test_no_function_is_over_60_lines():
    found = {f"{p.relative_to(REPO)}:{name}": n for top in CHECKED for p in sorted(top.rglob("*.py"))
             for name, n in long_functions(p.read_text())}
    assert found == {}
