"""Small TOML files ggmoe reads (hardware profiles, plan files): bounded, decoded, one clear error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ggmoe.base.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_toml(path: Path, label: str, what: str, max_bytes: int = 1 << 20) -> dict[str, Any]:
    """The table of a TOML file; UsageError "``label``: ..." when it is too large or not TOML."""
    if path.stat().st_size > max_bytes:
        raise UsageError(f"{label}: too large for {what}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise UsageError(f"{label}: not a valid TOML {what} ({e})") from None
