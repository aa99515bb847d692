"""Export the trained tiny MoE (tools/tiny_model/train_tiny_moe.py) to GGUF, then quantize it.

    python tools/tiny_model/export_tiny_moe.py --build ~/.cache/ggmoe/tiny-moe [--install]

Writes to the build directory:

- tiny-moe-f32.gguf   every tensor F32 (the reference for the logit match)
- tiny-moe-f16.gguf   2-D tensors F16; norms and ffn_gate_inp stay F32 (as convert_hf_to_gguf does)
- tiny-moe-q8_0.gguf  llama_model_quantize(LLAMA_FTYPE_MOSTLY_Q8_0) of the F32 file
- tiny-moe-q4_k_m.gguf  llama_model_quantize(LLAMA_FTYPE_MOSTLY_Q4_K_M) of the F32 file

Q4_K needs rows (ne0) that are a multiple of 256. ``ffn_gate_exps``, ``ffn_up_exps``,
``attn_*`` and ``token_embd`` have rows of n_embd = 256 and get K quants;
``ffn_down_exps`` has rows of n_ff_exp = 64, so llama.cpp's own fallback turns
its Q4_K into Q5_0 and its Q6_K (the layers Q4_K_M upgrades) into Q8_0. That is
what llama-quantize does to such a model; we keep it rather than use Q4_0 so the
Q4 file has the mixed expert tensor types that real Q4_K_M MoE files have.

``--install`` copies the Q8_0 file to ggmoe/models/tiny-moe.gguf (the F16 file
is about 30 MB, over the 20 MB budget for a file in git).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, models

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from tools.fixtures import gguf_writer  # noqa: E402
from tools.fixtures.gguf_writer import BpeVocab, Key, Tensor, tensor_name  # noqa: E402
from tools.tiny_model.tiny_moe_torch import TinyMoeConfig  # noqa: E402
from tools.tiny_model.train_tiny_moe import EOS_TOKEN, LLAMA_CPP_PRE, build_tokenizer  # noqa: E402

ARCH = gguf.MODEL_ARCH.QWEN3MOE
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "qwen3moe"
REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALLED_MODEL = REPO_ROOT / "ggmoe" / "models" / "tiny-moe.gguf"
MODEL_NAME = "ggmoe tiny-moe"

# Build-directory file names per quant level.
GGUF_FILES = {
    "F32": "tiny-moe-f32.gguf",
    "F16": "tiny-moe-f16.gguf",
    "Q8_0": "tiny-moe-q8_0.gguf",
    "Q4_K_M": "tiny-moe-q4_k_m.gguf",
}


def tensor_map(cfg: TinyMoeConfig) -> dict[str, str]:
    """GGUF tensor name -> torch state-dict key. The numpy layout is the same on both
    sides: torch [out, in] (and [n_expert, out, in]) is ggml ne=[in, out(, n_expert)]."""
    t = gguf.MODEL_TENSOR
    names = {
        tensor_name(t.TOKEN_EMBD): "token_embd.weight",
        tensor_name(t.OUTPUT_NORM): "output_norm.weight",
    }
    for il in range(cfg.n_layer):
        p = f"blocks.{il}."
        names.update(
            {
                tensor_name(t.ATTN_NORM, il): p + "attn_norm.weight",
                tensor_name(t.ATTN_Q, il): p + "attn.wq.weight",
                tensor_name(t.ATTN_K, il): p + "attn.wk.weight",
                tensor_name(t.ATTN_V, il): p + "attn.wv.weight",
                tensor_name(t.ATTN_OUT, il): p + "attn.wo.weight",
                tensor_name(t.ATTN_Q_NORM, il): p + "attn.q_norm.weight",
                tensor_name(t.ATTN_K_NORM, il): p + "attn.k_norm.weight",
                tensor_name(t.FFN_NORM, il): p + "ffn_norm.weight",
                tensor_name(t.FFN_GATE_INP, il): p + "moe.gate_inp.weight",
                tensor_name(t.FFN_GATE_EXP, il): p + "moe.gate_exps",
                tensor_name(t.FFN_UP_EXP, il): p + "moe.up_exps",
                tensor_name(t.FFN_DOWN_EXP, il): p + "moe.down_exps",
            }
        )
    return names


def _keep_f32(name: str, array: np.ndarray) -> bool:
    # 1-D norms and the router stay F32, as llama.cpp's converter writes them.
    return array.ndim == 1 or ".ffn_gate_inp." in name


class TokenizerData(NamedTuple):
    """The GGUF tokenizer fields of a byte-level BPE (tokenizer.ggml.model = gpt2)."""

    tokens: list[str]  # [n_vocab], byte-level unicode strings as in HF vocab
    token_types: list[int]  # [n_vocab], gguf.TokenType values
    merges: list[str]  # "left right", by rank
    eos_id: int

    @classmethod
    def from_hf(cls, tok: Tokenizer) -> TokenizerData:
        vocab = tok.get_vocab(with_added_tokens=True)
        tokens = [""] * len(vocab)
        for text, idx in vocab.items():
            tokens[idx] = text
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        types = [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]
        merges_raw = json.loads(tok.to_str())["model"]["merges"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in merges_raw]
        return cls(tokens, types, merges, tok.token_to_id(EOS_TOKEN))

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader) -> TokenizerData:
        k = gguf.Keys.Tokenizer
        return cls(
            tokens=list(reader.fields[k.LIST].contents()),
            token_types=[int(t) for t in reader.fields[k.TOKEN_TYPE].contents()],
            merges=list(reader.fields[k.MERGES].contents()),
            eos_id=int(reader.fields[k.EOS_ID].contents()),
        )

    def to_hf(self) -> Tokenizer:
        """An HF tokenizer with exactly these tokens and merges and the training pre-tokenizer."""
        vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self.merges]
        tok = build_tokenizer()
        tok.model = models.BPE(vocab=vocab, merges=merges)
        control = [t for t, ty in zip(self.tokens, self.token_types, strict=True) if ty == gguf.TokenType.CONTROL]
        tok.add_special_tokens(control)
        return tok

    def vocab(self) -> BpeVocab:
        """The GGUF vocabulary: the qwen2 pre-tokenizer, and as Qwen's, <|endoftext|> serves as BOS, EOS and
        padding, no BOS added."""
        return BpeVocab(self.tokens, self.token_types, self.merges, bos_id=self.eos_id, eos_id=self.eos_id,
                        pre=LLAMA_CPP_PRE, pad_id=self.eos_id, add_bos=False)


def header_keys(cfg: TinyMoeConfig, f16: bool) -> list[Key]:
    """The hparam keys, in file order (the vocabulary follows them)."""
    return [
        ("name", MODEL_NAME),
        ("file_type", gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32),
        ("context_length", cfg.n_ctx_train),
        ("embedding_length", cfg.n_embd),
        ("block_count", cfg.n_layer),
        # The width of the FFN a token actually uses; llama.cpp falls back to
        # n_ff / n_expert_used when expert_feed_forward_length is missing.
        ("feed_forward_length", cfg.n_ff_exp * cfg.n_expert_used),
        ("expert_feed_forward_length", cfg.n_ff_exp),
        ("head_count", cfg.n_head),
        ("head_count_kv", cfg.n_head_kv),
        ("key_length", cfg.head_dim),
        ("value_length", cfg.head_dim),
        ("rope_freq_base", cfg.rope_freq_base),
        ("layer_norm_rms_eps", cfg.rms_norm_eps),
        ("expert_count", cfg.n_expert),
        ("expert_used_count", cfg.n_expert_used),
    ]


def _tensors(cfg: TinyMoeConfig, state: dict[str, torch.Tensor], f16: bool) -> Iterator[Tensor]:
    for name, key in tensor_map(cfg).items():
        array = state[key].detach().to(torch.float32).numpy()
        if f16 and not _keep_f32(name, array):
            array = array.astype(np.float16)
        yield name, np.ascontiguousarray(array), None


def write_gguf(
    path: Path, cfg: TinyMoeConfig, state: dict[str, torch.Tensor], tok: TokenizerData, f16: bool
) -> None:
    """The model as a GGUF of F32 tensors, or F16 where llama.cpp's converter writes F16 (``f16``)."""
    gguf_writer.write_gguf(path, ARCH_NAME, header_keys(cfg, f16), tok.vocab(), _tensors(cfg, state, f16))


