"""Verify the exported tiny MoE against the torch model it came from.

    python tools/tiny_model/verify_tiny_moe.py --build ~/.cache/ggmoe/tiny-moe

Checks, on held-out documents (tools/tiny_model/corpus.py, split "heldout", never trained on):

1. tokenization: llama.cpp (``tokenizer.ggml.pre = qwen2``) gives the same ids
   as the HF tokenizer used in training, and detokenizes back to the text;
2. logit match: llama.cpp logits (every position, ``logits_all``) of the F32
   and F16 GGUFs against the torch model's fp32 logits: max |diff| and top-1
   agreement (the acceptance bar is >= 99 % for F32 and F16);
3. held-out perplexity per quant level (torch fp32, F32, F16, Q8_0, Q4_K_M);
4. greedy generation from a code prompt and an English prompt (llama.cpp on
   the F32 file vs torch must agree token for token; Q8_0 shown too).

Each document is evaluated from an empty KV cache, truncated to ``--max-tokens``
(the training context, 512). The KV cache is kept in F32 so that the logit
match measures the model's arithmetic, not the cache's F16 rounding.
Results go to ``<build>/verify.json`` and are printed as tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from tools.tiny_model.corpus import DOMAINS, documents  # noqa: E402
from tools.tiny_model.export_tiny_moe import GGUF_FILES  # noqa: E402
from tools.tiny_model.tiny_moe_torch import TinyMoe, TinyMoeConfig  # noqa: E402

CODE_PROMPT = 'def read_config(path):\n    """Read the configuration file at path and return a dict."""\n'
PROSE_PROMPT = "The program reads its input from standard input and"
MIN_DOC_TOKENS = 64  # shorter held-out documents are skipped: too little context to score


def open_llama(path: Path, n_ctx: int, threads: int = 2):  # -> llama_cpp.Llama
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        verbose=False,
    )


def llama_tokenize(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


def llama_logits(llm, tokens: Sequence[int]) -> np.ndarray:
    """Logits [n_tokens, n_vocab] for every position, from an empty KV cache."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


@torch.no_grad()
def torch_logits(model: TinyMoe, tokens: Sequence[int]) -> np.ndarray:
    logits, _, _ = model(torch.tensor([list(tokens)], dtype=torch.int64))
    return logits[0].float().numpy()


