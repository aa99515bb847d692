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

# llama.cpp's tensor_buft_overrides pattern (a std::regex search) matching every expert weight the cache
# holds: ``blk.{il}.ffn_{kind}_exps.weight`` exactly. Per-expert biases and scales (gpt-oss) are small and stay
# on the device with the dense weights, so a layer's decode graph splits no more than stock's.
EXPERT_TENSOR_PATTERN = r"blk\.\d+\.ffn_(" + "|".join(CACHED_KINDS) + r")_exps\.weight$"



def expert_pattern(layers: tuple[int, ...]) -> str:
    """``EXPERT_TENSOR_PATTERN`` for the expert weights of ``layers`` only (matches no tensor when empty):
    llama.cpp's --n-cpu-moe."""
    if not layers:
        return r"^$"
    return (r"^blk\.(" + "|".join(str(int(il)) for il in sorted(layers)) + r")\.ffn_(" + "|".join(CACHED_KINDS)
            + r")_exps\.weight$")


# il, base ("ffn_up_exps"), suffix ("weight")
BLK_TENSOR = re.compile(r"^blk\.(\d+)\.([^.]+)\.(.+)$")


def expert_weight_name(il: int, kind: str) -> str:
    """``blk.{il}.ffn_{kind}_exps.weight`` for a kind of ``CACHED_KINDS``."""
    return f"blk.{il}.ffn_{kind}_exps.weight"


def is_cached_expert_tensor(name: str) -> bool:
    """Whether the expert cache holds (copies, counts, budgets) this GGUF tensor: a routed expert weight of a
    cached kind, ``blk.{il}.ffn_{kind}_exps.weight``. The one rule every command uses; biases and scales of
    routed experts stay on the device and count as dense bytes."""
    m = BLK_TENSOR.match(name)
    return m is not None and m[3] == "weight" and m[2] in {f"ffn_{k}_exps" for k in CACHED_KINDS}
