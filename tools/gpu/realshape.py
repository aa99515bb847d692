#!/usr/bin/env python3
"""Random-weight GGUF MoE models with real shapes and real quant types, written in seconds.

Quantizing billions of random floats would take hours; this writes the quant
blocks directly: a valid scale per block (chosen so every matmul keeps unit
activations, as a trained model roughly does) and a random payload. The model
loads and runs in llama.cpp like any other: every kernel, copy and sync is
real; only the text is noise, and the routing nearly uniform (the benchmark's
trace-replay routing mode replaces it by real routing).

Presets (architecture qwen3moe, whose MoE llama.cpp runs like the originals', unless named):

    gpt-oss-20b    24 layers, n_embd 2880, 32 experts of width 2880, top-4; experts MXFP4 (gpt-oss's own
                   expert type: 2880 is not a multiple of Q4_K's 256-element block), ~10 GB
    qwen3-30b-a3b  48 layers, n_embd 2048, 128 experts of width 768, top-8; experts Q4_K, ~16 GB
    deepseek-v2-lite  27 layers (layer 0 dense), n_embd 2048, MLA, 64 experts of width 1408 + 2 shared, top-6;
                   experts Q4_K, ffn_down Q5_0 (architecture deepseek2, softmax router), ~10 GB: the shape of
                   the shared real routing (../shared/real-routing)
    toy            4 layers, n_embd 256, 32 experts of width 512, top-4; experts Q4_K (CI, the smoke run; 512
                   neurons: two Q4_K blocks of 256, so MoEpic's split at θ 1/2 fits the down tensor's blocks)
    toy-mxfp4      4 layers, n_embd 320, 32 experts of width 320, top-4; experts MXFP4 (CI)

Attention and the other dense matrices are Q8_0, norms and the router F32; heads are 64 wide. The
vocabulary is the fixtures' 270-token byte-level BPE: the output head is small (a real 150-200k vocab
adds the same time to every configuration of a benchmark).

Usage:
    python tools/gpu/realshape.py --preset gpt-oss-20b -o /tmp/models/gpt-oss-shape.gguf
    python tools/gpu/realshape.py --preset qwen3-30b-a3b --header-only -o /tmp/models/q3.gguf   # sparse: for
                                                                  # inspect, plan --gpu and simulate, in 0.1 s
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from tools.fixtures.gguf_writer import add_header  # noqa: E402
from tools.fixtures.make_fixtures import (  # noqa: E402
    ARCH_SPECS,
    ModelPlan,
    Role,
    Shape,
    TensorSpec,
    header_keys,
    make_vocab,
    moe_tensor_specs,
)

QType = gguf.GGMLQuantizationType
ROUTER_LOGIT_STD = 2.4  # router logits' std: sharp enough that top-k depends on the token (as the fixtures)


@dataclass(frozen=True)
class Preset:
    shape: Shape
    expert_type: QType
    what: str  # one line for the docs and the results
    arch: str = "qwen3moe"  # a key of ARCH_SPECS, or "deepseek2-softmax" (DeepSeek-V2's softmax router)
    down_type: QType | None = None  # ffn_down_exps' type where its rows do not fit expert_type's block
    # std factor of the matrices whose output adds to the residual stream (attention's output, every FFN's
    # down): GPT-2's 1/sqrt(2 n_layer) keeps each token's own embedding in the router's input at depth, so
    # routing stays spread over the experts; at 1 a deep random model routes most tokens to a few experts
    residual_std: float = 1.0


PRESETS: dict[str, Preset] = {
    "gpt-oss-20b": Preset(Shape(n_layer=24, n_embd=2880, n_head=45, n_head_kv=9, n_ff_exp=2880, n_ff=2880,
                                n_expert=32, n_expert_used=4, n_ctx_train=4096), QType.MXFP4,
                          "gpt-oss-20b's MoE shape: 24 layers, n_embd 2880, 32 experts x 2880, top-4, MXFP4"),
    "qwen3-30b-a3b": Preset(Shape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, n_ff_exp=768, n_ff=768,
                                  n_expert=128, n_expert_used=8, n_ctx_train=4096), QType.Q4_K,
                            "Qwen3-30B-A3B's MoE shape: 48 layers, n_embd 2048, 128 experts x 768, top-8, Q4_K"),
    # DeepSeek-V2-Lite (huggingface.co/deepseek-ai/DeepSeek-V2-Lite, config.json): 27 layers, layer 0 dense
    # (intermediate 10944), n_embd 2048, 16 heads, MLA (kv_lora_rank 512, rope 64, nope 128, v 128; Lite has no
    # q_lora: a rank of 1536 stands for its 2048x3072 q projection), 64 routed experts x 1408 + 2 shared,
    # top-6. Experts Q4_K with ffn_down in Q5_0 (1408 is not a multiple of Q4_K's 256: llama.cpp's
    # quantizer falls back so), ~10 GB as a Q4_K_M file of it is. The shared routing of
    # /work/shared/real-routing is this model's.
    "deepseek-v2-lite": Preset(Shape(n_layer=27, n_embd=2048, n_head=16, n_head_kv=16, n_ff_exp=1408, n_ff=10944,
                                     n_expert=64, n_expert_used=6, n_expert_shared=2, n_ctx_train=32768,
                                     q_lora_rank=1536, kv_lora_rank=512, n_rot_mla=64, n_embd_head_qk_nope=128,
                                     n_embd_head_v_mla=128),
                               QType.Q4_K, "DeepSeek-V2-Lite's shape: 27 layers (1 dense), n_embd 2048, 64 experts x "
                               "1408 + 2 shared, top-6, Q4_K (down Q5_0)", arch="deepseek2-softmax",
                               down_type=QType.Q5_0),
    "toy": Preset(Shape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=512, n_ff=256, n_expert=32,
                        n_expert_used=4, n_ctx_train=2048), QType.Q4_K,
                  "toy: 4 layers, n_embd 256, 32 experts x 512, top-4, Q4_K"),
    "toy-mxfp4": Preset(Shape(n_layer=4, n_embd=320, n_head=5, n_head_kv=1, n_ff_exp=320, n_ff=320, n_expert=32,
                              n_expert_used=4, n_ctx_train=2048), QType.MXFP4,
                        "toy-mxfp4: 4 layers, n_embd 320 (not a multiple of 256), 32 experts x 320, top-4, MXFP4"),
}

# --------------------------------------------------------------------------- quant blocks

POOL_BYTES = 64 << 20  # random bytes drawn once; tensors copy slices of it at random offsets


class Payload:
    """Random bytes at memcpy speed: numpy's generators give ~0.3 GB/s, a 10 GB model needs more.

    Payloads repeat (a tensor is a slice of one pool at a random offset): for timing, a weight's value
    does not matter, only that it is a valid number of the format.
    """

    def __init__(self, rng: np.random.Generator, pool_bytes: int = POOL_BYTES) -> None:
        self.rng = rng
        self.pool = rng.integers(0, 256, size=pool_bytes, dtype=np.uint8)
        self._buf = np.empty(0, dtype=np.uint8)  # reused: fresh pages cost more than the copy

    def take(self, n: int) -> np.ndarray:
        """``n`` random bytes, writable, valid until the next ``take`` (one tensor at a time)."""
        if self._buf.size < n:
            self._buf = np.empty(n, dtype=np.uint8)
        out = self._buf[:n]
        pos = 0
        while pos < n:
            off = int(self.rng.integers(0, self.pool.size))
            k = min(n - pos, self.pool.size - off)
            out[pos:pos + k] = self.pool[off:off + k]
            pos += k
        return out


def _f16_bytes(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)


def q8_0_blocks(n_blocks: int, std: float, payload: Payload) -> np.ndarray:
    """[n_blocks, 34] uint8: f16 d, 32 int8 q; value = d * q, uniform q of std ~73.3."""
    b = payload.take(n_blocks * 34).reshape(n_blocks, 34)
    b[:, 0:2] = _f16_bytes(std / 73.3)
    q = b[:, 2:].view(np.int8)
    q[q == -128] = -127  # int8 range of the format
    return b


def q4_k_blocks(n_blocks: int, std: float, payload: Payload) -> np.ndarray:
    """[n_blocks, 144] uint8: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.

    value = d * sc * q - dmin * m with random sc, m in [0, 63] and q in [0, 15]: dmin = 7.5 d centres the
    values, and their std is then about 258 d.
    """
    b = payload.take(n_blocks * 144).reshape(n_blocks, 144)
    d = std / 258.0
    b[:, 0:2] = _f16_bytes(d)
    b[:, 2:4] = _f16_bytes(7.5 * d)
    return b


def mxfp4_blocks(n_blocks: int, std: float, payload: Payload) -> np.ndarray:
    """[n_blocks, 17] uint8: an e8m0 scale, then 32 FP4 (e2m1) nibbles; value = kvalue * 2^(e - 128).

    Uniform random nibbles give kvalues (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) of std about 5.85.
    """
    b = payload.take(n_blocks * 17).reshape(n_blocks, 17)
    b[:, 0] = int(np.clip(round(128 + math.log2(std / 5.85)), 1, 254))
    return b


BLOCKS = {QType.Q8_0: q8_0_blocks, QType.Q4_K: q4_k_blocks, QType.MXFP4: mxfp4_blocks}

# --------------------------------------------------------------------------- tensors


def tensor_type(t: TensorSpec, expert_type: QType, down_type: QType | None = None) -> QType:
    if t.role is Role.EXPERT:
        return down_type if down_type is not None and "ffn_down" in t.name else expert_type
    if t.role in (Role.NORM, Role.ROUTER, Role.BIAS) or len(t.ne) == 1:
        return QType.F32
    return QType.Q8_0


def tensor_std(t: TensorSpec) -> float:
    """Per-weight std that keeps unit activations: 1/sqrt(n_in); embeddings 1; the router sharper."""
    if t.role is Role.EMBD:
        return 1.0
    if t.role is Role.ROUTER:
        return ROUTER_LOGIT_STD / math.sqrt(t.ne[0])
    return 1.0 / math.sqrt(t.ne[0])


def tensor_bytes(t: TensorSpec, qtype: QType) -> int:
    n = int(np.prod(t.ne))
    if qtype is QType.F32:
        return 4 * n
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if t.ne[0] % block:
        raise ValueError(f"{t.name}: rows of {t.ne[0]} are not a multiple of {qtype.name}'s block of {block}")
    return n // block * size


def adds_to_residual(t: TensorSpec) -> bool:
    """Whether the matrix's output adds to the residual stream: attention's output, every FFN's down."""
    return t.name.endswith("attn_output.weight") or ".ffn_down" in t.name


