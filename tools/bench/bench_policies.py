#!/usr/bin/env python3
"""The tables of docs/policies.md: every policy and predictor in the simulator, and the issue's targets.

Part A (hit rates; the embedded model's own shape, counts only): every eviction policy, Belady included,
times every predictor, at 25 % and 50 % of experts cacheable, on held-out teacher-forced traces of the
embedded model; the data-driven predictors and the static policy learn from the training split.

Part B (estimated TPOT on the hardware profiles): the same routing tiled over gpt-oss-20b's MoE shape (24
layers, 32 experts of 13.2 MB in MXFP4, top-4; tools/gpu/trace_routing.py), at 25, 50 and 100 %: stock
llama.cpp with experts on the CPU (-ot exps=CPU), --n-cpu-moe at the same VRAM, llama.cpp mainline's
design (on-demand LRU, misses waited for), and ggmoe's best over policies x predictors x miss policies.

    python tools/routing/trace_corpus.py --docs 60 --out DIR --no-hidden            # held-out
    python tools/routing/trace_corpus.py --docs 60 --out DIR --split train           # training split
    python tools/bench/bench_policies.py --corpus DIR > tables.md
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: tools.* when run as a file
from ggmoe.cache.hardware import load_profile  # noqa: E402
from ggmoe.cache.policies import POLICIES  # noqa: E402
from ggmoe.inspect import inspect_model  # noqa: E402
from ggmoe.models import default_model_path  # noqa: E402
from ggmoe.simulate.des import SimConfig, baseline, simulate  # noqa: E402
from ggmoe.trace import load_traces  # noqa: E402
from ggmoe.trace.data import select_prompts, trace_counts  # noqa: E402
from tools.gpu.trace_routing import tile_trace  # noqa: E402

PREDICTORS = (None, "reuse", "token", "eam", "expert-map", "oracle")
FRACTIONS = (0.25, 0.5)
GPT_OSS_LAYERS = 24
GPT_OSS_BPE = 3 * 2880 * 2880 // 32 * 17  # bytes of one MXFP4 expert (gate, up, down)


def pct(x: float) -> str:
    return f"{x:.1%}"


def part_a(held, train, bpe) -> tuple[str, dict]:
    m = held.meta
    policies = [p for p in POLICIES.names() if not p.startswith("test-")]
    counts = trace_counts(train)
    lines = ["| policy | predictor | " + " | ".join(f"hit rate at {f:.0%}" for f in FRACTIONS) + " |",
             "|---|---|" + "---|" * len(FRACTIONS)]
    best: dict[float, tuple[float, str]] = {f: (0.0, "") for f in FRACTIONS}
    belady: dict[float, float] = {}
    for pol in policies:
        for pred in PREDICTORS:
            if pol == "belady" and pred is not None:
                continue  # the ceiling of eviction alone
            cells = []
            for f in FRACTIONS:
                n = max(m.n_expert_used, round(f * m.n_expert))
                cfg = SimConfig(dict.fromkeys(bpe, n), policy=pol, predictor=pred, stride=1, predictor_s=0.0,
                                policy_options={"counts": counts} if pol == "static" else None)
                r = simulate(held, cfg, bpe, None, train)
                cells.append(pct(r.hit_rate))
                if pol == "belady":
                    belady[f] = r.hit_rate
                elif pred != "oracle" and r.hit_rate > best[f][0]:
                    best[f] = (r.hit_rate, f"{pol} + {pred or 'no prefetching'}")
            lines.append(f"| {pol} | {pred or '-'} | " + " | ".join(cells) + " |")
    summary = {f: {"best": best[f][1], "best_hit": best[f][0], "belady": belady[f],
                   "ratio": best[f][0] / belady[f]} for f in FRACTIONS}
    return "\n".join(lines), summary


def part_b(held, train, profiles: list[str]) -> tuple[str, list[dict]]:
    layers = tuple(range(GPT_OSS_LAYERS))
    m = held.meta
    big = tile_trace(held, layers, m.n_expert, m.n_expert_used, "gpt-oss-shape")
    big_train = tile_trace(train, layers, m.n_expert, m.n_expert_used, "gpt-oss-shape")
    bpe = dict.fromkeys(layers, GPT_OSS_BPE)
    rows = ["| profile | cacheable | -ot exps=CPU | --n-cpu-moe | mainline-style LRU | ggmoe best | config | "
            "best / n-cpu-moe | best / mainline | best / exps=CPU |", "|---" * 10 + "|"]
    out = []
    for prof in profiles:
        p = load_profile(prof)
        cpu = baseline(big, "stock-cpu", bpe, p)
        for f in (0.25, 0.5, 1.0):
            n = max(m.n_expert_used, round(f * m.n_expert))
            budget = n * GPT_OSS_BPE * len(layers)
            ncpu = baseline(big, "n-cpu-moe", bpe, p, budget)
            mainline = simulate(big, SimConfig(dict.fromkeys(layers, n)), bpe, p)
            best = None
            for pol in ("lru", "lcp"):
                for pred, stride in ((None, 2), ("reuse", 1), ("token", 1), ("token", 2)):
                    for miss in ("wait", "auto"):
                        cfg = SimConfig(dict.fromkeys(layers, n), policy=pol, predictor=pred, stride=stride,
                                        miss_policy=miss, predictor_s=p.hook_s)
                        r = simulate(big, cfg, bpe, p, big_train)
                        if best is None or r.tpot_s < best.tpot_s:
                            best = r
            out.append({"profile": prof, "fraction": f, "cpu": cpu.tpot_s, "n_cpu_moe": ncpu.tpot_s,
                        "n_cpu_moe_layers": ncpu.gpu_layers, "mainline": mainline.tpot_s, "best": best.tpot_s,
                        "best_label": best.label})
            rows.append(f"| {prof} | {f:.0%} | {cpu.tpot_s * 1e3:.2f} ms | {ncpu.tpot_s * 1e3:.2f} ms "
                        f"({ncpu.gpu_layers} layers) | {mainline.tpot_s * 1e3:.2f} ms | {best.tpot_s * 1e3:.2f} ms | "
                        f"{best.label} | {ncpu.tpot_s / best.tpot_s:.2f}x | {mainline.tpot_s / best.tpot_s:.2f}x | "
                        f"{cpu.tpot_s / best.tpot_s:.2f}x |")
    return "\n".join(rows), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="trace_corpus.py's output directory")
    ap.add_argument("--profiles", default="pcie4,egpu")
    ap.add_argument("--part", choices=["a", "b", "all"], default="all")
    ap.add_argument("--prompts-b", type=int, default=24, help="held-out prompts used in part B (the slow one)")
    a = ap.parse_args(argv)
    held = load_traces(sorted(str(p) for p in a.corpus.glob("*-teacher/trace.npz")))
    train = load_traces(sorted(str(p) for p in a.corpus.glob("*-teacher-train/trace.npz")))
    held = dataclasses.replace(held, hidden=None)
    facts = inspect_model(default_model_path())
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    t0 = time.monotonic()
    if a.part in ("a", "all"):
        table_a, summary = part_a(held, train, bpe)
        print(f"## Hit rates ({held.n_prompts} held-out prompts, {held.n_tokens} tokens; training split "
              f"{train.n_prompts} prompts)\n\n{table_a}\n")
        for f, s in summary.items():
            print(f"- {f:.0%}: best non-oracle {s['best']} {pct(s['best_hit'])} = {s['ratio']:.1%} of Belady's "
                  f"{pct(s['belady'])}")
    if a.part in ("b", "all"):
        rng = np.random.default_rng(0)
        pick = np.sort(rng.choice(held.n_prompts, size=min(a.prompts_b, held.n_prompts), replace=False))
        sub = select_prompts(held, pick)
        table_b, _ = part_b(sub, train, [x for x in a.profiles.split(",") if x])
        print(f"\n## Estimated TPOT, gpt-oss-20b's MoE shape (trace tiled over {GPT_OSS_LAYERS} layers; "
              f"{sub.n_prompts} held-out prompts, {sub.n_tokens} tokens, seeded pick)\n\n{table_b}\n")
    print(f"\n(measured in {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
