"""Train the embedded default model: a tiny qwen3moe LM on offline code and English prose.

Run (about 35 min on 2 CPU cores; heavy, so serialise it with the other heavy jobs):

    flock /tmp/ggmoe-heavy.lock python tools/tiny_model/train_tiny_moe.py --out ~/.cache/ggmoe/tiny-moe
    python tools/tiny_model/export_tiny_moe.py --build ~/.cache/ggmoe/tiny-moe --install
    python tools/tiny_model/verify_tiny_moe.py --build ~/.cache/ggmoe/tiny-moe

Steps:
1. Byte-level BPE tokenizer (HF ``tokenizers``) trained on a seeded sample of the
   training split, with the Qwen2 pre-tokenizer regex, which llama.cpp knows as
   ``tokenizer.ggml.pre = "qwen2"``, so llama.cpp tokenizes text exactly as here.
2. Token streams: every training document, documents joined by ``<|endoftext|>``,
   one stream per domain (code, prose).
3. AdamW on random windows of ``--seq`` tokens, half code and half prose per
   batch, the window offsets drawn from a numpy Generator seeded by ``--seed``.
   Loss = next-token cross entropy + ``--aux-coef`` x the mean over layers of the
   Switch/Qwen load-balancing loss (1.0 when routing is uniform).

Writes to ``--out``: tokenizer.json, checkpoint.pt (fp32 state dict, config,
arguments, metrics), train_log.jsonl (one line per logged step) and summary.json.
Everything is deterministic for a given seed, corpus (see tools/tiny_model/corpus.py
fingerprints, logged in summary.json) and torch version on a 2-thread CPU run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from tools.tiny_model.corpus import DOMAINS, corpus_fingerprint, documents  # noqa: E402
from tools.tiny_model.tiny_moe_torch import TinyMoe, TinyMoeConfig, load_balancing_loss  # noqa: E402

EOS_TOKEN = "<|endoftext|>"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 regex (src/llama-vocab.cpp), i.e. Qwen2's
# tokenizer.json Split pattern: single digits, letters with one leading non-letter.
QWEN2_PRETOKENIZER_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_CPP_PRE = "qwen2"  # tokenizer.ggml.pre value selecting the regex above
# Characters of training text per domain fed to the BPE trainer (enough for stable merges).
TOKENIZER_SAMPLE_CHARS = 8_000_000
TOKENIZER_DOC_CHARS = 20_000  # at most this much of any one document in that sample


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    rng = np.random.default_rng(seed)
    sample: list[str] = []
    for domain in DOMAINS:
        docs = documents("train", domain)
        used = 0
        for i in rng.permutation(len(docs)):
            text = docs[i][:TOKENIZER_DOC_CHARS]
            sample.append(text)
            used += len(text)
            if used >= TOKENIZER_SAMPLE_CHARS:
                break
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    return tok


def token_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """All documents as one uint16 token array, each followed by the EOS token."""
    eos = tok.token_to_id(EOS_TOKEN)
    parts: list[np.ndarray] = []
    for start in range(0, len(docs), 256):
        for enc in tok.encode_batch(docs[start : start + 256], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts)


def eval_windows(stream: np.ndarray, seq: int, n: int) -> torch.Tensor:
    """n windows of seq+1 tokens at evenly spaced offsets: a fixed evaluation batch."""
    offsets = np.linspace(0, len(stream) - seq - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[o : o + seq + 1] for o in offsets]).astype(np.int64))


@torch.no_grad()
def eval_loss(model: TinyMoe, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits, _, _ = model(w[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def keep_freed_memory() -> None:
    """Stop glibc from returning freed tensor memory to the kernel after every step.

    Re-faulting fresh pages every step cost about 10 % of the step time on the
    2-core VM (and far more in the first steps). The values are bytes: mmap only blocks >= 32 MiB (glibc's maximum), trim the heap
    only past 16 GiB, grow it 256 MiB at a time.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 16 << 30)
    libc.mallopt(m_top_pad, 256 << 20)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("~/.cache/ggmoe/tiny-moe").expanduser())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, half code, half prose")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=40, help="warm-up steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--n-layer", type=int, default=TinyMoeConfig.n_layer)
    parser.add_argument("--n-expert", type=int, default=TinyMoeConfig.n_expert)
    parser.add_argument("--n-expert-used", type=int, default=TinyMoeConfig.n_expert_used)
    parser.add_argument("--n-ff-exp", type=int, default=TinyMoeConfig.n_ff_exp)
    parser.add_argument("--n-embd", type=int, default=TinyMoeConfig.n_embd)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows per domain")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def make_deterministic(args: argparse.Namespace) -> None:
    """Pin threads and seeds before anything draws a random number, so a run repeats bit for bit."""
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # HF tokenizers' thread pool
    args.out.mkdir(parents=True, exist_ok=True)