def tensor_data(t: TensorSpec, qtype: QType, rng: np.random.Generator, payload: Payload,
                std_scale: float = 1.0) -> np.ndarray:
    """The tensor's bytes (uint8 [rows, row bytes]) or float32 values (numpy shape = reversed ne); its std is
    ``tensor_std(t) * std_scale``."""
    std = tensor_std(t) * std_scale
    if qtype is QType.F32:
        if t.role is Role.NORM:
            return np.ones(tuple(reversed(t.ne)), dtype=np.float32)
        return (rng.standard_normal(tuple(reversed(t.ne)), dtype=np.float32) * std).astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(t.ne)) // block
    blocks = BLOCKS[qtype](n_blocks, std, payload)
    rows = int(np.prod(t.ne[1:]))
    return blocks.reshape(rows, n_blocks // rows * size)


# --------------------------------------------------------------------------- writing


def plan_for(preset: str | Preset, seed: int = 0, label: str | None = None) -> tuple[ModelPlan, Preset]:
    """The model plan of a preset, by name or given whole (``label`` names a given one in general.name)."""
    if isinstance(preset, Preset):
        p, preset = preset, label or "custom"
    elif preset not in PRESETS:
        raise SystemExit(f"error: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    else:
        p = PRESETS[preset]
    spec = ARCH_SPECS.get(p.arch) or dataclasses.replace(ARCH_SPECS["deepseek2"], router_bias=False)
    vocab = make_vocab()
    plan = ModelPlan(spec=spec, shape=p.shape, vocab=vocab,
                     tensors=tuple(moe_tensor_specs(spec, p.shape, vocab.n_vocab)),
                     name=f"ggmoe real-shape {preset} (random weights)", moe=True, expert_qtype=p.expert_type,
                     seed=seed)
    return plan, p


def write_model(preset: str | Preset, out: Path, seed: int = 0, header_only: bool = False,
                progress: Callable[[int, int], None] | None = None,
                label: str | None = None) -> tuple[Path, int, float]:
    """Write the preset (a name or a ``Preset``) to ``out`` (atomically); returns (path, bytes, seconds).
    ``header_only``: the header and tensor infos, then a sparse hole of the data's size (zeros; for inspect,
    plan and simulate, which read headers only; seconds instead of minutes, no disk used). ``progress(done,
    total)`` (tensor bytes) is called after each tensor: one tensor at a time is in memory, so a model larger
    than RAM streams to disk."""
    t0 = time.monotonic()
    plan, p = plan_for(preset, seed, label)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    types = [tensor_type(t, p.expert_type, p.down_type) for t in plan.tensors]
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch=plan.spec.arch_name)
        add_header(w, header_keys(plan), plan.vocab)
        for t, q in zip(plan.tensors, types, strict=True):
            shape = tuple(reversed(t.ne))  # numpy order, as add_tensor would take it
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), tensor_bytes(t, q),
                              raw_dtype=None if q is QType.F32 else q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if header_only:
            w.close()
            _sparse_data(Path(tmp), sum(_padded(tensor_bytes(t, q), w.data_alignment)
                                        for t, q in zip(plan.tensors, types, strict=True)), w.data_alignment)
        else:
            payload = Payload(rng, min(POOL_BYTES, max(1 << 20, sum(tensor_bytes(t, q)
                                                                    for t, q in zip(plan.tensors, types, strict=True)))))
            total, done = sum(tensor_bytes(t, q) for t, q in zip(plan.tensors, types, strict=True)), 0
            for t, q in zip(plan.tensors, types, strict=True):
                w.write_tensor_data(tensor_data(t, q, rng, payload, p.residual_std if adds_to_residual(t) else 1.0))
                done += tensor_bytes(t, q)
                if progress is not None:
                    progress(done, total)
            w.close()
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out, out.stat().st_size, time.monotonic() - t0


def _padded(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _sparse_data(path: Path, data_bytes: int, align: int) -> None:
    """Pad the header to the data alignment and extend the file by the tensors' bytes as a hole."""
    with path.open("r+b") as f:
        f.seek(0, os.SEEK_END)
        f.truncate(_padded(f.tell(), align) + data_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("-o", "--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--header-only", action="store_true",
                    help="header and tensor infos, the data a sparse hole of zeros (inspect, plan, simulate)")
    a = ap.parse_args(argv)
    path, nbytes, secs = write_model(a.preset, a.out, a.seed, a.header_only)
    print(f"wrote {path}: {nbytes / 2**30:.2f} GiB in {secs:.1f} s ({PRESETS[a.preset].what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
