"""A bounded GGUF header reader: the one reader ggmoe uses for files it did not write.

Every count and length is checked against the bytes left in the file before
anything is read or allocated, so a truncated or hostile file fails fast with
``ModelFileError`` instead of hanging or exhausting memory (``gguf.GGUFReader``
trusts the counts it reads). Split models (``*-00001-of-0000N.gguf``) are read
shard by shard. Tensor data is never read here; ``tensor_data`` maps one
tensor's bytes after the header has proved they lie inside the file.
"""

from __future__ import annotations

import importlib.metadata
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from ggmoe.base.errors import ModelFileError

VT = gguf.GGUFValueType
Keys = gguf.Keys

# Little-endian struct formats of GGUF's fixed-size value types.
_SCALAR_FORMAT: dict[VT, str] = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<B",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSION = importlib.metadata.version("gguf")  # named in "unknown ggml type" errors
_SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts; llama.cpp dropped it too
_HEADER_BYTES = 24  # magic u32, version u32, n_tensors u64, n_kv u64
_MIN_KV_BYTES = 8 + 4 + 1  # key length u64, value type u32, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length u64, n_dims u32, type u32, offset u64
_MAX_DIMS = 4  # GGML_MAX_DIMS
_INT64_MAX = 2**63 - 1
# Arrays up to this many items are kept (per-layer hparams); longer ones (the
# vocabulary, merges) are skipped and only their length is kept.
_MAX_KEPT_ARRAY = 4096
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class BigArray:
    """An array too long to keep (vocabulary, merges): its item type and length only."""

    item_type: VT
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml ne, innermost first
    qtype: gguf.GGMLQuantizationType
    nbytes: int
    file: str
    data_offset: int  # absolute, bytes


@dataclass(frozen=True)
class Header:
    kv: dict[str, Any]
    tensors: list[TensorInfo]
    file_bytes: int


class _Cursor:
    """Little-endian reads from a buffer, each checked against the bytes left."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelFileError(
                f"{self.path}: truncated or corrupt GGUF file: {what} needs {n} bytes at offset {self.pos}, "
                f"only {self.size - self.pos} left"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        self.skip(self.u64(f"length of {what}"), what)

    def count(self, min_item_bytes: int, what: str) -> int:
        """A u64 item count, rejected when even the smallest items could not fit in the bytes left."""
        n = self.u64(what)
        if n * min_item_bytes > self.size - self.pos:
            raise ModelFileError(
                f"{self.path}: corrupt GGUF file: {what} is {n}, more than the "
                f"{self.size - self.pos} bytes left could hold"
            )
        return n


def _value_type(cur: _Cursor, key: str) -> VT:
    raw = cur.u32(f"type of key {key!r}")
    try:
        return VT(raw)
    except ValueError:
        raise ModelFileError(
            f"{cur.path}: corrupt GGUF file: key {key!r} has unknown value type {raw}"
        ) from None


def _read_value(cur: _Cursor, vtype: VT, key: str) -> Any:
    if vtype is VT.STRING:
        return cur.string(f"value of key {key!r}")
    if vtype is VT.ARRAY:
        return _read_array(cur, key)
    value = cur.scalar(_SCALAR_FORMAT[vtype], f"value of key {key!r}")
    return bool(value) if vtype is VT.BOOL else value


def _read_array(cur: _Cursor, key: str) -> tuple[Any, ...] | BigArray:
    item_type = _value_type(cur, key)
    if item_type is VT.ARRAY:
        raise ModelFileError(f"{cur.path}: unsupported GGUF file: key {key!r} is an array of arrays")
    if item_type is VT.STRING:
        n = cur.count(8, f"length of array {key!r}")
        if n <= _MAX_KEPT_ARRAY:
            return tuple(cur.string(f"item of {key!r}") for _ in range(n))
        for _ in range(n):
            cur.skip_string(f"item of {key!r}")
        return BigArray(item_type, n)
    fmt = _SCALAR_FORMAT[item_type]
    item_bytes = struct.calcsize(fmt)
    n = cur.count(item_bytes, f"length of array {key!r}")
    if n > _MAX_KEPT_ARRAY:
        cur.skip(n * item_bytes, f"array {key!r}")
        return BigArray(item_type, n)
    values = struct.unpack_from(f"<{n}{fmt[1:]}", cur.buf, cur.pos)
    cur.pos += n * item_bytes
    return tuple(bool(v) for v in values) if item_type is VT.BOOL else values


def _read_kv(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    kv: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key #{i}")
        if key in kv:
            raise ModelFileError(f"{cur.path}: corrupt GGUF file: duplicate key {key!r}")
        kv[key] = _read_value(cur, _value_type(cur, key), key)
    return kv


def _tensor_nbytes(cur: _Cursor, name: str, shape: tuple[int, ...], raw_type: int) -> tuple[int, Any]:
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFileError(
            f"{cur.path}: unsupported GGUF file: tensor {name!r} has ggml type {raw_type}, "
            f"unknown to gguf {_GGUF_VERSION}"
        ) from None
    n_elements = math.prod(shape)
    if any(n > _INT64_MAX for n in shape) or n_elements > _INT64_MAX:
        raise ModelFileError(
            f"{cur.path}: corrupt GGUF file: tensor {name!r} shape {list(shape)} overflows int64"
        )
    if shape and shape[0] % block_size:
        raise ModelFileError(
            f"{cur.path}: corrupt GGUF file: tensor {name!r} row of {shape[0]} elements is not a multiple "
            f"of the {qtype.name} block size {block_size}"
        )
    return n_elements // block_size * type_size, qtype


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], Any, int, int]:
    """(name, shape, qtype, nbytes, offset relative to the data section)."""
    name = cur.string(f"name of tensor #{i}")
    n_dims = cur.u32(f"n_dims of tensor {name!r}")
    if n_dims > _MAX_DIMS:
        raise ModelFileError(
            f"{cur.path}: corrupt GGUF file: tensor {name!r} has {n_dims} dimensions (max 4)"
        )
    shape = tuple(cur.u64(f"shape of tensor {name!r}") for _ in range(n_dims))
    raw_type = cur.u32(f"type of tensor {name!r}")
    offset = cur.u64(f"data offset of tensor {name!r}")
    nbytes, qtype = _tensor_nbytes(cur, name, shape, raw_type)
    return name, shape, qtype, nbytes, offset


def _alignment(cur: _Cursor, kv: dict[str, Any]) -> int:
    align = kv.get(Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise ModelFileError(
            f"{cur.path}: corrupt GGUF file: {Keys.General.ALIGNMENT} {align!r} is not a power of 2"
        )
    return align


def _read_tensors(cur: _Cursor, n_tensors: int, kv: dict[str, Any]) -> list[TensorInfo]:
    raw = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    align = _alignment(cur, kv)
    data_start = -(-cur.pos // align) * align
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, shape, qtype, nbytes, offset in raw:
        if name in seen:
            raise ModelFileError(f"{cur.path}: corrupt GGUF file: duplicate tensor {name!r}")
        seen.add(name)
        if offset % align:
            raise ModelFileError(
                f"{cur.path}: corrupt GGUF file: tensor {name!r} data offset {offset} is not aligned to {align}"
            )
        if data_start + offset + nbytes > cur.size:
            raise ModelFileError(
                f"{cur.path}: truncated or corrupt GGUF file: tensor {name!r} data ({nbytes} bytes at "
                f"offset {data_start + offset}) ends beyond the end of the file ({cur.size} bytes)"
            )
        tensors.append(TensorInfo(name, shape, qtype, nbytes, str(cur.path), data_start + offset))
    return tensors


def _open_checked(path: Path) -> int:
    """The file's size; ModelFileError for anything that is not a readable regular file."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file (model file not found)")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise ModelFileError(f"{path}: not a GGUF file (only {size} bytes)")
    return size


