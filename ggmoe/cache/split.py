"""MoEpic's expert split: the geometry of an expert's top and bottom segments, per layer.

MoEpic (arXiv 2509.08342) splits every expert vertically: the top segment, the
first ``n_top`` of its ``n_ff`` intermediate neurons, stays in a cache slot; the
bottom segment (the other neurons) is read from the model's host tensor, or from
a bottom buffer when it was prefetched. The neurons are rows of ``ffn_up_exps``
and ``ffn_gate_exps`` ``[n_embd, n_ff]`` (each half of a merged ``ffn_gate_up_exps``
``[n_embd, 2 n_ff]``) and columns of ``ffn_down_exps`` ``[n_ff, n_embd]``: the first
``n_top / blck`` quant blocks of each of its rows. ``n_top`` is ``θ n_ff``
rounded down to the down tensor's quant block, so a segment boundary never cuts
a block and every dot product reads the same blocks in the same order as unsplit
(patch 0007: bit-identical logits).

Layouts (what the engine's copies move and ``ggml_mul_mat_id_table_split`` reads):

- top segment, in a slot: up/gate rows ``[0, n_top)`` packed (each half's for gate_up),
  down rows of ``n_top / blck`` blocks packed;
- bottom segment: read in place in the expert's own layout (the host tensor's), or
  copied into a bottom buffer packed (up/gate rows ``[n_top, n_ff)`` of each half,
  down rows of the remaining blocks; ``GGML_MMID_SPLIT_PACKED``): a buffer holds
  exactly one bottom.

Pure arithmetic on the GGUF's facts: the cache, the simulator and the engine use
the same figures (bytes per top, per bottom, the split of each kind).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import gguf

from ggmoe.base.errors import UsageError
from ggmoe.inspect.facts import ModelFacts, MoeLayer
from ggmoe.inspect.names import CACHED_KINDS

# micro-batches of at most this many tokens read a split layer through its tables; larger ones (prefill) take
# the model's own expert tensors. Equal to patch 0007's LLAMA_GGMOE_SPLIT_MAX_TOKENS.
SPLIT_MAX_TOKENS = 4

SPLIT_ROWS, SPLIT_COLS = 1, 2  # ggml_mmid_split_axis (patch 0007)
# or-ed into a split expert's bottom address (bit 0: addresses are even): a packed bottom (a bottom buffer), so
# that a bottom moves between host memory and a buffer by one 8-byte write (patch 0007's GGML_MMID_SPLIT_PACKED)
SPLIT_PACKED = 1


@dataclass(frozen=True)
class Pieces:
    """Bytes of one expert moved as ``n`` equal pieces (a 2-D copy): piece i from ``src + i*src_stride`` of the
    expert's host bytes to ``dst + i*dst_stride`` of its destination."""

    src: int  # bytes from the expert's start in the host tensor
    dst: int  # bytes from the start of the destination (a top segment or a packed bottom)
    size: int  # bytes per piece
    n: int  # pieces
    src_stride: int  # bytes
    dst_stride: int  # bytes

    @property
    def nbytes(self) -> int:
        return self.size * self.n


@dataclass(frozen=True)
class KindSplit:
    """One expert tensor kind of a split layer."""

    kind: str  # of CACHED_KINDS: "up", "gate", "down", "gate_up"
    axis: int  # SPLIT_ROWS (up, gate, gate_up) or SPLIT_COLS (down)
    split: int  # the table's split: rows per row group (rows) or quant blocks per row (cols)
    nb2: int  # bytes of one whole expert matrix of this kind
    top: Pieces  # the top segment: host -> slot
    bottom: tuple[Pieces, ...]  # the bottom segment: host -> bottom buffer (packed)

    @property
    def top_bytes(self) -> int:
        return self.top.nbytes

    @property
    def bottom_bytes(self) -> int:
        return sum(r.nbytes for r in self.bottom)


@dataclass(frozen=True)
class LayerSplit:
    """How one MoE layer's experts are split (θ < 1)."""

    il: int
    theta: float  # the share of neurons asked for in the top segment, in [0, 1)
    n_ff: int  # neurons of one expert
    n_top: int  # neurons in the top segment: θ n_ff rounded down to the down tensor's quant block
    kinds: tuple[KindSplit, ...]  # in CACHED_KINDS order, the kinds the layer has

    @property
    def top_bytes(self) -> int:
        """Bytes of one expert's top segment (all kinds): a slot's size."""
        return sum(k.top_bytes for k in self.kinds)

    @property
    def bottom_bytes(self) -> int:
        """Bytes of one expert's bottom segment (all kinds): what a top-only hit reads over the link."""
        return sum(k.bottom_bytes for k in self.kinds)

    @property
    def expert_bytes(self) -> int:
        return sum(k.nb2 for k in self.kinds)


