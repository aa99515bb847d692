"""The package's import graph: no cycles, no training side, ctypes only under ggmoe/engine/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "ggmoe"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("ggmoe", *path.relative_to(ROOT).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of ggmoe (and top-level foreign names) that ``name`` imports, at any depth of its code."""
    out: set[str] = set()
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in mods else base)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(m, p, mods) if i in mods and i != m} for m, p in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            # a package's __init__ importing its own submodules is how registration works; a submodule
            # importing a sibling through the package is not followed back into that __init__
            if m.startswith(n + "."):
                continue
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"ggmoe.a": {"ggmoe.b"}, "ggmoe.b": {"ggmoe.c"}, "ggmoe.c": {"ggmoe.a"}, "ggmoe.d": set()}
    assert _find_cycle(graph) == ["ggmoe.a", "ggmoe.b", "ggmoe.c", "ggmoe.a"]
    assert _find_cycle({"ggmoe.a": {"ggmoe.b"}, "ggmoe.b": set()}) is None


def test_runtime_never_imports_the_training_side():
    mods = _modules()
    bad = sorted(f"{m} imports {i}" for m, p in mods.items() for i in _imports(m, p, mods)
                 if i.split(".")[0] in ("torch", "predictors"))
    assert bad == []


def test_ctypes_only_in_the_engine():
    mods = _modules()
    bad = sorted(m for m, p in mods.items() if "ctypes" in {i.split(".")[0] for i in _imports(m, p, mods)}
                 and not m.startswith("ggmoe.engine"))
    assert bad == []


# The packages from the bottom up (docs/architecture.md): a module may import its own package and those
# below it, never one above, with no exemption for any module (recording, which needs the engine, lives in
# it: ``engine.record``); the root package ``ggmoe`` (its version, the lazy ``load``) is a facade any module
# may import.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("base", "models"),
    ("inspect",),
    ("trace",),
    ("cache",),
    ("predict",),
    ("control",),
    ("engine",),
    ("simulate",),
    ("serve",),
    ("integrations",),
    ("cli", "__main__"),
)


def _layer_of(module: str) -> int | None:
    """Index in LAYERS of a ggmoe module's package (None: the root facade)."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    for i, names in enumerate(LAYERS):
        if parts[0] in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and docs/architecture.md)")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        lm = _layer_of(m)
        for d in deps:
            ld = _layer_of(d)
            if lm is not None and ld is not None and ld > lm:
                bad.append(f"{m} imports {d} (layer {LAYERS[ld][0]} is above {LAYERS[lm][0]})")
    return sorted(bad)


def test_packages_import_only_downward():
    assert _upward(_graph()) == []


def test_upward_finder_finds_a_planted_upward_import():
    graph = {"ggmoe.cache.cache": {"ggmoe.predict.base", "ggmoe.base.errors"}, "ggmoe.predict.base": {"ggmoe.cache"},
             "ggmoe.base.errors": set(), "ggmoe.cache": set()}
    assert _upward(graph) == ["ggmoe.cache.cache imports ggmoe.predict.base (layer predict is above cache)"]


# The house as a whole: a room is a top-level module or package of ggmoe, an arrow is one room importing
# another, a floor is a room's height (one above the highest room it imports). At most 14 rooms, 9 floors and
# 48 arrows (what the package is today), and the rooms form no cycle (no arrow back up).
MAX_ROOMS, MAX_FLOORS, MAX_ARROWS = 14, 9, 48


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """room -> the rooms it imports (``ggmoe``: the root facade)."""
    def room(m: str) -> str:
        return m.split(".")[1] if "." in m else m
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m))
    return out


def _floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    assert _find_cycle(rooms) is None, f"the rooms import each other: {_find_cycle(rooms)}"
    floors: dict[str, int] = {}

    def floor(r: str) -> int:
        if r not in floors:
            floors[r] = 1 + max((floor(d) for d in rooms[r]), default=0)
        return floors[r]

    for r in rooms:
        floor(r)
    return floors


def test_the_house_stays_small():
    rooms = _rooms(_graph())
    floors = _floors(rooms)
    n_arrows = sum(len(v) for v in rooms.values())
    assert len(rooms) <= MAX_ROOMS and max(floors.values()) <= MAX_FLOORS and n_arrows <= MAX_ARROWS, \
        f"{len(rooms)} rooms, {max(floors.values())} floors, {n_arrows} arrows: {sorted(floors.items(), key=str)}"


def test_house_measures_a_planted_house():
    graph = {"ggmoe.base.errors": set(), "ggmoe.cache.cache": {"ggmoe.base.errors"},
             "ggmoe.cache.slots": {"ggmoe.cache.cache"}, "ggmoe.engine.x": {"ggmoe.cache.slots", "ggmoe.base.errors"}}
    rooms = _rooms(graph)
    assert rooms == {"base": set(), "cache": {"base"}, "engine": {"cache", "base"}}
    assert _floors(rooms) == {"base": 1, "cache": 2, "engine": 3}
    with pytest.raises(AssertionError, match="import each other"):
        _floors({"a": {"b"}, "b": {"a"}})
