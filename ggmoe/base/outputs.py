"""Output files: checked before any work starts, written atomically.

``check_output`` runs first, so that a run is never lost to a bad ``-o``: the
parent must be a directory (or creatable as one), the target must not be a
directory, a device, a FIFO or a socket. ``atomic_write`` writes a temporary
file in the same directory and renames it over the target, so that a crash or
Ctrl-C never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ggmoe.base.errors import UsageError


def _describe(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _check_parent(path: Path, what: str) -> None:
    """The nearest existing ancestor must be a writable directory (missing ones are created later)."""
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: cannot write in {parent}")


def check_output(path: str | os.PathLike[str], what: str = "output", suffixes: tuple[str, ...] = ()) -> Path:
    """Fail now, before any work, if ``path`` cannot be written as a regular file."""
    p = Path(path)
    if suffixes and p.suffix.lower() not in suffixes:
        raise UsageError(f"{what} {p}: the name must end in {' or '.join(suffixes)}")
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UsageError(f"{what} {p}: {e.strerror}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {p} is {_describe(st.st_mode)}; give a file name")
    if st is not None and not os.access(p, os.W_OK):
        raise UsageError(f"{what} {p}: not writable")
    _check_parent(p, what)
    return p


def check_output_dir(path: str | os.PathLike[str], what: str = "output directory",
                     members: tuple[str, ...] = ()) -> Path:
    """Fail now if ``path`` cannot be (or become) a directory holding the files ``members``."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} {p} exists and is not a directory")
    if not p.exists():
        _check_parent(p / "x", what)
    for name in members:
        check_output(p / name, what=f"{what} member")
    return p


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Write ``path`` through a temporary file in its directory, renamed over it only on success."""
    p = check_output(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    with atomic_write(path, "w") as f:
        f.write(text)
    return Path(path)