def _block(ggml_type: str) -> tuple[int, int]:
    """(elements, bytes) of one quant block of a ggml type named as gguf names it."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]


def _weights(layer: MoeLayer) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """kind -> (ggml type, shape, bytes per expert) of the layer's expert weight tensors."""
    out = {}
    for k in CACHED_KINDS:
        try:
            t = layer.tensor(f"ffn_{k}_exps.weight")
        except KeyError:
            continue
        out[k] = (t.ggml_type, t.shape, t.bytes_per_expert)
    return out


def layer_split(layer: MoeLayer, theta: float) -> LayerSplit | None:
    """The split of ``layer`` for a top share ``theta``; None when the top is the whole expert (θ rounds to
    n_ff: today's whole-expert slots)."""
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta) \
            or not 0.0 <= theta <= 1.0:
        raise UsageError(f"layer {layer.il}: top share θ = {theta!r}; it must be a number from 0 to 1")
    w = _weights(layer)
    if "down" not in w:
        raise UsageError(f"layer {layer.il} has no ffn_down_exps: its experts cannot be split")
    down_type, down_shape, _ = w["down"]
    n_ff = down_shape[0]
    blck, _ = _block(down_type)
    n_top = int(theta * n_ff) // blck * blck
    if n_top >= n_ff:
        return None
    kinds = []
    for k, (gtype, shape, nb2) in w.items():
        b_el, b_bytes = _block(gtype)
        nb1 = shape[0] // b_el * b_bytes  # bytes of one row
        if k == "down":
            kb = n_top // b_el  # blocks of each row in the top
            top_row = kb * b_bytes
            rows = shape[1]
            top = Pieces(0, 0, top_row, rows, nb1, top_row)
            bottom = (Pieces(top_row, 0, nb1 - top_row, rows, nb1, nb1 - top_row),)
            kinds.append(KindSplit(k, SPLIT_COLS, kb, nb2, top, bottom))
            continue
        halves = 2 if k == "gate_up" else 1  # gate_up: the gate half then the up half, n_ff rows each
        if shape[1] != halves * n_ff:
            raise UsageError(f"layer {layer.il}: ffn_{k}_exps has {shape[1]} rows, not {halves} x n_ff = "
                             f"{halves * n_ff}: its experts cannot be split")
        top = Pieces(0, 0, n_top * nb1, halves, n_ff * nb1, n_top * nb1)
        bottom = (Pieces(n_top * nb1, 0, (n_ff - n_top) * nb1, halves, n_ff * nb1, (n_ff - n_top) * nb1),)
        kinds.append(KindSplit(k, SPLIT_ROWS, n_top, nb2, top, bottom))
    return LayerSplit(layer.il, float(theta), n_ff, n_top, tuple(kinds))


def model_split(facts: ModelFacts, theta: Mapping[int, float] | None) -> dict[int, LayerSplit]:
    """The split MoE layers of a model for per-layer top shares (layers not named, and θ that rounds to the
    whole expert, are not split)."""
    if not theta:
        return {}
    unknown = sorted(set(theta) - set(facts.moe_layers))
    if unknown:
        raise UsageError(f"top shares θ name layers {unknown}, which are not MoE layers of this model "
                         f"(those are {list(facts.moe_layers)})")
    out = {}
    for il, t in theta.items():
        s = layer_split(facts.layer(il), t)
        if s is not None:
            out[il] = s
    return out


def tops_in(split: Mapping[int, LayerSplit], slots: Mapping[int, int], bytes_per_expert: Mapping[int, int],
            n_expert: int, reserved: Mapping[int, int] | None = None) -> dict[int, int]:
    """Slots per layer at the same VRAM: a split layer holds as many tops as the bytes of its ``slots`` whole
    experts, less ``reserved`` bytes (its bottom buffers), at most n_expert; a whole-expert layer keeps its."""
    res = reserved or {}
    return {il: min(n_expert, (n * bytes_per_expert[il] - res.get(il, 0)) // max(split[il].top_bytes, 1))
            if il in split else n for il, n in slots.items()}


def split_at(facts: ModelFacts, slots: Mapping[int, int], theta: float) -> tuple[dict[int, LayerSplit], dict[int, int]]:
    """(split layers, slots per layer) for top share ``theta`` in every MoE layer, at the VRAM of ``slots``
    whole experts (``tops_in``); θ = 1: no split, the slots as given."""
    split = model_split(facts, dict.fromkeys(facts.moe_layers, theta)) if theta < 1 else {}
    bpe = {il: facts.bytes_per_expert(il) for il in slots}
    return split, tops_in(split, slots, bpe, facts.n_expert)
