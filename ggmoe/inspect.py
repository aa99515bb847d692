"""MoE facts from a GGUF file's header, without loading any weights.

`inspect_model(path)` parses the header (key/values and tensor infos) with a
bounded reader of its own: every count and length is checked against the
bytes left in the file before anything is read or allocated, so a truncated
or hostile file fails fast with `ModelFileError` instead of hanging or
exhausting memory (`gguf.GGUFReader` trusts the counts it reads).

Routed expert tensors are the `blk.{il}.ffn_*_exps.*` tensors (up, gate,
down, fused gate_up, plus their biases or scales where an architecture has
them): 3-D `[n_embd, n_ff_exp, n_expert]` in ggml order (2-D for biases),
one contiguous slice per expert in the outermost dimension. Everything else
(attention, norms, routers, shared experts `ffn_*_shexp`, embeddings) is
"dense". Split models (`*-00001-of-0000N.gguf`) are read shard by shard.
"""

from __future__ import annotations

import importlib.metadata
import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from ggmoe.errors import ModelFileError, UsageError

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
_INT_TYPES = frozenset({VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64})
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

# The part after "blk.{il}." of every routed-expert tensor gguf knows, e.g. "ffn_up_exps".
_BLK_PREFIX = "blk.{bid}."
EXPERT_TENSOR_BASES: frozenset[str] = frozenset(
    name.removeprefix(_BLK_PREFIX)
    for name in gguf.TENSOR_NAMES.values()
    if name.startswith(_BLK_PREFIX) and name.endswith("_exps")
)
_BLK_TENSOR = re.compile(r"^blk\.(\d+)\.([^.]+)\.(.+)$")  # il, base ("ffn_up_exps"), suffix ("weight")
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


# ---------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert tensor of one layer."""

    name: str  # full GGUF name, e.g. "blk.3.ffn_up_exps.weight"
    kind: str  # name without "blk.{il}.", e.g. "ffn_up_exps.weight"
    ggml_type: str  # gguf.GGMLQuantizationType name, e.g. "Q8_0"
    shape: tuple[int, ...]  # ggml ne, innermost first; shape[-1] == n_expert
    nbytes: int  # bytes of the whole tensor (all experts)
    bytes_per_expert: int  # bytes of one expert's slice = nbytes / n_expert
    file: str  # path of the file (shard) holding the data
    data_offset: int  # absolute offset of the tensor's data in `file`, bytes


