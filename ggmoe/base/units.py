"""Byte sizes on the command line: ``4GiB``, ``512MiB``, ``1.5GB``, ``123456``."""

from __future__ import annotations

import re
from decimal import Decimal

from ggmoe.base.errors import UsageError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 1 << 60  # 1 EiB: a larger size is a typo, not a machine


def parse_bytes(text: str) -> int:
    """A byte count from ``4GiB``, ``1.5GB`` or ``123456``; at most MAX_BYTES, computed exactly (no float to
    overflow: ``1`` and 400 zeros is an error line, not an OverflowError)."""
    m = _SIZE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        shown = text if not isinstance(text, str) or len(text) <= 40 else text[:37] + "..."
        raise UsageError(f"bad size {shown!r}: use a number with an optional unit like 512MiB, 4GiB or 1.5GB")
    size = Decimal(m.group(1)) * _UNITS[unit]  # exact: no float to overflow or round
    if size > MAX_BYTES:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise UsageError(f"size {shown!r} is larger than 1 EiB ({MAX_BYTES} bytes)")
    return int(size)


def format_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
