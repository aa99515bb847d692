"""Checks of a GGUF MoE header that llama.cpp would otherwise answer with an abort, a crash or a hang.

``inspect_model`` runs them before building ``ModelFacts``, and the engine reads
the facts before llama.cpp sees the file: a bad hyperparameter becomes one
``ModelFileError`` line instead of a SIGABRT in ``llama_model_load``. Each check
compares the header's numbers with each other and with the tensors' shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from ggmoe.base.errors import ModelFileError
from ggmoe.inspect.names import BLK_TENSOR
from ggmoe.inspect.reader import BigArray, TensorInfo

Keys = gguf.Keys

MAX_LAYERS = 4096  # blocks; the largest released models have fewer than 200
MAX_CONTEXT = 1 << 26  # tokens; llama.cpp keeps n_ctx_train in a uint32, real models stay below 2**24


def _fail(path: Path, msg: str) -> ModelFileError:
    return ModelFileError(f"{path}: invalid MoE model: {msg}")


def check_layers(path: Path, tensors: list[TensorInfo], n_layer: int) -> None:
    """block_count in 1..MAX_LAYERS, every ``blk.{il}`` below it, and every layer with tensors."""
    if not 1 <= n_layer <= MAX_LAYERS:
        raise _fail(path, f"block_count {n_layer} is not in 1..{MAX_LAYERS}")
    present = set()
    for t in tensors:
        m = BLK_TENSOR.match(t.name)
        if m is not None:
            present.add(int(m[1]))
    beyond = sorted(il for il in present if il >= n_layer)
    if beyond:
        raise _fail(path, f"tensors of layer {beyond[0]} are beyond block_count {n_layer}")
    missing = sorted(set(range(n_layer)) - present)
    if missing:
        raise _fail(path, f"block_count is {n_layer} but layer {missing[0]} has no tensors")


def check_per_layer_arrays(path: Path, kv: dict[str, Any], arch: str, n_layer: int, n_expert: int,
                           moe_layers: tuple[int, ...]) -> None:
    """Every per-layer hparam array of the architecture has n_layer integers; top-k arrays are in range."""
    prefix = f"{arch}."
    for key, value in kv.items():
        if not key.startswith(prefix) or isinstance(value, BigArray) or not isinstance(value, tuple):
            continue
        if key.startswith(f"{arch}.rope."):
            continue  # rope dimension sections are not per layer
        if not all(type(v) in (int, bool, float) for v in value):
            continue
        if len(value) != n_layer:
            raise _fail(path, f"{key} has {len(value)} entries for {n_layer} layers")
    used = kv.get(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))
    if isinstance(used, tuple):
        for il in moe_layers:
            if not 1 <= used[il] <= n_expert:
                raise _fail(path, f"expert_used_count of layer {il} is {used[il]}, not in 1..{n_expert}")


def _positive(path: Path, kv: dict[str, Any], key: str, required: bool) -> None:
    value = kv.get(key)
    if value is None:
        if required:
            raise _fail(path, f"missing key {key}")
        return
    values = value if isinstance(value, tuple) else (value,)
    if not values or not all(type(v) is int for v in values) or max(values) <= 0 or min(values) < 0:
        raise _fail(path, f"{key} is {value!r:.60}, expected a positive integer")


def check_scalars(path: Path, kv: dict[str, Any], arch: str) -> None:
    """Sizes llama.cpp divides by or allocates with must be positive and bounded."""
    _positive(path, kv, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), required=True)
    _positive(path, kv, Keys.Attention.HEAD_COUNT.format(arch=arch), required=False)
    _positive(path, kv, Keys.Attention.HEAD_COUNT_KV.format(arch=arch), required=False)
    ctx_key = Keys.LLM.CONTEXT_LENGTH.format(arch=arch)
    _positive(path, kv, ctx_key, required=False)
    n_ctx = kv.get(ctx_key)
    if type(n_ctx) is int and n_ctx > MAX_CONTEXT:
        raise _fail(path, f"{ctx_key} {n_ctx} is above {MAX_CONTEXT} tokens")


def check_groups(path: Path, kv: dict[str, Any], arch: str, n_expert: int) -> None:
    """Group-limited routing as llama.cpp asserts it: fewer groups than experts, equal groups, and some but not
    all groups used."""
    groups = kv.get(Keys.LLM.EXPERT_GROUP_COUNT.format(arch=arch), 0)
    used = kv.get(Keys.LLM.EXPERT_GROUP_USED_COUNT.format(arch=arch), 0)
    if type(groups) is not int or type(used) is not int:
        raise _fail(path, f"expert_group_count {groups!r:.30} and expert_group_used_count {used!r:.30} "
                          "must be integers")
    if groups < 0 or used < 0 or groups >= n_expert > 0:
        raise _fail(path, f"expert_group_count {groups} (used {used}) is not in 0..{n_expert - 1}")
    if groups > 1 and (n_expert % groups or not 0 < used < groups):
        raise _fail(path, f"{groups} expert groups of {n_expert} experts with {used} used: the groups must be "
                          "equal and some but not all used")


def _shape(tensors: dict[str, TensorInfo], name: str) -> tuple[int, ...] | None:
    t = tensors.get(name)
    return t.shape if t is not None else None


def check_shapes(path: Path, kv: dict[str, Any], tensors: list[TensorInfo], n_embd: int, n_expert: int,
                 moe_layers: tuple[int, ...]) -> None:
    """Routers [n_embd, n_expert], experts [n_embd, n_ff, n_expert] / [n_ff, n_embd, n_expert], the vocabulary."""
    by_name = {t.name: t for t in tensors}
    emb = _shape(by_name, "token_embd.weight")
    if emb is not None:
        if len(emb) != 2 or emb[0] != n_embd:
            raise _fail(path, f"token_embd.weight has shape {list(emb)}, expected [{n_embd}, n_vocab]")
        tokens = kv.get(Keys.Tokenizer.LIST)
        n_tokens = tokens.count if isinstance(tokens, BigArray) else len(tokens) if isinstance(tokens, tuple) else None
        if n_tokens is not None and n_tokens != emb[1]:
            raise _fail(path, f"the vocabulary has {n_tokens} tokens but token_embd.weight has {emb[1]} rows")
    for il in moe_layers:
        router = _shape(by_name, f"blk.{il}.ffn_gate_inp.weight")
        if router is not None and router != (n_embd, n_expert):
            raise _fail(path, f"blk.{il}.ffn_gate_inp.weight has shape {list(router)}, "
                              f"expected [{n_embd}, {n_expert}]")
        _check_expert_shapes(path, by_name, il, n_embd, n_expert)


def _check_expert_shapes(path: Path, by_name: dict[str, TensorInfo], il: int, n_embd: int, n_expert: int) -> None:
    widths = set()  # n_ff of each expert matrix of the layer
    for kind, embd_dim, factor in (("up", 0, 1), ("gate", 0, 1), ("gate_up", 0, 2), ("down", 1, 1)):
        name = f"blk.{il}.ffn_{kind}_exps.weight"
        shape = _shape(by_name, name)
        if shape is None:
            continue
        if len(shape) != 3 or shape[embd_dim] != n_embd or shape[2] != n_expert:
            want = f"[{n_embd}, n_ff, {n_expert}]" if embd_dim == 0 else f"[n_ff, {n_embd}, {n_expert}]"
            raise _fail(path, f"{name} has shape {list(shape)}, expected {want}")
        n_ff = shape[1 - embd_dim]
        if n_ff % factor or n_ff == 0:
            raise _fail(path, f"{name} has an expert width of {n_ff}")
        widths.add(n_ff // factor)
    if len(widths) > 1:
        raise _fail(path, f"the expert matrices of layer {il} disagree on the expert width: {sorted(widths)}")