@dataclass(frozen=True)
class MoeLayer:
    """The routed experts of layer `il`."""

    il: int
    tensors: tuple[ExpertTensor, ...]  # sorted by kind

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert of this layer, all its tensors together."""
        return sum(t.bytes_per_expert for t in self.tensors)

    def tensor(self, kind: str) -> ExpertTensor:
        """The tensor of this layer with the given kind, e.g. "ffn_up_exps.weight"."""
        for t in self.tensors:
            if t.kind == kind:
                return t
        raise KeyError(f"layer {self.il} has no expert tensor {kind!r}")


@dataclass(frozen=True)
class ModelFacts:
    """What ggmoe needs to know about a GGUF MoE model, read from its header."""

    path: str
    arch: str  # general.architecture, e.g. "qwen3moe"
    name: str  # general.name, or the file name without extension
    file_bytes: int  # size of the file(s), bytes
    n_layer: int
    n_expert: int
    n_expert_used: int  # top-k (the maximum over layers where it varies per layer)
    n_expert_shared: int  # always-active shared experts per MoE layer
    n_embd: int
    n_ff_exp: int  # width of one routed expert's FFN (elements)
    moe_layers: tuple[int, ...]  # il of layers with routed experts, ascending
    dense_layers: tuple[int, ...]  # il of the other layers, ascending
    layers: tuple[MoeLayer, ...]  # one per entry of moe_layers, same order
    expert_bytes: int  # bytes of all routed-expert tensors
    dense_bytes: int  # bytes of all other tensors
    n_tensors: int
    ggml_types: tuple[tuple[str, int], ...]  # (ggml type name, number of tensors of that type), by name

    def layer(self, il: int) -> MoeLayer:
        for layer in self.layers:
            if layer.il == il:
                return layer
        raise KeyError(f"layer {il} is not a MoE layer (MoE layers: {_ranges(self.moe_layers)})")

    def bytes_per_expert(self, il: int) -> int:
        """Bytes of one expert of MoE layer `il` (all its expert tensors)."""
        return self.layer(il).bytes_per_expert

    @property
    def expert_bytes_per_slot(self) -> int:
        """Bytes one more cache slot in every MoE layer costs: sum over MoE layers of bytes per expert."""
        return sum(layer.bytes_per_expert for layer in self.layers)

    def vram_bytes(self, n_slots_per_layer: int) -> int:
        """Weight bytes with all dense tensors plus `n_slots_per_layer` expert slots in every MoE layer.

        An estimate of weights only: it counts token_embd, which llama.cpp keeps in
        host memory, and leaves out the KV cache and compute buffers.
        """
        if not 0 <= n_slots_per_layer <= self.n_expert:
            raise UsageError(f"cache slots per layer must be in 0..{self.n_expert}, got {n_slots_per_layer}")
        return self.dense_bytes + n_slots_per_layer * self.expert_bytes_per_slot

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable form (lists for tuples, string keys)."""
        return {
            "path": self.path,
            "arch": self.arch,
            "name": self.name,
            "file_bytes": self.file_bytes,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "n_expert_shared": self.n_expert_shared,
            "n_embd": self.n_embd,
            "n_ff_exp": self.n_ff_exp,
            "moe_layers": list(self.moe_layers),
            "dense_layers": list(self.dense_layers),
            "n_tensors": self.n_tensors,
            "ggml_types": dict(self.ggml_types),
            "expert_bytes": self.expert_bytes,
            "dense_bytes": self.dense_bytes,
            "expert_bytes_per_slot": self.expert_bytes_per_slot,
            "vram_bytes": {
                "n_expert_used": self.vram_bytes(self.n_expert_used),
                "n_expert": self.vram_bytes(self.n_expert),
            },
            "layers": [
                {
                    "il": layer.il,
                    "bytes_per_expert": layer.bytes_per_expert,
                    "tensors": {
                        t.kind: {
                            "type": t.ggml_type,
                            "shape": list(t.shape),
                            "bytes_per_expert": t.bytes_per_expert,
                        }
                        for t in layer.tensors
                    },
                }
                for layer in self.layers
            ],
        }

    def render_text(self) -> str:
        """A human-readable summary; layers with identical expert tensors are grouped."""
        moe, dense = _ranges(self.moe_layers), _ranges(self.dense_layers) or "none"
        shared = f", {self.n_expert_shared} shared" if self.n_expert_shared else ""
        lines = [
            f"model        {self.name} ({self.arch})",
            f"file         {self.path} ({_size(self.file_bytes)}, {self.n_tensors} tensors)",
            f"layers       {self.n_layer} (MoE: {moe}; dense: {dense})",
            f"experts      {self.n_expert} per layer, top-{self.n_expert_used} per token{shared}",
            f"n_embd       {self.n_embd}",
            f"n_ff_exp     {self.n_ff_exp}",
            f"weights      experts {_size(self.expert_bytes)}, dense {_size(self.dense_bytes)}",
            "",
            "expert tensors (bytes per expert):",
        ]
        for ils, layer in _group_layers(self.layers):
            per_expert = f"{layer.bytes_per_expert:,} B ({_size(layer.bytes_per_expert)})"
            lines.append(f"  layers {_ranges(ils)}: {per_expert} per expert")
            for t in layer.tensors:
                shape = "x".join(str(n) for n in t.shape)
                lines.append(f"    {t.kind:<24} {t.ggml_type:<8} {shape:<16} {t.bytes_per_expert:>12,} B")
        lines += ["", "VRAM for weights (dense + slots per layer x bytes per expert):"]
        for n_slots in sorted(
            {self.n_expert_used, min(2 * self.n_expert_used, self.n_expert), self.n_expert}
        ):
            lines.append(f"  {n_slots:>4} slots/layer  {_size(self.vram_bytes(n_slots))}")
        return "\n".join(lines)


