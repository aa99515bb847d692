#!/usr/bin/env python3
"""The trace corpus: routing of the embedded model on held-out code and English prose.

Picks ``--docs`` held-out documents per domain (``tools/tiny_model/corpus.py``: files never
used in training), seeded and spread over the whole held-out list, each long
enough for ``--prefill-tokens`` + ``--steps`` tokens, writes them as JSONL and
records their traces (``ggmoe.engine.record``), by default teacher-forced: the prefill
is the document's start, then its real continuation is fed one token per
decode step. Greedy and sampled traces of the same documents are for comparing
routing statistics (``--modes teacher greedy sample``).

    python tools/routing/trace_corpus.py [--docs 200] [--out DIR] [--modes teacher] [MODEL]

Output: DIR/{code,prose}.jsonl and DIR/{code,prose}-{mode}/trace.npz (``--split train``: with a
``-train`` suffix; predictors train on those and are evaluated on the held-out ones)
(default DIR: $GGMOE_CACHE/corpus or ~/.cache/ggmoe/corpus).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from ggmoe.engine import Engine, EngineConfig  # noqa: E402
from ggmoe.engine.record import RecordConfig, record_trace  # noqa: E402
from ggmoe.inspect import inspect_model  # noqa: E402
from ggmoe.models import default_model_path  # noqa: E402
from tools.tiny_model.corpus import DOMAINS, list_documents  # noqa: E402


def default_out() -> Path:
    return Path(os.environ.get("GGMOE_CACHE", Path.home() / ".cache" / "ggmoe")) / "corpus"


def pick_documents(eng: Engine, split: str, domain: str, n_docs: int, min_tokens: int, seed: int) -> list[str]:
    """``n_docs`` texts of the split with at least ``min_tokens`` tokens, seeded, in a stable order."""
    docs = list_documents(split, domain, max_chars=20_000)
    order = list(range(len(docs)))
    random.Random(f"{seed}-{domain}").shuffle(order)
    picked: list[int] = []
    for i in order:
        if len(eng.tokenize(docs[i].text)) >= min_tokens:
            picked.append(i)
            if len(picked) == n_docs:
                break
    if len(picked) < n_docs:
        raise SystemExit(f"error: only {len(picked)} {split} {domain} documents have {min_tokens} tokens")
    return [docs[i].text for i in sorted(picked)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF model (default: the embedded model)")
    ap.add_argument("--docs", type=int, default=200, help="documents per domain")
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per document")
    ap.add_argument("--modes", nargs="+", default=["teacher"], choices=["teacher", "greedy", "sample"])
    ap.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=list(DOMAINS))
    ap.add_argument("--split", default="heldout", choices=["heldout", "train"],
                    help="held-out documents (evaluation) or LM-training documents (to train predictors on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hidden", action="store_true", help="do not store MoE inputs")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    model = Path(a.model) if a.model else default_model_path()
    if model is None:
        print("error: no MODEL given and no embedded default model", file=sys.stderr)
        return 2
    out = a.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    inspect_model(model)  # a bad file fails before any work
    n_ctx = a.prefill_tokens + a.steps + 8
    with Engine(EngineConfig(model_path=model, n_ctx=max(n_ctx, 256))) as eng:
        for domain in a.domains:
            texts = pick_documents(eng, a.split, domain, a.docs, a.prefill_tokens + a.steps + 1, a.seed)
            tag = "" if a.split == "heldout" else "-train"
            with (out / f"{domain}{tag}.jsonl").open("w") as f:
                for t in texts:
                    f.write(json.dumps({"text": t}) + "\n")
            for mode in a.modes:
                # greedy/sample prompts are the same documents cut to the prefill length
                prompts = texts if mode == "teacher" else [
                    eng.detokenize(eng.tokenize(t, add_bos=False)[: a.prefill_tokens - 1]) for t in texts]
                cfg = RecordConfig(mode=mode, max_tokens=a.steps, prefill_tokens=a.prefill_tokens,
                                   temp=0.8, seed=a.seed, keep_hidden=not a.no_hidden)
                with click.progressbar(length=len(prompts), label=f"{domain} {mode}", file=sys.stderr) as bar:
                    path = record_trace(eng, prompts, cfg, out / f"{domain}-{mode}{tag}" / "trace.npz",
                                        progress=bar.update)
                print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
