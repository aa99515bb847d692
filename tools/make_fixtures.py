#!/usr/bin/env python3
"""Tiny random-weight GGUF Mixture-of-Experts models for the test suite.

Each fixture is a real llama.cpp model of one architecture, with every tensor
and hparam key that the vendored llama.cpp's loader requires, but tiny shapes
(n_embd 64, 8 experts of width 32, 4 layers) and seeded random weights, so it
loads and generates in milliseconds and weighs under 1 MB. A byte-level
BPE tokenizer (256 byte tokens, a few merges, BOS/EOS) is embedded so ASCII
text tokenizes and detokenizes losslessly.

Fixture names (ARCHES) and the llama.cpp architecture written to the file:

    qwen3moe  -> qwen3moe (per-head q/k RMS norm)
    qwen2moe  -> qwen2moe (q/k/v biases, shared expert with a sigmoid gate)
    olmoe     -> olmoe    (full-width q/k RMS norm)
    mixtral   -> llama    (llama.expert_count > 0: Mixtral-style MoE)
    deepseek2 -> deepseek2 (MLA attention, layer 0 dense, one shared expert,
                            sigmoid routing with the exp_probs_b selection bias)
    gptoss    -> gpt-oss   (llama.cpp's openai-moe tensor set: expert biases, router
                            bias, attention sinks, sliding window on every other layer;
                            softmax over the selected experts' biased logits)
    glm4moe   -> glm4moe   (GLM-4.5 / GLM-4.5-Air: q/k/v biases, post-attention norm as the
                            FFN norm, layer 0 dense, one shared expert, sigmoid routing with
                            the exp_probs_b selection bias, weights normalised and scaled 2.5)
    deepseek3 -> deepseek2 (DeepSeek-V3's shape: deepseek2 plus group-limited routing, 4
                            groups of 2 experts with 2 used, weights scaled 2.5)
    ernie45   -> ernie4_5-moe (ERNIE 4.5: layer 0 dense, a shared expert of its own width,
                            softmax routing with the exp_probs_b selection bias, weights normalised)
    llama4    -> llama4    (Llama 4: MoE on every other layer, dense FFNs between, a shared
                            expert, top-1 routing with sigmoid weights applied before the FFN)

``write_dense_fixture`` writes a plain ``llama`` model without experts, for
tests that must reject non-MoE models.

Usage:
    python tools/make_fixtures.py --out DIR [--arch A ...] [--expert-type f16|f32|q8_0|mxfp4] [--dense]

As a module (tests):
    fixture_path("qwen3moe", expert_type="q8_0")  # generated on demand, cached
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import gguf_writer
import numpy as np
from gguf_writer import BpeVocab, Key, Tensor, tensor_name, write_gguf, write_out

T = gguf.MODEL_TENSOR
QType = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """Hyperparameters shared by every fixture (counts; widths in elements)."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2  # GQA: two query heads share one K/V head
    n_ff: int = 128  # width of a dense FFN (the non-MoE fixture)
    n_ff_exp: int = 32  # width of one routed expert's FFN
    n_ff_shexp: int = 64  # width of the shared expert's FFN (qwen2moe)
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1  # deepseek2: shared experts of width n_ff_exp
    n_ctx_train: int = 256  # tokens
    # deepseek2 multi-head latent attention (MLA), head sizes in elements:
    q_lora_rank: int = 32  # rank of the low-rank Q projection
    kv_lora_rank: int = 32  # width of the compressed KV latent
    n_rot_mla: int = 8  # rotary part of each Q/K head (qk_rope_head_dim)
    n_embd_head_qk_nope: int = 16  # non-rotary part of each Q/K head
    n_embd_head_v_mla: int = 16  # V head size after decompression
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0

    @property
    def n_embd_head(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_head_k_mla(self) -> int:
        return self.n_embd_head_qk_nope + self.n_rot_mla


SHAPE = Shape()


class QkNorm(enum.Enum):
    """Where the architecture RMS-normalizes Q and K before RoPE."""

    NONE = "none"
    PER_HEAD = "per_head"  # attn_{q,k}_norm has n_embd_head elements (qwen3moe)
    FULL = "full"  # attn_{q,k}_norm has n_embd elements (olmoe, needs n_head_kv == n_head)


class SharedExpert(enum.Enum):
    """Whether and how a MoE layer has always-active shared experts."""

    NONE = "none"
    GATED = "gated"  # qwen2moe: one shared FFN of width n_ff_shexp behind a sigmoid gate ffn_gate_inp_shexp
    PLAIN = (
        "plain"  # deepseek2: n_expert_shared experts fused into one FFN of width n_ff_exp * n_expert_shared
    )
    WIDE = "wide"  # ernie4_5-moe: one FFN of width n_ff_shexp (expert_shared_feed_forward_length), no gate


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one fixture architecture from the others, per the vendored llama.cpp loader."""

    arch: gguf.MODEL_ARCH
    qk_norm: QkNorm = QkNorm.NONE
    qkv_bias: bool = False
    shared_expert: SharedExpert = SharedExpert.NONE
    # True: n_ff_exp goes in {arch}.expert_feed_forward_length; False: the loader
    # takes the expert width from {arch}.feed_forward_length (olmoe, llama).
    expert_ff_key: bool = True
    mha: bool = False  # force n_head_kv == n_head
    mla: bool = False  # deepseek2 multi-head latent attention instead of Q/K/V projections
    n_layer_dense_lead: int = 0  # leading layers with a dense FFN instead of experts
    # the selection-only bias exp_probs_b (DeepSeek-V3 style; its gating comes from gating_keys or the arch)
    router_bias: bool = False
    # gpt-oss (llama.cpp's openai-moe): biased router logits (ffn_gate_inp.bias), per-expert biases on every
    # expert tensor, attention sinks, an output-projection bias, post_attention_norm as the FFN's norm, and
    # sliding-window attention on every other layer
    gpt_oss: bool = False
    sliding_window: int = 0  # tokens; 0: none
    # glm4moe: attn_post_norm (not ffn_norm) normalises every layer's FFN input, dense layers' too
    post_attn_norm_ffn: bool = False
    # gating keys written (expert_gating_func, expert_weights_norm, expert_weights_scale); None: none written
    gating_keys: tuple[gguf.ExpertGatingFuncType, bool, float] | None = None
    expert_groups: tuple[int, int] = (0, 0)  # (expert_group_count, expert_group_used_count): group-limited routing
    moe_layer_step: int = 0  # llama4's interleave_moe_layer_step: layer il has experts iff (il + 1) % step == 0
    n_expert_used: int | None = None  # top-k when it is not the shape's (llama4 routes top-1)
    shared_count_key: bool = True  # whether {arch}.expert_shared_count is written (llama4's loader has none)

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


ARCH_SPECS: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec(gguf.MODEL_ARCH.QWEN3MOE, qk_norm=QkNorm.PER_HEAD),
    "qwen2moe": ArchSpec(gguf.MODEL_ARCH.QWEN2MOE, qkv_bias=True, shared_expert=SharedExpert.GATED),
    "olmoe": ArchSpec(gguf.MODEL_ARCH.OLMOE, qk_norm=QkNorm.FULL, expert_ff_key=False, mha=True),
    "mixtral": ArchSpec(gguf.MODEL_ARCH.LLAMA, expert_ff_key=False),
    "deepseek2": ArchSpec(
        gguf.MODEL_ARCH.DEEPSEEK2,
        shared_expert=SharedExpert.PLAIN,
        mla=True,
        n_layer_dense_lead=1,
        router_bias=True,
        gating_keys=(gguf.ExpertGatingFuncType.SIGMOID, True, 1.0),
    ),
    "gptoss": ArchSpec(gguf.MODEL_ARCH.GPT_OSS, qkv_bias=True, gpt_oss=True, sliding_window=8),
    "glm4moe": ArchSpec(
        gguf.MODEL_ARCH.GLM4_MOE, qkv_bias=True, shared_expert=SharedExpert.PLAIN, n_layer_dense_lead=1,
        router_bias=True, post_attn_norm_ffn=True,
        gating_keys=(gguf.ExpertGatingFuncType.SIGMOID, True, 2.5),
    ),
    "deepseek3": ArchSpec(
        gguf.MODEL_ARCH.DEEPSEEK2, shared_expert=SharedExpert.PLAIN, mla=True, n_layer_dense_lead=1,
        router_bias=True, gating_keys=(gguf.ExpertGatingFuncType.SIGMOID, True, 2.5), expert_groups=(4, 2),
    ),
    "ernie45": ArchSpec(
        gguf.MODEL_ARCH.ERNIE4_5_MOE, shared_expert=SharedExpert.WIDE, n_layer_dense_lead=1, router_bias=True,
        moe_layer_step=1,
    ),
    "llama4": ArchSpec(
        gguf.MODEL_ARCH.LLAMA4, shared_expert=SharedExpert.PLAIN, moe_layer_step=2, n_expert_used=1,
        shared_count_key=False,
    ),
}
ARCHES: tuple[str, ...] = tuple(ARCH_SPECS)
DENSE_NAME = "llama-dense"

# --expert-type value -> ggml type of the routed expert tensors; everything else stays F32.
# mxfp4: gpt-oss's own expert type (OCP microscaling FP4: 32 values of 4 bits and one E8M0 scale per block)
EXPERT_TYPES: dict[str, QType] = {"f32": QType.F32, "f16": QType.F16, "q8_0": QType.Q8_0, "mxfp4": QType.MXFP4}

# Standard deviations of the random weights. Inputs to every matmul are RMS-normed
# (unit variance per element), so an [n_in -> n_out] matrix of std s gives outputs of
# std s*sqrt(n_in) = s*8 for n_in = 64: 0.1 keeps activations near 1.
WEIGHT_STD = 0.1
BIAS_STD = 0.02
EMBD_STD = 1.0
# The router's logits get std 0.3*8 = 2.4: sharp enough that top-k depends on the
# token (different tokens pick different experts), not so sharp that one expert wins all.
ROUTER_STD = 0.3


class Role(enum.Enum):
    """How a tensor's random values are drawn."""

    NORM = "norm"  # all ones
    WEIGHT = "weight"
    BIAS = "bias"
    EMBD = "embd"
    ROUTER = "router"
    EXPERT = "expert"  # routed expert weights: written as the chosen expert type


ROLE_STD: dict[Role, float] = {
    Role.WEIGHT: WEIGHT_STD,
    Role.BIAS: BIAS_STD,
    Role.EMBD: EMBD_STD,
    Role.ROUTER: ROUTER_STD,
    Role.EXPERT: WEIGHT_STD,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str  # GGUF tensor name, e.g. "blk.0.ffn_up_exps.weight"
    ne: tuple[int, ...]  # ggml shape, innermost dimension first (numpy shape reversed)
    role: Role


# ---------------------------------------------------------------------------
# Tokenizer: GPT-2 style byte-level BPE


def byte_tokens() -> list[str]:
    """The 256 byte tokens in GPT-2's byte-to-unicode mapping; token id == byte value.

    Printable bytes map to themselves; the others (space, control bytes, ...) to
    code points from 256 up, e.g. space -> "Ġ", newline -> "Ċ". llama.cpp's BPE
    tokenizer maps text bytes the same way before looking tokens up.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# A few merges in rank order; each merged string is also a token.
MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("r", "e"),
    ("o", "n"),
    ("Ġt", "he"),
    ("e", "r"),
    ("Ġ", "a"),
    ("a", "n"),
    ("Ġ", "s"),
    ("o", "u"),
    ("i", "s"),
)
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"


def make_vocab() -> BpeVocab:
    tokens = byte_tokens() + [left + right for left, right in MERGES]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    bos_id, eos_id = len(tokens), len(tokens) + 1
    tokens += [BOS_TOKEN, EOS_TOKEN]
    types += [gguf.TokenType.CONTROL] * 2
    return BpeVocab(tokens, [int(t) for t in types], [f"{a} {b}" for a, b in MERGES], bos_id, eos_id)


# ---------------------------------------------------------------------------
# Tensor lists


def _global_tensors(shape: Shape, n_vocab: int) -> list[TensorSpec]:
    return [
        TensorSpec(tensor_name(T.TOKEN_EMBD), (shape.n_embd, n_vocab), Role.EMBD),
        TensorSpec(tensor_name(T.OUTPUT_NORM), (shape.n_embd,), Role.NORM),
        TensorSpec(tensor_name(T.OUTPUT), (shape.n_embd, n_vocab), Role.WEIGHT),
    ]


def _mla_attention_tensors(shape: Shape, il: int) -> list[TensorSpec]:
    """deepseek2 MLA in the split k_b/v_b form that convert_hf_to_gguf.py writes."""
    d, n_head = shape.n_embd, shape.n_head
    q_rank, kv_rank = shape.q_lora_rank, shape.kv_lora_rank
    return [
        TensorSpec(tensor_name(T.ATTN_NORM, il), (d,), Role.NORM),
        TensorSpec(tensor_name(T.ATTN_Q_A_NORM, il), (q_rank,), Role.NORM),
        TensorSpec(tensor_name(T.ATTN_KV_A_NORM, il), (kv_rank,), Role.NORM),
        TensorSpec(tensor_name(T.ATTN_Q_A, il), (d, q_rank), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_Q_B, il), (q_rank, n_head * shape.n_embd_head_k_mla), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_KV_A_MQA, il), (d, kv_rank + shape.n_rot_mla), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_K_B, il), (shape.n_embd_head_qk_nope, kv_rank, n_head), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_V_B, il), (kv_rank, shape.n_embd_head_v_mla, n_head), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_OUT, il), (n_head * shape.n_embd_head_v_mla, d), Role.WEIGHT),
    ]


def _attention_tensors(spec: ArchSpec, shape: Shape, il: int) -> list[TensorSpec]:
    if spec.mla:
        return _mla_attention_tensors(shape, il)
    n_head_kv = shape.n_head if spec.mha else shape.n_head_kv
    n_q = shape.n_embd_head * shape.n_head
    n_kv = shape.n_embd_head * n_head_kv
    out = [
        TensorSpec(tensor_name(T.ATTN_NORM, il), (shape.n_embd,), Role.NORM),
        TensorSpec(tensor_name(T.ATTN_Q, il), (shape.n_embd, n_q), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_K, il), (shape.n_embd, n_kv), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_V, il), (shape.n_embd, n_kv), Role.WEIGHT),
        TensorSpec(tensor_name(T.ATTN_OUT, il), (n_q, shape.n_embd), Role.WEIGHT),
    ]
    if spec.post_attn_norm_ffn and not spec.gpt_oss:  # the FFN's norm, an attention tensor by name
        out.append(TensorSpec(tensor_name(T.ATTN_POST_NORM, il), (shape.n_embd,), Role.NORM))
    if spec.gpt_oss:
        out += [
            TensorSpec(tensor_name(T.ATTN_OUT, il, "bias"), (shape.n_embd,), Role.BIAS),
            TensorSpec(tensor_name(T.ATTN_SINKS, il), (shape.n_head,), Role.BIAS),
            TensorSpec(tensor_name(T.ATTN_POST_NORM, il), (shape.n_embd,), Role.NORM),
        ]
    if spec.qkv_bias:
        out += [
            TensorSpec(tensor_name(T.ATTN_Q, il, "bias"), (n_q,), Role.BIAS),
            TensorSpec(tensor_name(T.ATTN_K, il, "bias"), (n_kv,), Role.BIAS),
            TensorSpec(tensor_name(T.ATTN_V, il, "bias"), (n_kv,), Role.BIAS),
        ]
    norm_len = {QkNorm.PER_HEAD: shape.n_embd_head, QkNorm.FULL: shape.n_embd}.get(spec.qk_norm)
    if norm_len is not None:
        out += [
            TensorSpec(tensor_name(T.ATTN_Q_NORM, il), (norm_len,), Role.NORM),
            TensorSpec(tensor_name(T.ATTN_K_NORM, il), (norm_len,), Role.NORM),
        ]
    return out


def _moe_tensors(spec: ArchSpec, shape: Shape, il: int) -> list[TensorSpec]:
    e, d, f = shape.n_expert, shape.n_embd, shape.n_ff_exp
    if spec.gpt_oss:  # post_attention_norm (an attention tensor) is the FFN's norm
        return [
            TensorSpec(tensor_name(T.FFN_GATE_INP, il), (d, e), Role.ROUTER),
            TensorSpec(tensor_name(T.FFN_GATE_INP, il, "bias"), (e,), Role.BIAS),
            *(TensorSpec(tensor_name(kind, il), (d, f, e) if kind != T.FFN_DOWN_EXP else (f, d, e), Role.EXPERT)
              for kind in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)),
            TensorSpec(tensor_name(T.FFN_GATE_EXP, il, "bias"), (f, e), Role.BIAS),
            TensorSpec(tensor_name(T.FFN_UP_EXP, il, "bias"), (f, e), Role.BIAS),
            TensorSpec(tensor_name(T.FFN_DOWN_EXP, il, "bias"), (d, e), Role.BIAS),
        ]
    out = [
        *([] if spec.post_attn_norm_ffn else [TensorSpec(tensor_name(T.FFN_NORM, il), (d,), Role.NORM)]),
        TensorSpec(tensor_name(T.FFN_GATE_INP, il), (d, e), Role.ROUTER),
        *(
            [TensorSpec(tensor_name(T.FFN_EXP_PROBS_B, il, "bias"), (e,), Role.BIAS)]
            if spec.router_bias
            else []
        ),
        TensorSpec(tensor_name(T.FFN_GATE_EXP, il), (d, f, e), Role.EXPERT),
        TensorSpec(tensor_name(T.FFN_UP_EXP, il), (d, f, e), Role.EXPERT),
        TensorSpec(tensor_name(T.FFN_DOWN_EXP, il), (f, d, e), Role.EXPERT),
    ]
    if spec.shared_expert is SharedExpert.GATED:
        out.append(TensorSpec(tensor_name(T.FFN_GATE_INP_SHEXP, il), (d,), Role.WEIGHT))
    if spec.shared_expert is not SharedExpert.NONE:
        s = f * shape.n_expert_shared if spec.shared_expert is SharedExpert.PLAIN else shape.n_ff_shexp
        out += [
            TensorSpec(tensor_name(T.FFN_GATE_SHEXP, il), (d, s), Role.WEIGHT),
            TensorSpec(tensor_name(T.FFN_UP_SHEXP, il), (d, s), Role.WEIGHT),
            TensorSpec(tensor_name(T.FFN_DOWN_SHEXP, il), (s, d), Role.WEIGHT),
        ]
    return out


def _dense_ffn_tensors(shape: Shape, il: int, norm: bool = True) -> list[TensorSpec]:
    """A dense FFN; ``norm``: with its own ffn_norm (not where attn_post_norm normalises its input)."""
    d, f = shape.n_embd, shape.n_ff
    return [
        *([TensorSpec(tensor_name(T.FFN_NORM, il), (d,), Role.NORM)] if norm else []),
        TensorSpec(tensor_name(T.FFN_GATE, il), (d, f), Role.WEIGHT),
        TensorSpec(tensor_name(T.FFN_UP, il), (d, f), Role.WEIGHT),
        TensorSpec(tensor_name(T.FFN_DOWN, il), (f, d), Role.WEIGHT),
    ]


def is_moe_layer(spec: ArchSpec, il: int) -> bool:
    """Whether layer ``il`` of a fixture has routed experts (leading dense layers; llama4's interleaving)."""
    if il < spec.n_layer_dense_lead:
        return False
    return spec.moe_layer_step == 0 or (il + 1) % spec.moe_layer_step == 0


def moe_tensor_specs(spec: ArchSpec, shape: Shape, n_vocab: int) -> list[TensorSpec]:
    out = _global_tensors(shape, n_vocab)
    for il in range(shape.n_layer):
        ffn = _moe_tensors(spec, shape, il) if is_moe_layer(spec, il) else _dense_ffn_tensors(
            shape, il, norm=not spec.post_attn_norm_ffn)
        out += _attention_tensors(spec, shape, il) + ffn
    return out


def dense_tensor_specs(shape: Shape, n_vocab: int) -> list[TensorSpec]:
    spec = ArchSpec(gguf.MODEL_ARCH.LLAMA)
    out = _global_tensors(shape, n_vocab)
    for il in range(shape.n_layer):
        out += _attention_tensors(spec, shape, il) + _dense_ffn_tensors(shape, il)
    return out


# ---------------------------------------------------------------------------
# Writing


def _random_values(rng: np.random.Generator, t: TensorSpec) -> np.ndarray:
    """Float32 values for a tensor, numpy shape = reversed ggml shape."""
    np_shape = tuple(reversed(t.ne))
    if t.role is Role.NORM:
        return np.ones(np_shape, dtype=np.float32)
    return (rng.standard_normal(np_shape, dtype=np.float32) * ROLE_STD[t.role]).astype(np.float32)


def _encode(values: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType | None]:
    """Array to hand to GGUFWriter.add_tensor and its raw_dtype (None: infer from numpy dtype)."""
    if qtype is QType.F32:
        return values, None
    if qtype is QType.F16:
        return values.astype(np.float16), None
    return gguf.quants.quantize(values, qtype), qtype


@dataclass(frozen=True)
class ModelPlan:
    """Everything that determines a fixture file's bytes."""

    spec: ArchSpec
    shape: Shape
    vocab: BpeVocab
    tensors: tuple[TensorSpec, ...]
    name: str  # general.name
    moe: bool
    expert_qtype: QType  # ggml type of Role.EXPERT tensors; all others are F32
    seed: int


def _mla_keys(shape: Shape) -> list[Key]:
    """MLA as convert_hf_to_gguf.py writes it: one latent KV head ("MQA") that is decompressed per head."""
    return [
        ("head_count_kv", 1),
        ("q_lora_rank", shape.q_lora_rank),
        ("kv_lora_rank", shape.kv_lora_rank),
        ("key_length", shape.kv_lora_rank + shape.n_rot_mla),
        ("value_length", shape.kv_lora_rank),
        ("key_length_mla", shape.n_embd_head_k_mla),
        ("value_length_mla", shape.n_embd_head_v_mla),
        ("rope_dimension_count", shape.n_rot_mla),
    ]


def _routing_keys(spec: ArchSpec) -> list[Key]:
    """Gating, weight norm and scale, expert groups, MoE interleaving."""
    out: list[Key] = []
    gating = spec.gating_keys
    if gating is not None:
        out += [("expert_gating_func", gating[0]), ("expert_weights_norm", gating[1]),
                ("expert_weights_scale", gating[2])]
    if spec.expert_groups[0]:
        out += [("expert_group_count", spec.expert_groups[0]), ("expert_group_used_count", spec.expert_groups[1])]
    if spec.moe_layer_step:
        out.append(("interleave_moe_layer_step", spec.moe_layer_step))
    return out


def _moe_keys(spec: ArchSpec, shape: Shape) -> list[Key]:
    """The experts' keys: counts, widths, shared experts, dense lead, sliding window, routing."""
    out: list[Key] = [("expert_count", shape.n_expert), ("expert_used_count", spec.n_expert_used or shape.n_expert_used)]
    if spec.expert_ff_key:
        out += [("expert_feed_forward_length", shape.n_ff_exp), ("feed_forward_length", shape.n_ff)]
    else:
        out.append(("feed_forward_length", shape.n_ff_exp))
    if spec.shared_expert in (SharedExpert.GATED, SharedExpert.WIDE):
        out.append(("expert_shared_feed_forward_length", shape.n_ff_shexp))
    if spec.shared_expert is SharedExpert.PLAIN and spec.shared_count_key:
        out.append(("expert_shared_count", shape.n_expert_shared))
    if spec.n_layer_dense_lead:
        out.append(("leading_dense_block_count", spec.n_layer_dense_lead))
    if spec.sliding_window:
        out.append(("sliding_window", spec.sliding_window))
    return out + _routing_keys(spec)


def header_keys(plan: ModelPlan) -> list[Key]:
    """The hparam keys of ``plan``, in file order (the vocabulary follows them: gguf_writer.add_header)."""
    shape, spec = plan.shape, plan.spec
    out: list[Key] = [
        ("name", plan.name),
        ("block_count", shape.n_layer),
        ("context_length", shape.n_ctx_train),
        ("embedding_length", shape.n_embd),
        ("head_count", shape.n_head),
        ("rope_freq_base", shape.rope_freq_base),
        ("layer_norm_rms_eps", shape.rms_eps),
    ]
    if spec.mla:
        out += _mla_keys(shape)
    else:
        out += [("head_count_kv", shape.n_head if spec.mha else shape.n_head_kv),
                ("rope_dimension_count", shape.n_embd_head)]
    return out + (_moe_keys(spec, shape) if plan.moe else [("feed_forward_length", shape.n_ff)])


def _tensors(plan: ModelPlan) -> Iterator[Tensor]:
    """The plan's tensors with seeded random values, drawn in the plan's order."""
    rng = np.random.default_rng(plan.seed)
    for t in plan.tensors:
        qtype = plan.expert_qtype if t.role is Role.EXPERT else QType.F32
        data, raw_dtype = _encode(_random_values(rng, t), qtype)
        yield t.name, data, raw_dtype


def _write_gguf(path: Path, plan: ModelPlan, split_max_tensors: int = 0) -> Path:
    """Write ``plan`` to ``path`` and return it (the first shard's path when split; gguf_writer.write_gguf)."""
    return write_gguf(path, plan.spec.arch_name, header_keys(plan), plan.vocab, _tensors(plan), split_max_tensors)


def rewrite_gguf(src: Path, dst: Path, keys: dict[str, tuple | None] | None = None,
                 tensors: Callable[[dict], Iterator[Tensor]] | None = None) -> Path:
    """A copy of the GGUF ``src`` with some keys replaced or deleted and, optionally, other tensors.

    ``keys``: key -> (value, GGUFValueType, array item type or None), or None to delete the key
    (``general.architecture`` included). ``tensors(reader_tensors_by_name)`` yields what to write instead
    of the original tensors. For tests that need a model one change away from a valid one.
    """
    keys = keys or {}
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    new_arch = keys.get("general.architecture", ("", None, None))
    w = gguf.GGUFWriter(dst, arch=arch if new_arch is None else (new_arch[0] or arch))
    if new_arch is None:
        w.kv_data[0].pop("general.architecture", None)
    done = set()
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        if f.name in keys:
            done.add(f.name)
            if keys[f.name] is not None:
                value, vtype, sub = keys[f.name]
                w.add_key_value(f.name, value, vtype, sub_type=sub)
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for key, change in keys.items():
        if key not in done and key != "general.architecture" and change is not None:
            w.add_key_value(key, change[0], change[1], sub_type=change[2])
    by_name = {t.name: t for t in reader.tensors}
    out = tensors(by_name) if tensors is not None else (
        (t.name, np.asarray(t.data), t.tensor_type) for t in reader.tensors)
    write_out(w, out)
    return dst


def _check_arch(arch: str) -> ArchSpec:
    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown fixture arch {arch!r}; choose from {', '.join(ARCHES)}")
    return ARCH_SPECS[arch]


def _check_expert_type(expert_type: str) -> QType:
    if expert_type not in EXPERT_TYPES:
        raise ValueError(f"unknown expert type {expert_type!r}; choose from {', '.join(EXPERT_TYPES)}")
    return EXPERT_TYPES[expert_type]


def moe_plan(arch: str, expert_type: str = "f16", seed: int = 0, shape: Shape = SHAPE) -> ModelPlan:
    spec = _check_arch(arch)
    vocab = make_vocab()
    return ModelPlan(
        spec=spec,
        shape=shape,
        vocab=vocab,
        tensors=tuple(moe_tensor_specs(spec, shape, vocab.n_vocab)),
        name=f"ggmoe tiny {arch} {expert_type}",
        moe=True,
        expert_qtype=_check_expert_type(expert_type),
        seed=seed,
    )


def dense_plan(seed: int = 0, shape: Shape = SHAPE) -> ModelPlan:
    vocab = make_vocab()
    return ModelPlan(
        spec=ArchSpec(gguf.MODEL_ARCH.LLAMA),
        shape=shape,
        vocab=vocab,
        tensors=tuple(dense_tensor_specs(shape, vocab.n_vocab)),
        name="ggmoe tiny llama dense",
        moe=False,
        expert_qtype=QType.F32,
        seed=seed,
    )


def write_fixture(
    arch: str,
    path: Path,
    expert_type: str = "f16",
    seed: int = 0,
    shape: Shape = SHAPE,
    split_max_tensors: int = 0,
) -> Path:
    """Write the MoE fixture `arch` (one of ARCHES) to `path`; deterministic in its arguments.

    Returns the path written (the first shard's when split_max_tensors > 0).
    """
    return _write_gguf(path, moe_plan(arch, expert_type, seed, shape), split_max_tensors)


def write_dense_fixture(path: Path, seed: int = 0, shape: Shape = SHAPE) -> Path:
    """Write a plain `llama` model without experts (for tests that must reject non-MoE models)."""
    return _write_gguf(path, dense_plan(seed, shape))


# ---------------------------------------------------------------------------
# Cache


def default_cache_dir() -> Path:
    root = os.environ.get("GGMOE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "ggmoe") / "fixtures"


def _cache_key(*args: object) -> str:
    """Hash of the generator's sources (this script, the GGUF writer) and the arguments: editing either
    regenerates fixtures."""
    h = hashlib.sha256(Path(__file__).read_bytes() + Path(gguf_writer.__file__).read_bytes())
    h.update(repr(args).encode())
    return h.hexdigest()[:16]


def _cached(
    stem: str, cache_dir: Path | None, key_args: tuple[object, ...], write: Callable[[Path], Path]
) -> Path:
    path = (cache_dir or default_cache_dir()) / f"{stem}-{_cache_key(*key_args)}.gguf"
    if not path.is_file():
        write(path)
    return path


def fixture_path(arch: str, cache_dir: Path | None = None, expert_type: str = "f16") -> Path:
    """Path of the cached MoE fixture `arch` with experts of `expert_type`, generating it if missing."""
    _check_arch(arch)
    _check_expert_type(expert_type)
    return _cached(
        f"{arch}-{expert_type}",
        cache_dir,
        (arch, expert_type, 0),
        lambda p: write_fixture(arch, p, expert_type=expert_type),
    )


# A ChatML chat template that renders tools and tool calls as Qwen 2.5 / Hermes do (<tools>, <tool_call>).
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}{% continue %}{% endif %}"
    "{%- if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}\n<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tools_fixture_path(cache_dir: Path | None = None) -> Path:
    """The qwen3moe fixture with ``TOOLS_CHAT_TEMPLATE`` as its chat template (tool calling in the server)."""
    return _cached("qwen3moe-tools", cache_dir, ("qwen3moe-tools", 0), lambda p: rewrite_gguf(
        fixture_path("qwen3moe", cache_dir), p,
        {"tokenizer.chat_template": (TOOLS_CHAT_TEMPLATE, gguf.GGUFValueType.STRING, None)}))


# Fill-in-the-middle token ids of the FIM fixture: control bytes that no text prompt contains.
FIM_TOKEN_IDS = {"pre": 1, "suf": 2, "mid": 3, "rep": 4, "sep": 5}


def fim_fixture_path(cache_dir: Path | None = None) -> Path:
    """The qwen3moe fixture with fill-in-the-middle tokens (``/infill``; ``FIM_TOKEN_IDS``, repo-level ones
    included)."""
    keys = {f"tokenizer.ggml.fim_{k}_token_id": (v, gguf.GGUFValueType.UINT32, None)
            for k, v in FIM_TOKEN_IDS.items()}
    return _cached("qwen3moe-fim", cache_dir, ("qwen3moe-fim", 0), lambda p: rewrite_gguf(
        fixture_path("qwen3moe", cache_dir), p, keys))


def dense_fixture_path(cache_dir: Path | None = None) -> Path:
    """Path of the cached non-MoE `llama` fixture, generating it if missing."""
    return _cached(DENSE_NAME, cache_dir, (DENSE_NAME, 0), write_dense_fixture)


# ---------------------------------------------------------------------------
# CLI


def _written(out: Path, archs: Sequence[str], expert_type: str, dense: bool) -> Iterator[Path]:
    for arch in archs:
        yield write_fixture(arch, out / f"{arch}-{expert_type}.gguf", expert_type=expert_type)
    if dense:
        yield write_dense_fixture(out / f"{DENSE_NAME}.gguf")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write tiny random-weight GGUF MoE fixture models.")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--arch", action="append", choices=ARCHES, help="fixture to write (repeatable; default: all)"
    )
    parser.add_argument(
        "--expert-type", choices=tuple(EXPERT_TYPES), default="f16", help="ggml type of expert tensors"
    )
    parser.add_argument("--dense", action="store_true", help=f"also write the non-MoE {DENSE_NAME} model")
    args = parser.parse_args(argv)
    for path in _written(args.out, args.arch or ARCHES, args.expert_type, args.dense):
        print(f"{path}  {path.stat().st_size / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
