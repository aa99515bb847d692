"""The house rules the code review used to check by eye: small functions (at most 60 lines, docstring and
comments included) in every module of ``ggmoe``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "ggmoe"
MAX_LINES = 60


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > limit]


def test_the_counter_finds_a_long_function():
    planted = "def long():\n" + "    x = 1\n" * MAX_LINES + "\nasync def short():\n    pass\n"
    assert long_functions(planted) == [("long", MAX_LINES + 1)]


def test_no_function_is_over_60_lines():
    found = {f"{p.relative_to(ROOT.parent)}:{name}": n for p in sorted(ROOT.rglob("*.py"))
             for name, n in long_functions(p.read_text())}
    assert found == {}