@dataclass
class Corpus:
    """The tokenized corpus: streams to draw training windows from, fixed held-out windows to score."""

    tok: Tokenizer
    train_streams: dict[str, np.ndarray]
    heldout_eval: dict[str, torch.Tensor]


def prepare_corpus(args: argparse.Namespace) -> Corpus:
    """Train and save the tokenizer, then tokenize both splits (the held-out split only for scoring)."""
    print("training the tokenizer ...", flush=True)
    tok = train_tokenizer(args.vocab, args.seed)
    tok.save(str(args.out / "tokenizer.json"))

    print("tokenizing the corpus ...", flush=True)
    train_streams = {d: token_stream(tok, documents("train", d)) for d in DOMAINS}
    heldout_streams = {d: token_stream(tok, documents("heldout", d)) for d in DOMAINS}
    heldout_eval = {d: eval_windows(s, args.seq, args.eval_windows) for d, s in heldout_streams.items()}
    for d in DOMAINS:
        print(f"  {d}: train {len(train_streams[d]):,} tokens, held-out {len(heldout_streams[d]):,} tokens")
    return Corpus(tok, train_streams, heldout_eval)


def build_model(args: argparse.Namespace, n_vocab: int) -> TinyMoe:
    """The model, initialised from the torch seed set in make_deterministic; the context is --seq."""
    cfg = TinyMoeConfig(
        n_vocab=n_vocab,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_expert=args.n_expert,
        n_expert_used=args.n_expert_used,
        n_ff_exp=args.n_ff_exp,
        n_ctx_train=args.seq,
    )
    model = TinyMoe(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg}\n  {n_params / 1e6:.2f} M parameters", flush=True)
    return model


