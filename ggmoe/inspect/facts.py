"""MoE facts from a GGUF file's header, without loading any weights.

`inspect_model(path)` parses the header (key/values and tensor infos) with a
bounded reader (``ggmoe.inspect.reader``) and checks the MoE hyperparameters
against the tensors, so that llama.cpp never sees a header it would abort on.

Routed expert tensors are the `blk.{il}.ffn_*_exps.*` tensors (up, gate,
down, fused gate_up, plus their biases or scales where an architecture has
them): 3-D `[n_embd, n_ff_exp, n_expert]` in ggml order (2-D for biases),
one contiguous slice per expert in the outermost dimension. Everything else
(attention, norms, routers, shared experts `ffn_*_shexp`, embeddings) is
"dense". Split models (`*-00001-of-0000N.gguf`) are read shard by shard.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from ggmoe.base.errors import ModelFileError, UsageError
from ggmoe.inspect import validate
from ggmoe.inspect.gating import Gating, gating_from_kv
from ggmoe.inspect.names import BLK_TENSOR, EXPERT_TENSOR_BASES, is_cached_expert_tensor
from ggmoe.inspect.reader import Header, TensorInfo, read_header

Keys = gguf.Keys


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
    def cached(self) -> tuple[ExpertTensor, ...]:
        """The tensors the expert cache holds (``is_cached_expert_tensor``: the weights, not biases or scales)."""
        return tuple(t for t in self.tensors if is_cached_expert_tensor(t.name))

    @property
    def bytes_per_expert(self) -> int:
        """Bytes the cache holds of one expert of this layer: its weights (what a slot stores and a copy moves)."""
        return sum(t.bytes_per_expert for t in self.cached)

    @property
    def device_bytes(self) -> int:
        """Bytes of this layer's per-expert biases and scales (every expert's), which stay on the device."""
        return sum(t.nbytes for t in self.tensors if not is_cached_expert_tensor(t.name))

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
    gating: Gating  # how the router gates, selects and weights (from the architecture and hparams)

    def layer(self, il: int) -> MoeLayer:
        for layer in self.layers:
            if layer.il == il:
                return layer
        raise KeyError(f"layer {il} is not a MoE layer (MoE layers: {_ranges(self.moe_layers)})")

    @property
    def experts_quantized(self) -> bool:
        """Whether every expert weight the cache holds has a block-quantized type (not F32, F16 or BF16)."""
        return all(t.ggml_type not in ("F32", "F16", "BF16", "F64") for layer in self.layers for t in layer.cached)

    def bytes_per_expert(self, il: int) -> int:
        """Bytes of one expert of MoE layer `il` (all its expert tensors)."""
        return self.layer(il).bytes_per_expert

    @property
    def expert_bytes_per_slot(self) -> int:
        """Bytes one more cache slot in every MoE layer costs: sum over MoE layers of bytes per expert."""
        return sum(layer.bytes_per_expert for layer in self.layers)

    def cache_bytes(self, n_slots_per_layer: int) -> int:
        """Bytes of an expert cache with ``n_slots_per_layer`` slots in every MoE layer: the --vram that buys
        exactly that many (``ggmoe.cache.slots_for_budget`` is its inverse)."""
        return n_slots_per_layer * self.expert_bytes_per_slot

    def vram_bytes(self, n_slots_per_layer: int) -> int:
        """Weight bytes with all dense tensors plus `n_slots_per_layer` expert slots in every MoE layer.

        An estimate of weights only: it counts token_embd, which llama.cpp keeps in
        host memory, and leaves out the KV cache and compute buffers.
        """
        if not 0 <= n_slots_per_layer <= self.n_expert:
            raise UsageError(f"cache slots per layer must be in 0..{self.n_expert}, got {n_slots_per_layer}")
        return self.dense_bytes + self.expert_device_bytes + n_slots_per_layer * self.expert_bytes_per_slot

    @property
    def expert_device_bytes(self) -> int:
        """Bytes of the routed experts' biases and scales, which stay on the device beside the dense weights."""
        return sum(layer.device_bytes for layer in self.layers)

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
            "gating": self.gating.to_dict(),
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
            f"router       {self.gating.describe()}",
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
        lines += ["", "expert cache (--vram for N slots per layer) and VRAM for weights (dense + cache):"]
        for n_slots in sorted(
            {self.n_expert_used, min(2 * self.n_expert_used, self.n_expert), self.n_expert}
        ):
            lines.append(f"  {n_slots:>4} slots/layer  --vram {self.cache_bytes(n_slots)}  "
                         f"({_size(self.cache_bytes(n_slots))}; weights {_size(self.vram_bytes(n_slots))})")
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


def _expert_tensor(path: Path, t: TensorInfo, kind: str, n_expert: int) -> ExpertTensor:
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


def _moe_layers(path: Path, tensors: list[TensorInfo], n_layer: int, n_expert: int) -> tuple[MoeLayer, ...]:
    by_layer: dict[int, list[ExpertTensor]] = {}
    for t in tensors:
        m = BLK_TENSOR.match(t.name)
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


def _facts(path: Path, header: Header) -> ModelFacts:
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
    validate.check_layers(path, header.tensors, n_layer)  # before anything sized by n_layer
    validate.check_scalars(path, kv, arch)
    validate.check_groups(path, kv, arch, n_expert)
    n_embd = _int_key(path, kv, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch))
    moe_ils = tuple(layer.il for layer in layers)
    validate.check_per_layer_arrays(path, kv, arch, n_layer, n_expert, moe_ils)
    validate.check_shapes(path, kv, header.tensors, n_embd, n_expert, moe_ils)
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
        n_embd=n_embd,
        n_ff_exp=_n_ff_exp(path, kv, arch, layers[0]),
        moe_layers=moe_layers,
        dense_layers=tuple(sorted(set(range(n_layer)) - set(moe_layers))),
        layers=layers,
        expert_bytes=expert_bytes,
        dense_bytes=total_bytes - expert_bytes,
        n_tensors=len(header.tensors),
        ggml_types=tuple(sorted(types.items())),
        gating=gating_from_kv(arch, kv),
    )


def inspect_model(path: str | os.PathLike[str]) -> ModelFacts:
    """MoE facts of the GGUF model at `path`, read from its header only.

    Raises ModelFileError (one-line message) for a missing, unreadable,
    truncated, corrupt or non-MoE file.
    """
    p = Path(path)
    return _facts(p, read_header(p))
