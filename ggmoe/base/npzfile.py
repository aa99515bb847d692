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

    def read(self, key: str, dtype: str | np.dtype, shape: tuple[int, ...] | None = None, *,
             ndim: int | None = None, max_bytes: int | None = None, finite: bool = False) -> np.ndarray:
        """Member ``key``; its header must declare ``dtype``, and ``shape`` or ``ndim`` dimensions when given.

        ``max_bytes`` bounds the data; ``finite`` refuses NaN and infinity in a float array.
        """
        info = self._info(key)
        try:
            with self.z.open(info) as f:
                got_dtype, got_shape, fortran, offset = self._header(f, key)
                if got_dtype != np.dtype(dtype):
                    raise self.fail(f"{key}: dtype {got_dtype}, expected {dtype}")
                if shape is not None and got_shape != shape:
                    raise self.fail(f"{key}: shape {got_shape}, expected {shape}")
                if ndim is not None and len(got_shape) != ndim:
                    raise self.fail(f"{key}: shape {got_shape}, expected {'a vector' if ndim == 1 else f'{ndim} dims'}")
                nbytes = int(np.prod(got_shape, dtype=np.float64)) * got_dtype.itemsize
                if max_bytes is not None and nbytes > max_bytes:
                    raise self.fail(f"{key}: {nbytes} bytes, more than the {max_bytes} allowed")
                if info.file_size != offset + nbytes:  # zipfile never yields more than file_size bytes
                    raise self.fail(f"{key}: the header declares {nbytes} data bytes, the member holds "
                                    f"{info.file_size - offset}")
                data = f.read(nbytes)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError, ValueError) as e:
            raise self.fail(f"{key}: cannot be read ({e})") from None
        if len(data) != nbytes:
            raise self.fail(f"{key}: truncated ({len(data)} of {nbytes} bytes)")
        a = np.frombuffer(data, dtype=got_dtype).reshape(got_shape, order="F" if fortran else "C").copy()
        if finite and a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise self.fail(f"{key}: contains NaN or infinity")
        return a

    def unexpected(self, expected: set[str]) -> list[str]:
        """Members other than ``expected``."""
        return sorted(set(self.infos) - expected)

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
            raise self.fail(f"array {key} cannot be read without pickle (dtype {dt})")
        return dt, tuple(int(n) for n in shape), bool(fortran), f.tell()