def make_optimizer(model: TinyMoe, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW, decaying only the matrices: the 1-D norm weights are left undecayed, as is usual for LMs."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )


def sample_batch(rng: np.random.Generator, streams: dict[str, np.ndarray], seq: int, per_domain: int) -> torch.Tensor:
    """per_domain random windows of seq+1 tokens from each domain, in DOMAINS order (the rng order matters)."""
    rows = []
    for d in DOMAINS:
        stream = streams[d]
        for o in rng.integers(0, len(stream) - seq - 1, size=per_domain):
            rows.append(stream[o : o + seq + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def train_step(
    model: TinyMoe, opt: torch.optim.AdamW, batch: torch.Tensor, lr: float, aux_coef: float
) -> tuple[float, float, float]:
    """One AdamW step on next-token CE + aux_coef x the load-balancing loss; returns (ce, aux, grad norm)."""
    cfg = model.cfg
    for group in opt.param_groups:
        group["lr"] = lr
    logits, probs, ids = model(batch[:, :-1])
    ce = F.cross_entropy(logits.reshape(-1, cfg.n_vocab), batch[:, 1:].reshape(-1))
    aux = torch.stack([load_balancing_loss(p, i, cfg.n_expert) for p, i in zip(probs, ids, strict=True)]).mean()
    loss = ce + aux_coef * aux
    opt.zero_grad(set_to_none=True)
    loss.backward()
    # Clip the gradient norm at 1.0, the usual guard against one outlier batch taking a huge step.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    opt.step()
    return ce.item(), aux.item(), grad_norm


def evaluate_into(record: dict[str, float | int], model: TinyMoe, corpus: Corpus, batch: int, recent: list[float]) -> None:
    """Add the held-out loss per domain to the step's log record and print a progress line."""
    for d in DOMAINS:
        record[f"heldout_loss_{d}"] = eval_loss(model, corpus.heldout_eval[d], batch)
    tqdm.write(
        f"step {record['step']}: train loss {np.mean(recent):.3f}, aux {record['aux']:.3f}, held-out loss "
        + ", ".join(f"{d} {record[f'heldout_loss_{d}']:.3f}" for d in DOMAINS)
    )


@dataclass
class TrainResult:
    recent: list[float]  # the last 50 training CE losses, for a smoothed final figure
    last_record: dict[str, float | int]  # the final step's log record, held-out losses included
    seconds: float


def train(args: argparse.Namespace, model: TinyMoe, corpus: Corpus) -> TrainResult:
    """The training loop: one line of train_log.jsonl per step, a held-out evaluation every --eval-every."""
    opt = make_optimizer(model, args)
    rng = np.random.default_rng(args.seed)
    per_domain = args.batch // len(DOMAINS)
    recent: list[float] = []
    t_train = time.time()
    with (args.out / "train_log.jsonl").open("w") as log:
        bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
        for step in bar:
            batch = sample_batch(rng, corpus.train_streams, args.seq, per_domain)
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            ce, aux, grad_norm = train_step(model, opt, batch, lr, args.aux_coef)
            recent = (recent + [ce])[-50:]
            record: dict[str, float | int] = {
                "step": step + 1, "loss": ce, "aux": aux, "lr": lr, "grad_norm": grad_norm,
                "elapsed_s": time.time() - t_train,
            }
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                evaluate_into(record, model, corpus, args.batch, recent)
            log.write(json.dumps(record) + "\n")
            log.flush()  # a long run's log can be read while it trains
            bar.set_postfix(loss=f"{ce:.3f}", aux=f"{aux:.3f}", lr=f"{lr:.1e}")
    return TrainResult(recent, record, time.time() - t_train)


@torch.no_grad()
def expert_loads(model: TinyMoe, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the fraction of routing slots each expert got over windows: how balanced routing ended up."""
    model.eval()
    _, _, ids = model(windows[:, :-1])
    return [torch.bincount(i.reshape(-1), minlength=model.cfg.n_expert).float() / i.numel() for i in ids]


def write_summary(args: argparse.Namespace, model: TinyMoe, corpus: Corpus, result: TrainResult, t_start: float) -> None:
    """Save checkpoint.pt and summary.json, and print the headline figures."""
    cfg = model.cfg
    loads = expert_loads(model, corpus.heldout_eval["code"])
    summary = {
        "config": cfg.to_dict(),
        "n_params": sum(p.numel() for p in model.parameters()),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "eos_token_id": corpus.tok.token_to_id(EOS_TOKEN),
        "torch_version": str(torch.__version__),
        "corpus_fingerprints": {f"{s}/{d}": corpus_fingerprint(s, d) for s in ("train", "heldout") for d in DOMAINS},
        "train_tokens": {d: int(len(s)) for d, s in corpus.train_streams.items()},
        "tokens_seen": args.steps * args.batch * args.seq,
        "train_seconds": result.seconds,
        "total_seconds": time.time() - t_start,
        "final_train_loss_mean_last_50": float(np.mean(result.recent)),
        "final_heldout_loss": {d: result.last_record[f"heldout_loss_{d}"] for d in DOMAINS},
        "max_expert_load_fraction_per_layer": [float(x.max()) for x in loads],
        "min_expert_load_fraction_per_layer": [float(x.min()) for x in loads],
    }
    torch.save({"config": cfg.to_dict(), "state_dict": model.state_dict(), "summary": summary}, args.out / "checkpoint.pt")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("train_seconds", "final_train_loss_mean_last_50", "final_heldout_loss")}))


def main() -> None:
    args = parse_args()
    t_start = time.time()
    make_deterministic(args)
    corpus = prepare_corpus(args)
    model = build_model(args, corpus.tok.get_vocab_size())
    result = train(args, model, corpus)
    write_summary(args, model, corpus, result, t_start)


if __name__ == "__main__":
    main()
