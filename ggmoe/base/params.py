"""Declared options of policies and predictors: a name, a kind, bounds; checked once, at the edge.

A policy or predictor declares its keyword options next to its code::

    PARAMS = (Param("capacity", int, low=1, high=MAX_COLLECTION, help="EAMs kept"),
              Param("online", bool))

``check_params`` is the one check: it takes what a user gave (text from ``--opt KEY=VALUE``, or Python
values from ``policy_options``, a plan file, ``ggmoe.load()``), converts text to the declared kind, and
refuses an unknown name, a wrong type, a value out of bounds or not finite, with one UsageError line.
Sizes have an upper bound, so that nothing allocates from an unchecked number. ``internal`` options
(arrays, objects, counts that ggmoe itself passes) take any value of the declared Python type and
cannot be set from text.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggmoe.base.errors import UsageError

MAX_COLLECTION = 1 << 16  # entries of a predictor's collection (EAMs, expert maps): a bound on its memory
MAX_WINDOW = 1 << 16  # calls a windowed policy remembers
MAX_STATE_BYTES = 4 << 30  # what one predictor's or policy's arrays may take (bytes), checked before allocating


@dataclass(frozen=True)
class Param:
    """One keyword option: its name, kind (int, float, bool, str, Path, or a type for ``internal`` values)."""

    name: str
    kind: type
    low: float | None = None  # inclusive unless low_open
    high: float | None = None  # inclusive unless high_open
    low_open: bool = False
    high_open: bool = False
    internal: bool = False  # passed by ggmoe itself (counts, arrays, objects); never from text
    help: str = ""

    def describe(self) -> str:
        """``capacity (int in [1, 65536])``: what a message lists."""
        if self.kind in (int, float) and (self.low is not None or self.high is not None):
            lo = "(" if self.low_open else "["
            hi = ")" if self.high_open else "]"
            low = "-inf" if self.low is None else _num(self.low)
            high = "inf" if self.high is None else _num(self.high)
            return f"{self.name} ({self.kind.__name__} in {lo}{low}, {high}{hi})"
        return f"{self.name} ({self.kind.__name__})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def parse_pairs(pairs: Iterable[str], flag: str = "--opt") -> dict[str, str]:
    """``KEY=VALUE`` pairs as text (dashes in keys become underscores); UsageError for a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(f"{flag} {pair!r}: expected KEY=VALUE, e.g. capacity=512")
        if key in out:
            raise UsageError(f"{flag} {key} is given twice")
        out[key] = value
    return out


def _from_text(p: Param, owner: str, text: str) -> Any:
    t = text.strip()
    if p.kind is bool:
        low = t.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"{owner}: option {p.name}={text!r} is not true or false")
    if p.kind is int:
        try:
            return int(t, 10)
        except ValueError:
            raise UsageError(f"{owner}: option {p.name}={text!r} is not an integer") from None
    if p.kind is float:
        try:
            return float(t)
        except ValueError:
            raise UsageError(f"{owner}: option {p.name}={text!r} is not a number") from None
    if p.kind in (str, Path):
        if not t:
            raise UsageError(f"{owner}: option {p.name} is empty")
        return t
    raise UsageError(f"{owner}: option {p.name} cannot be given as text")


def check_value(p: Param, owner: str, value: Any) -> Any:
    """``value`` if it is of ``p``'s kind and within its bounds (an int is taken where a float is declared)."""
    if p.kind is bool:
        ok = isinstance(value, bool)
    elif p.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif p.kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif p.kind is Path:  # a file name: text or a path object, never empty
        ok = isinstance(value, str | os.PathLike)
        if ok and not str(value):
            raise UsageError(f"{owner}: option {p.name} is empty")
    else:
        ok = isinstance(value, p.kind)
    if not ok:
        raise UsageError(f"{owner}: option {p.name} must be {'a' if p.kind is not int else 'an'} "
                         f"{p.kind.__name__}, not {_short(value)}")
    if p.kind in (int, float):
        if p.kind is float and not math.isfinite(value):
            raise UsageError(f"{owner}: option {p.name}={value!r} is not a finite number")
        below = p.low is not None and (value <= p.low if p.low_open else value < p.low)
        above = p.high is not None and (value >= p.high if p.high_open else value > p.high)
        if below or above:
            raise UsageError(f"{owner}: option {p.name}={_short(value)} is out of bounds: {p.describe()}")
    if p.kind is str and not value:
        raise UsageError(f"{owner}: option {p.name} is empty")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_state_bytes(owner: str, nbytes: int, hint: str) -> None:
    """Refuse, before allocating, state arrays over MAX_STATE_BYTES (``hint`` says which option to lower)."""
    if nbytes > MAX_STATE_BYTES:
        raise UsageError(f"{owner}: its arrays would take {nbytes / 2**30:.1f} GiB (at most "
                         f"{MAX_STATE_BYTES >> 30} GiB); {hint}")


def check_params(owner: str, params: Iterable[Param], given: Mapping[str, Any] | None,
                 from_text: bool = False, external: bool | None = None) -> dict[str, Any]:
    """The options ``given`` checked against the declared ``params``: converted (text) and validated.

    ``owner`` names who takes them in messages (``predictor 'eam'``). Unknown names are refused with the
    list of known ones; with ``from_text`` every value is text. ``external`` (default: ``from_text``)
    refuses internal options: what a user wrote (``--opt``, a plan file) cannot set them.
    """
    external = from_text if external is None else external
    declared = {p.name: p for p in params}
    out: dict[str, Any] = {}
    for key, value in (given or {}).items():
        p = declared.get(key) if isinstance(key, str) else None
        if p is None or (external and p.internal):
            known = [q.describe() for q in declared.values() if not (external and q.internal)]
            raise UsageError(f"{owner}: unknown option {key!r}; "
                             + (f"it takes {', '.join(known)}" if known else "it takes no options"))
        if from_text:
            value = _from_text(p, owner, value)
        out[key] = check_value(p, owner, value)
    return out