def _field(reader: gguf.GGUFReader, key: str) -> int | float:
    return reader.fields[key.format(arch=ARCH_NAME)].contents()


def config_from_reader(reader: gguf.GGUFReader) -> TinyMoeConfig:
    k = gguf.Keys
    return TinyMoeConfig(
        n_vocab=len(reader.fields[k.Tokenizer.LIST].data),
        n_embd=int(_field(reader, k.LLM.EMBEDDING_LENGTH)),
        n_layer=int(_field(reader, k.LLM.BLOCK_COUNT)),
        n_head=int(_field(reader, k.Attention.HEAD_COUNT)),
        n_head_kv=int(_field(reader, k.Attention.HEAD_COUNT_KV)),
        head_dim=int(_field(reader, k.Attention.KEY_LENGTH)),
        n_expert=int(_field(reader, k.LLM.EXPERT_COUNT)),
        n_expert_used=int(_field(reader, k.LLM.EXPERT_USED_COUNT)),
        n_ff_exp=int(_field(reader, k.LLM.EXPERT_FEED_FORWARD_LENGTH)),
        n_ctx_train=int(_field(reader, k.LLM.CONTEXT_LENGTH)),
        rope_freq_base=float(_field(reader, k.Rope.FREQ_BASE)),
        rms_norm_eps=float(_field(reader, k.Attention.LAYERNORM_RMS_EPS)),
    )