def _parse_buffer(cur: _Cursor) -> Header:
    cur.need(_HEADER_BYTES, "GGUF header")
    if cur.buf[0:4] != _GGUF_MAGIC:
        raise ModelFileError(f"{cur.path}: not a GGUF file (bad magic {bytes(cur.buf[0:4])!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version not in _SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise ModelFileError(f"{cur.path}: big-endian GGUF files are not supported")
        raise ModelFileError(f"{cur.path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.count(_MIN_TENSOR_INFO_BYTES, "tensor count")
    n_kv = cur.count(_MIN_KV_BYTES, "key/value count")
    kv = _read_kv(cur, n_kv)
    return Header(kv, _read_tensors(cur, n_tensors, kv), cur.size)


def _parse_file(path: Path) -> Header:
    size = _open_checked(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_buffer(_Cursor(buf, min(size, len(buf)), path))
    except ModelFileError:
        raise
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read: {e.strerror or e}") from None
    except Exception as e:  # a parser bug must still reach the user as a bad-file message
        raise ModelFileError(f"{path}: cannot parse GGUF header: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------
# Split models


def _split_count(kv: dict[str, Any]) -> int:
    count = kv.get(Keys.Split.LLM_KV_SPLIT_COUNT, 1)
    return count if isinstance(count, int) and count > 1 else 1


def _shard_paths(path: Path, count: int) -> list[Path]:
    """Paths of all shards of a split model, named as llama.cpp's llama_split_path names them."""
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ModelFileError(
            f"{path}: split GGUF with {count} shards, but the name is not '<prefix>-NNNNN-of-NNNNN.gguf'"
        )
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_header(path: Path) -> Header:
    first = _parse_file(path)
    count = _split_count(first.kv)
    if count == 1:
        return first
    tensors: list[TensorInfo] = []
    file_bytes = 0
    for shard in _shard_paths(path, count):
        header = first if shard == path else _parse_file(shard)
        tensors += header.tensors
        file_bytes += header.file_bytes
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ModelFileError(f"{path}: corrupt split GGUF: a tensor appears in more than one shard")
    return Header(first.kv, tensors, file_bytes)


