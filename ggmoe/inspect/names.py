"""Tensor names of routed experts, from gguf's constants: the one place they are spelled.

A routed expert tensor is ``blk.{il}.ffn_{up,gate,down,gate_up}_exps.{weight,bias,scale}``:
3-D ``[ne0, ne1, n_expert]`` in ggml order (2-D for biases), one contiguous slice per
expert in the outermost dimension. Shared experts (``ffn_*_shexp``) are dense.
"""

from __future__ import annotations

import re

import gguf

_BLK_PREFIX = "blk.{bid}."

# The part after "blk.{il}." of every routed-expert tensor gguf knows, e.g. "ffn_up_exps".
EXPERT_TENSOR_BASES: frozenset[str] = frozenset(
    name.removeprefix(_BLK_PREFIX)
    for name in gguf.TENSOR_NAMES.values()
    if name.startswith(_BLK_PREFIX) and name.endswith("_exps")
)

# Expert weight kinds the patched engine caches, in the order of llama_ggmoe_set_layer_cache's arguments.
CACHED_KINDS: tuple[str, ...] = ("up", "gate", "down", "gate_up")
for _kind in CACHED_KINDS:
    assert f"ffn_{_kind}_exps" in EXPERT_TENSOR_BASES, _kind

# llama.cpp's tensor_buft_overrides pattern (a std::regex search) matching every routed expert tensor.
EXPERT_TENSOR_PATTERN = r"blk\.\d+\.ffn_(" + "|".join(CACHED_KINDS) + r")_exps"

# il, base ("ffn_up_exps"), suffix ("weight")
BLK_TENSOR = re.compile(r"^blk\.(\d+)\.([^.]+)\.(.+)$")


def expert_weight_name(il: int, kind: str) -> str:
    """``blk.{il}.ffn_{kind}_exps.weight`` for a kind of ``CACHED_KINDS``."""
    return f"blk.{il}.ffn_{kind}_exps.weight"


def is_expert_tensor(name: str) -> bool:
    """Whether a GGUF tensor name is a routed expert tensor (weight, bias or scale)."""
    m = BLK_TENSOR.match(name)
    return m is not None and m[2] in EXPERT_TENSOR_BASES