def nll_sum(logits: np.ndarray, tokens: Sequence[int]) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) of tokens[1:] and its count."""
    x = logits[:-1].astype(np.float64)
    m = x.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]
    target = np.asarray(tokens[1:])
    return float((logz - x[np.arange(len(target)), target]).sum()), len(target)


def eval_set(llm, n_docs: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """Held-out documents per domain, tokenized by llama.cpp and cut to max_tokens."""
    out: dict[str, list[list[int]]] = {}
    for domain in DOMAINS:
        docs: list[list[int]] = []
        for text in documents("heldout", domain, max_chars=max_tokens * 8):
            ids = llama_tokenize(llm, text)[:max_tokens]
            if len(ids) >= MIN_DOC_TOKENS:
                docs.append(ids)
            if len(docs) == n_docs:
                break
        out[domain] = docs
    return out


def check_tokenization(llm, tok: Tokenizer, n_docs: int, max_chars: int) -> dict[str, float]:
    """Fraction of held-out documents where llama.cpp and HF give identical ids, and where
    llama.cpp detokenizes its ids back to the exact text."""
    same = round_trip = total = 0
    for domain in DOMAINS:
        for text in documents("heldout", domain, max_chars=max_chars)[:n_docs]:
            ids = llama_tokenize(llm, text)
            same += ids == tok.encode(text, add_special_tokens=False).ids
            round_trip += llm.detokenize(ids).decode("utf-8", errors="replace") == text
            total += 1
    return {"docs": total, "ids_equal": same / total, "round_trip": round_trip / total}


def compare_logits(ref: list[np.ndarray], got: list[np.ndarray]) -> dict[str, float]:
    """max |diff| over all logits; p99: 99th percentile over positions of a position's max |diff|
    (a router near-tie that flips one expert moves a few positions a lot, the rest not at all)."""
    per_pos = np.concatenate([np.abs(r - g).max(-1) for r, g in zip(ref, got, strict=True)])
    agree = sum(int((r.argmax(-1) == g.argmax(-1)).sum()) for r, g in zip(ref, got, strict=True))
    return {
        "max_abs_diff": float(per_pos.max()),
        "p99_abs_diff": float(np.percentile(per_pos, 99)),
        "top1_agreement": agree / len(per_pos),
        "positions": int(len(per_pos)),
    }


def perplexity(logits: list[np.ndarray], docs: list[list[int]]) -> float:
    total, count = 0.0, 0
    for lg, ids in zip(logits, docs, strict=True):
        s, n = nll_sum(lg, ids)
        total, count = total + s, count + n
    return float(np.exp(total / count))


def greedy_llama(llm, prompt: list[int], n_new: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n_new):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    return out


@torch.no_grad()
def greedy_torch(model: TinyMoe, prompt: list[int], n_new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n_new):
        ids.append(int(torch_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def load_checkpoint(build: Path) -> TinyMoe:
    ckpt = torch.load(build / "checkpoint.pt", map_location="cpu", weights_only=True)
    model = TinyMoe(TinyMoeConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=Path("~/.cache/ggmoe/tiny-moe").expanduser())
    parser.add_argument("--docs", type=int, default=64, help="held-out documents per domain")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per document (context)")
    parser.add_argument("--gen-tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


Scores = dict[str, dict[str, float]]  # level -> domain -> perplexity
Matches = dict[str, dict[str, dict[str, float]]]  # level -> domain -> compare_logits figures


def score_levels(
    args: argparse.Namespace, model: TinyMoe, levels: dict[str, Path], f32_llm, docs: dict[str, list[list[int]]]
) -> tuple[Scores, Matches]:
    """Perplexity of torch and of every quant level, and each level's logits against torch's.

    f32_llm is the F32 file already opened for tokenization; it is reused rather than loaded twice."""
    ref = {d: [torch_logits(model, ids) for ids in docs[d]] for d in DOMAINS}
    ppl: Scores = {"torch": {d: perplexity(ref[d], docs[d]) for d in DOMAINS}}
    match: Matches = {}
    for level, path in levels.items():
        llm = f32_llm if level == "F32" else open_llama(path, args.max_tokens, args.threads)
        got = {d: [llama_logits(llm, ids) for ids in docs[d]] for d in DOMAINS}
        ppl[level] = {d: perplexity(got[d], docs[d]) for d in DOMAINS}
        match[level] = {d: compare_logits(ref[d], got[d]) for d in DOMAINS}
        print(f"{level}: perplexity {ppl[level]}, logit match {match[level]}", flush=True)
    return ppl, match


def greedy_generations(
    args: argparse.Namespace, model: TinyMoe, tok: Tokenizer, f32_llm, q8_path: Path
) -> dict[str, dict[str, object]]:
    """Greedy continuations of a code and a prose prompt: torch and F32 must agree token for token;
    Q8_0 is shown so a reader can see what quantization does to the text."""
    generations: dict[str, dict[str, object]] = {}
    for name, prompt_text in (("code", CODE_PROMPT), ("prose", PROSE_PROMPT)):
        prompt = tok.encode(prompt_text, add_special_tokens=False).ids
        by_torch = greedy_torch(model, prompt, args.gen_tokens)
        by_f32 = greedy_llama(f32_llm, prompt, args.gen_tokens)
        q8 = open_llama(q8_path, args.max_tokens, args.threads)
        by_q8 = greedy_llama(q8, prompt, args.gen_tokens)
        generations[name] = {
            "prompt": prompt_text,
            "torch": tok.decode(by_torch),
            "f32_equals_torch": by_f32 == by_torch,
            "q8_0": tok.decode(by_q8),
        }
    return generations


def print_report(ppl: Scores, match: Matches, generations: dict[str, dict[str, object]], seconds: float) -> None:
    """The results as a markdown table, one row per level, then the generations (docs/tiny-model.md quotes them)."""
    print("\n| level | ppl code | ppl prose | max abs diff (code/prose) | p99 abs diff (code/prose) "
          "| top-1 agreement (code/prose) |")
    print("|---|---|---|---|---|---|")
    print(f"| torch fp32 | {ppl['torch']['code']:.3f} | {ppl['torch']['prose']:.3f} | - | - | - |")
    for level in GGUF_FILES:
        m = match[level]
        print(
            f"| {level} | {ppl[level]['code']:.3f} | {ppl[level]['prose']:.3f} | "
            f"{m['code']['max_abs_diff']:.2e} / {m['prose']['max_abs_diff']:.2e} | "
            f"{m['code']['p99_abs_diff']:.2e} / {m['prose']['p99_abs_diff']:.2e} | "
            f"{100 * m['code']['top1_agreement']:.3f}% / {100 * m['prose']['top1_agreement']:.3f}% |"
        )
    for name, g in generations.items():
        print(f"\n[{name}] prompt: {g['prompt']!r}\n  torch: {g['torch']!r}\n  F32 == torch: {g['f32_equals_torch']}\n  Q8_0:  {g['q8_0']!r}")
    print(f"\n{seconds:.0f} s")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()

    model = load_checkpoint(args.build)
    tok = Tokenizer.from_file(str(args.build / "tokenizer.json"))
    levels = {level: args.build / name for level, name in GGUF_FILES.items()}
    results: dict[str, object] = {"build": str(args.build), "docs_per_domain": args.docs, "max_tokens": args.max_tokens}

    # The F32 file serves tokenization, the F32 logits and the F32 generations: open it once.
    f32_llm = open_llama(levels["F32"], args.max_tokens, args.threads)
    results["tokenization"] = check_tokenization(f32_llm, tok, n_docs=200, max_chars=20_000)
    print("tokenization:", results["tokenization"], flush=True)
    docs = eval_set(f32_llm, args.docs, args.max_tokens)
    results["eval_tokens"] = {d: sum(len(x) for x in docs[d]) for d in DOMAINS}
    ppl, match = score_levels(args, model, levels, f32_llm, docs)
    results["perplexity"], results["logit_match"] = ppl, match
    generations = greedy_generations(args, model, tok, f32_llm, levels["Q8_0"])
    results["greedy"] = generations
    results["seconds"] = seconds = time.time() - t0
    (args.build / "verify.json").write_text(json.dumps(results, indent=2) + "\n")
    print_report(ppl, match, generations, seconds)


if __name__ == "__main__":
    main()
