#!/usr/bin/env python3
"""The real-routing table of docs/policies.md: every policy, every id-only predictor and Belady on an
imported public routing log (counts only), at 12.5, 25 and 50 % of each layer's experts cacheable.

The log's sequences are split by prompt (``ggmoe.trace.split_prompts``, seeded): the held-out half is
replayed, the training half feeds what learns (the ``static`` policy's counts, the ``eam`` predictor).
Prefetching runs at stride 1, 2 x top-k experts per layer; id-only predictors: those that read neither hidden
states, router probabilities nor token ids (an imported trace has none of them).

    ggmoe trace import /work/shared/real-routing/deepseek-v2-lite-esft/{intent,law} -o /tmp/ds2 \\
        --n-expert 64 --top-k 6 --n-layer 27
    python tools/bench/bench_real_routing.py --trace /tmp/ds2 --jobs 2 --val-frac 0.25 > table.md
    python tools/bench/bench_real_routing.py --trace /tmp/ds2 --val-frac 0.25 --write-split /tmp/ds2-split
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ggmoe.cache.policies import POLICIES
from ggmoe.predict.base import PREDICTORS, predictor_class
from ggmoe.simulate.des import SimConfig, simulate
from ggmoe.trace import load_trace, select_prompts, split_prompts
from ggmoe.trace.data import trace_counts

FRACTIONS = (0.125, 0.25, 0.5)
_STATE: dict = {}


def id_only_predictors() -> list[str]:
    """Registered predictors that need nothing an imported trace lacks (``oracle`` included: the ceiling)."""
    out = []
    for name in PREDICTORS.names():
        cls = predictor_class(name)
        if not (cls.needs_hidden or cls.needs_probs or cls.needs_tokens) and not name.startswith("test-"):
            out.append(name)
    return out


def _init(path: str, val_frac: float, seed: int) -> None:
    tr = load_trace(path, hidden=False)
    train_p, held_p = split_prompts(tr.n_prompts, val_frac, seed)
    _STATE.update(held=select_prompts(tr, held_p), train=select_prompts(tr, train_p))
    _STATE["counts"] = trace_counts(_STATE["train"])


def _run(job: tuple[str, str | None, float]) -> tuple[str, str | None, float, float]:
    pol, pred, f = job
    held, train = _STATE["held"], _STATE["train"]
    m = held.meta
    n = max(m.n_expert_used, round(f * m.n_expert))
    bpe = {int(il): 0 for il in held.layers}
    cfg = SimConfig(dict.fromkeys(bpe, n), policy=pol, predictor=pred, stride=1, predictor_s=0.0,
                    policy_options={"counts": _STATE["counts"]} if pol == "static" else None)
    return pol, pred, f, simulate(held, cfg, bpe, None, train).hit_rate


def jobs(policies: list[str], predictors: list[str | None]) -> list[tuple[str, str | None, float]]:
    return [(pol, pred, f) for pol in policies for pred in predictors for f in FRACTIONS
            if not (pol == "belady" and pred is not None)]  # Belady: the ceiling of eviction alone


def render(results: list[tuple[str, str | None, float, float]]) -> str:
    by = {(p, q, f): h for p, q, f, h in results}
    rows = sorted({(p, q) for p, q, _, _ in results}, key=lambda x: (x[0], x[1] or ""))
    lines = ["| policy | predictor | " + " | ".join(f"hit rate at {f:.1%}" for f in FRACTIONS) + " |",
             "|---|---|" + "---|" * len(FRACTIONS)]
    lines += [f"| {p} | {q or '-'} | " + " | ".join(f"{by[(p, q, f)]:.1%}" for f in FRACTIONS) + " |"
              for p, q in rows]
    for f in FRACTIONS:
        belady = by[("belady", None, f)]
        real = [(h, p, q) for (p, q, g), h in by.items() if g == f and p != "belady" and q != "oracle"]
        h, p, q = max(real)
        evict = max((h2, p2) for (p2, q2, g), h2 in by.items() if g == f and p2 != "belady" and q2 is None)
        lines.append(f"\n- {f:.1%}: Belady {belady:.1%}; best {p} + {q or 'no prefetching'} {h:.1%} = "
                     f"{h / belady:.2f} of Belady; best without prefetching {evict[1]} {evict[0]:.1%} = "
                     f"{evict[0] / belady:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True, help="an imported trace (ggmoe trace import)")
    ap.add_argument("--val-frac", type=float, default=0.5, help="share of sequences held out and replayed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--policies", default="", help="comma list (default: every registered policy)")
    ap.add_argument("--write-split", type=Path, help="also write the split: DIR/held.npz and DIR/train.npz, then stop")
    a = ap.parse_args(argv)
    if a.write_split is not None:
        from ggmoe.trace.format import write_trace

        _init(str(a.trace), a.val_frac, a.seed)
        a.write_split.mkdir(parents=True, exist_ok=True)
        for name in ("held", "train"):
            write_trace(_STATE[name], a.write_split / f"{name}.npz", compress=True)
        print(f"wrote {a.write_split}/held.npz ({_STATE['held'].n_tokens} tokens), train.npz")
        return 0
    policies = [p for p in a.policies.split(",") if p] or [p for p in POLICIES.names() if not p.startswith("test-")]
    t0 = time.monotonic()
    todo = jobs(policies, [None, *id_only_predictors()])
    results = []
    with ProcessPoolExecutor(a.jobs, initializer=_init, initargs=(str(a.trace), a.val_frac, a.seed)) as ex:
        for r in ex.map(_run, todo):
            results.append(r)
            print(f"{r[0]} {r[1] or '-'} {r[2]:.3f} {r[3]:.4f} ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
    _init(str(a.trace), a.val_frac, a.seed)
    held, train = _STATE["held"], _STATE["train"]
    print(f"routing: {held.meta.source}\n{held.n_prompts} held-out sequences, {held.n_tokens} tokens "
          f"(training split {train.n_prompts} sequences, {train.n_tokens} tokens), {len(held.layers)} MoE "
          f"layers, {held.meta.n_expert} experts, top-{held.meta.n_expert_used}\n")
    print(render(results))
    print(f"\n({len(todo)} configurations in {time.monotonic() - t0:.0f} s, {a.jobs} worker(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