def _ranges(ils: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    parts: list[str] = []
    start = prev = None
    for il in [*ils, None]:
        if il is not None and prev is not None and il == prev + 1:
            prev = il
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = il
    return ", ".join(parts)


def _size(n: int) -> str:
    """Bytes in binary units, e.g. 4096 -> "4.0 KiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _group_layers(layers: tuple[MoeLayer, ...]) -> Iterator[tuple[tuple[int, ...], MoeLayer]]:
    """Layers whose expert tensors have the same kinds, types and shapes, with one representative."""
    groups: dict[tuple[tuple[str, str, tuple[int, ...]], ...], list[MoeLayer]] = {}
    for layer in layers:
        key = tuple((t.kind, t.ggml_type, t.shape) for t in layer.tensors)
        groups.setdefault(key, []).append(layer)
    for group in groups.values():
        yield tuple(layer.il for layer in group), group[0]


# ---------------------------------------------------------------------------
# Bounded GGUF header parser


@dataclass(frozen=True)
class _BigArray:
    """An array too long to keep (vocabulary, merges): its item type and length only."""

    item_type: VT
    count: int


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml ne, innermost first
    qtype: gguf.GGMLQuantizationType
    nbytes: int
    file: str
    data_offset: int  # absolute, bytes


@dataclass(frozen=True)
class _Header:
    kv: dict[str, Any]
    tensors: list[_TensorInfo]
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


def _read_array(cur: _Cursor, key: str) -> tuple[Any, ...] | _BigArray:
    item_type = _value_type(cur, key)
    if item_type is VT.ARRAY:
        raise ModelFileError(f"{cur.path}: unsupported GGUF file: key {key!r} is an array of arrays")
    if item_type is VT.STRING:
        n = cur.count(8, f"length of array {key!r}")
        if n <= _MAX_KEPT_ARRAY:
            return tuple(cur.string(f"item of {key!r}") for _ in range(n))
        for _ in range(n):
            cur.skip_string(f"item of {key!r}")
        return _BigArray(item_type, n)
    fmt = _SCALAR_FORMAT[item_type]
    item_bytes = struct.calcsize(fmt)
    n = cur.count(item_bytes, f"length of array {key!r}")
    if n > _MAX_KEPT_ARRAY:
        cur.skip(n * item_bytes, f"array {key!r}")
        return _BigArray(item_type, n)
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


def _read_tensors(cur: _Cursor, n_tensors: int, kv: dict[str, Any]) -> list[_TensorInfo]:
    raw = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    align = _alignment(cur, kv)
    data_start = -(-cur.pos // align) * align
    tensors: list[_TensorInfo] = []
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
        tensors.append(_TensorInfo(name, shape, qtype, nbytes, str(cur.path), data_start + offset))
    return tensors


def _open_checked(path: Path) -> int:
    """The file's size; ModelFileError for anything that is not a readable regular file."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise ModelFileError(f"{path}: not a GGUF file (only {size} bytes)")
    return size


def _parse_buffer(cur: _Cursor) -> _Header:
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
    return _Header(kv, _read_tensors(cur, n_tensors, kv), cur.size)


def _parse_file(path: Path) -> _Header:
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


def _read_model(path: Path) -> _Header:
    first = _parse_file(path)
    count = _split_count(first.kv)
    if count == 1:
        return first
    tensors: list[_TensorInfo] = []
    file_bytes = 0
    for shard in _shard_paths(path, count):
        header = first if shard == path else _parse_file(shard)
        tensors += header.tensors
        file_bytes += header.file_bytes
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ModelFileError(f"{path}: corrupt split GGUF: a tensor appears in more than one shard")
    return _Header(first.kv, tensors, file_bytes)


# ---------------------------------------------------------------------------
# Facts


def _int_key(path: Path, kv: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer hparam; per-layer arrays give their maximum."""
    if key not in kv:
        if default is None:
            raise ModelFileError(f"{path}: missing key {key}")
        return default
    value = kv[key]
    if isinstance(value, tuple) and value and all(type(v) is int for v in value):
        return max(value)
    if type(value) is not int:
        raise ModelFileError(f"{path}: key {key} is not an integer: {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expert_tensor(path: Path, t: _TensorInfo, kind: str, n_expert: int) -> ExpertTensor:
    if not t.shape or t.shape[-1] != n_expert:
        raise ModelFileError(
            f"{path}: expert tensor {t.name!r} has shape {list(t.shape)}, expected {n_expert} experts in its last dimension"
        )
    return ExpertTensor(
        name=t.name,
        kind=kind,
        ggml_type=t.qtype.name,
        shape=t.shape,
        nbytes=t.nbytes,
        bytes_per_expert=t.nbytes // n_expert,
        file=t.file,
        data_offset=t.data_offset,
    )


def _moe_layers(path: Path, tensors: list[_TensorInfo], n_layer: int, n_expert: int) -> tuple[MoeLayer, ...]:
    by_layer: dict[int, list[ExpertTensor]] = {}
    for t in tensors:
        m = _BLK_TENSOR.match(t.name)
        if m is None or m[2] not in EXPERT_TENSOR_BASES:
            continue
        il = int(m[1])
        if il >= n_layer:
            raise ModelFileError(f"{path}: expert tensor {t.name!r} is beyond block_count {n_layer}")
        by_layer.setdefault(il, []).append(_expert_tensor(path, t, f"{m[2]}.{m[3]}", n_expert))
    return tuple(MoeLayer(il, tuple(sorted(ts, key=lambda t: t.kind))) for il, ts in sorted(by_layer.items()))


def _n_ff_exp(path: Path, kv: dict[str, Any], arch: str, first: MoeLayer) -> int:
    """Expert FFN width from the first MoE layer's tensors, else from the hparam key."""
    kinds = {t.kind: t for t in first.tensors}
    if "ffn_up_exps.weight" in kinds:
        return kinds["ffn_up_exps.weight"].shape[1]
    if "ffn_gate_up_exps.weight" in kinds:
        return kinds["ffn_gate_up_exps.weight"].shape[1] // 2  # gate and up stacked
    if "ffn_down_exps.weight" in kinds:
        return kinds["ffn_down_exps.weight"].shape[0]
    return _int_key(path, kv, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch))


def _facts(path: Path, header: _Header) -> ModelFacts:
    kv = header.kv
    arch = kv.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{path}: not a llama.cpp model: no {Keys.General.ARCHITECTURE}")
    n_expert = _int_key(path, kv, Keys.LLM.EXPERT_COUNT.format(arch=arch), default=0)
    if n_expert <= 0:
        raise ModelFileError(f"{path}: not a Mixture-of-Experts model ({arch} with no experts)")
    n_layer = _int_key(path, kv, Keys.LLM.BLOCK_COUNT.format(arch=arch))
    n_expert_used = _int_key(path, kv, Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))
    if not 0 < n_expert_used <= n_expert:
        raise ModelFileError(f"{path}: expert_used_count {n_expert_used} is not in 1..{n_expert}")
    layers = _moe_layers(path, header.tensors, n_layer, n_expert)
    if not layers:
        raise ModelFileError(f"{path}: declares {n_expert} experts but has no expert tensors (ffn_*_exps)")
    has_shexp = any("_shexp." in t.name for t in header.tensors)
    n_expert_shared = _int_key(
        path, kv, Keys.LLM.EXPERT_SHARED_COUNT.format(arch=arch), default=int(has_shexp)
    )
    moe_layers = tuple(layer.il for layer in layers)
    expert_bytes = sum(t.nbytes for layer in layers for t in layer.tensors)
    total_bytes = sum(t.nbytes for t in header.tensors)
    types: dict[str, int] = {}
    for t in header.tensors:
        types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
    name = kv.get(Keys.General.NAME)
    return ModelFacts(
        path=str(path),
        arch=arch,
        name=name if isinstance(name, str) and name else path.stem,
        file_bytes=header.file_bytes,
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_expert_shared=n_expert_shared,
        n_embd=_int_key(path, kv, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch)),
        n_ff_exp=_n_ff_exp(path, kv, arch, layers[0]),
        moe_layers=moe_layers,
        dense_layers=tuple(sorted(set(range(n_layer)) - set(moe_layers))),
        layers=layers,
        expert_bytes=expert_bytes,
        dense_bytes=total_bytes - expert_bytes,
        n_tensors=len(header.tensors),
        ggml_types=tuple(sorted(types.items())),
    )


def inspect_model(path: str | os.PathLike[str]) -> ModelFacts:
    """MoE facts of the GGUF model at `path`, read from its header only.

    Raises ModelFileError (one-line message) for a missing, unreadable,
    truncated, corrupt or non-MoE file.
    """
    p = Path(path)
    return _facts(p, _read_model(p))
