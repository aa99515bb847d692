"""Reading ``.npz`` files ggmoe did not write (traces, predictors) without trusting them.

Each member's ``.npy`` header is read first and checked (dtype, shape, declared
bytes against the member's real size) before any data is read, so a file whose
header declares a huge array is refused instead of exhausting memory, and a
``.npy`` renamed ``.npz`` or a zip of something else gets one clear message.
Never unpickles.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

Fail = Callable[[str], Exception]  # builds the caller's error from a message


class NpzMembers:
    """The ``.npy`` members of an ``.npz``; open with ``with NpzMembers(path, fail) as m:``."""

    def __init__(self, path: str | Path, fail: Fail) -> None:
        self.path, self.fail = Path(path), fail
        try:
            self.z = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise fail(f"not a readable .npz file ({e})") from None
        self.infos: dict[str, zipfile.ZipInfo] = {}
        for info in self.z.infolist():
            key = info.filename.removesuffix(".npy")
            if key in self.infos or info.is_dir() or not info.filename.endswith(".npy"):
                self.z.close()
                raise fail(f"unexpected zip member {info.filename!r}")
            self.infos[key] = info

    def __enter__(self) -> NpzMembers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.z.close()

    @property
    def names(self) -> set[str]:
        return set(self.infos)

    def header(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) that member ``key`` declares, without reading its data."""
        info = self._info(key)
        with self.z.open(info) as f:
            dtype, shape, _, _ = self._header(f, key)
        return dtype, shape

    def read(self, key: str, dtype: str | np.dtype, ndim: int | None = None) -> np.ndarray:
        """Member ``key`` as an array; its header must declare ``dtype`` (and ``ndim`` dimensions)."""
        info = self._info(key)
        try:
            with self.z.open(info) as f:
                got_dtype, shape, fortran, offset = self._header(f, key)
                if got_dtype != np.dtype(dtype):
                    raise self.fail(f"{key}: dtype {got_dtype}, expected {np.dtype(dtype)}")
                if ndim is not None and len(shape) != ndim:
                    raise self.fail(f"{key}: shape {shape}, expected {ndim} dimensions")
                nbytes = int(np.prod(shape, dtype=np.float64)) * got_dtype.itemsize
                if info.file_size != offset + nbytes:
                    raise self.fail(f"{key}: the header declares {nbytes} data bytes, the member holds "
                                    f"{info.file_size - offset}")
                data = f.read(nbytes)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise self.fail(f"{key}: cannot be read ({e})") from None
        if len(data) != nbytes:
            raise self.fail(f"{key}: truncated ({len(data)} of {nbytes} bytes)")
        return np.frombuffer(data, dtype=got_dtype).reshape(shape, order="F" if fortran else "C").copy()

    def _info(self, key: str) -> zipfile.ZipInfo:
        info = self.infos.get(key)
        if info is None:
            raise self.fail(f"missing array {key}")
        return info

    def _header(self, f: io.BufferedIOBase, key: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version} is not supported")
        except (ValueError, TypeError, SyntaxError, OverflowError, EOFError, zipfile.BadZipFile) as e:
            raise self.fail(f"{key}: not a valid .npy array ({e})") from None
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise self.fail(f"{key}: dtype {dt} cannot be read without pickle")
        return dt, tuple(int(n) for n in shape), bool(fortran), f.tell()