def read_gguf(path: Path) -> tuple[TinyMoeConfig, dict[str, torch.Tensor], TokenizerData]:
    """Torch weights back from a tiny-moe GGUF of any type (quantized tensors dequantized
    to F32): the inverse of write_gguf, so a torch model can be rebuilt from the shipped file."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    if arch != ARCH_NAME:
        raise ValueError(f"{path} is a {arch!r} model, expected {ARCH_NAME!r}")
    cfg = config_from_reader(reader)
    to_key = tensor_map(cfg)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # t.shape is ggml ne (innermost first); numpy order is its reverse.
        state[to_key[t.name]] = torch.from_numpy(array.reshape(tuple(int(n) for n in reversed(t.shape))))
    missing = set(to_key.values()) - set(state)
    if missing:
        raise ValueError(f"{path} lacks tensors for {sorted(missing)}")
    return cfg, state, TokenizerData.from_reader(reader)


def quantize(src: Path, dst: Path, ftype: int, threads: int = 2) -> None:
    import llama_cpp  # local: exporting F32/F16 does not need the engine

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {dst.name}) failed with {rc}")


def export_all(build: Path) -> dict[str, Path]:
    ckpt = torch.load(build / "checkpoint.pt", map_location="cpu", weights_only=True)
    cfg = TinyMoeConfig(**ckpt["config"])
    tok = TokenizerData.from_hf(Tokenizer.from_file(str(build / "tokenizer.json")))
    paths = {level: build / name for level, name in GGUF_FILES.items()}
    write_gguf(paths["F32"], cfg, ckpt["state_dict"], tok, f16=False)
    write_gguf(paths["F16"], cfg, ckpt["state_dict"], tok, f16=True)
    import llama_cpp

    quantize(paths["F32"], paths["Q8_0"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
    quantize(paths["F32"], paths["Q4_K_M"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=Path("~/.cache/ggmoe/tiny-moe").expanduser())
    parser.add_argument("--install", action="store_true", help=f"copy the Q8_0 file to {INSTALLED_MODEL}")
    args = parser.parse_args()
    paths = export_all(args.build)
    for level, path in paths.items():
        print(f"{level:7s} {path}  {path.stat().st_size / 2**20:.2f} MiB")
    if args.install:
        INSTALLED_MODEL.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(paths["Q8_0"], INSTALLED_MODEL)
        print(f"installed {INSTALLED_MODEL}")


if __name__ == "__main__":
    main()
