#!/usr/bin/env python3
"""MoEpic's split against whole-expert caching at the same VRAM: live on this build and in the simulator.

For each budget (a share of the experts' bytes per layer) and configuration, greedy generation of
``--tokens`` tokens on each prompt, the same prompts for every row, rows interleaved over ``--repeats``
rounds (side by side in one run):

- whole LRU / split θ (LRU, LCP), async decode: misses and bottoms read in place;
- whole LRU / split θ LCP, sync decode (the route op per layer): whole misses wait for their copy, split
  layers read misses and bottoms in place;
- whole LRU + skip-gate / MoEpic (split θ, LCP, skip-gate bottoms): the sync decode with prefetching.

A split row holds as many tops as the whole row's bytes (``ggmoe simulate --theta``'s rule; with prefetching,
less its k bottom buffers, one packed bottom each: the same VRAM). Reported per
row: whole hits, top-only hits and misses (shares of expert uses), bytes over the link per decoded token
(reads from host memory + copies into slots and bottom buffers), the measured decode TPOT (median over the
rounds; on a CPU build a "link" read is a RAM read, so this shows the bookkeeping, not the link), and the
simulator's TPOT estimate on the run's own trace for each ``--hw`` profile.

    python tools/bench/bench_split.py [--model M.gguf] [--fractions 0.25,0.5] [--theta 0.5] [--hw h100,pcie4]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ggmoe.cache import CacheConfig  # noqa: E402
from ggmoe.cache.decode_mode import DecodeConfig  # noqa: E402
from ggmoe.cache.hardware import load_profile  # noqa: E402
from ggmoe.cache.split import split_at, tops_in  # noqa: E402
from ggmoe.control.prefetch import PrefetchConfig  # noqa: E402
from ggmoe.control.run_config import RunConfig  # noqa: E402
from ggmoe.engine import Engine, EngineConfig  # noqa: E402
from ggmoe.engine.record import RecordConfig, record_trace  # noqa: E402
from ggmoe.inspect import inspect_model  # noqa: E402
from ggmoe.models import default_model_path  # noqa: E402
from ggmoe.simulate.des import SimConfig, simulate  # noqa: E402
from ggmoe.trace import load_trace  # noqa: E402

PROMPTS = ("def fibonacci(n):", "import numpy as np\n\n", "class Stack:\n    def __init__(self):",
           "The history of the city begins", "for i in range(10):", "Once upon a time, in a small village")


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    theta: float  # 1: whole experts; 0: the --theta asked for
    policy: str
    prefetch: bool  # skip-gate at stride 1
    mode: str  # decode mode


ROWS = (Row("whole LRU, async", 1.0, "lru", False, "async"), Row("split LRU, async", 0.0, "lru", False, "async"),
        Row("split LCP, async", 0.0, "lcp", False, "async"),
        Row("whole LRU, sync", 1.0, "lru", False, "sync"), Row("split LCP, sync", 0.0, "lcp", False, "sync"),
        Row("whole LRU + skip-gate, sync", 1.0, "lru", True, "sync"),
        Row("MoEpic: split LCP + skip-gate bottoms, sync", 0.0, "lcp", True, "sync"))


def bpe_of(facts) -> dict[int, int]:
    return {il: facts.bytes_per_expert(il) for il in facts.moe_layers}


def cache_for(facts, fraction: float, row: Row, theta: float, k: int) -> tuple[CacheConfig, dict, dict]:
    whole = max(facts.n_expert_used, min(facts.n_expert, round(fraction * facts.n_expert)))
    th = row.theta or theta
    split, slots = split_at(facts, dict.fromkeys(facts.moe_layers, whole), th)
    if split and row.prefetch:  # k bottom buffers per split layer, one packed bottom each, out of the budget
        reserved = {il: k * s.bottom_bytes for il, s in split.items()}
        slots = {il: max(k, n) for il, n in tops_in(split, dict.fromkeys(slots, whole), bpe_of(facts),
                                                     facts.n_expert, reserved).items()}
    pre = PrefetchConfig("skip-gate", stride=1, n_prefetch=k) if row.prefetch else None
    cfg = RunConfig(CacheConfig(layer_slots=slots, policy=row.policy,
                                layer_theta=dict.fromkeys(split, th) or None),
                    decode=DecodeConfig(mode=row.mode),
                    prefetch=pre)
    return cfg, split, slots


def live(path: str, cfg: CacheConfig, tokens: int) -> tuple[float, dict, int]:
    """(decode seconds, stats totals, decoded tokens) of greedy generation on every prompt."""
    with Engine(EngineConfig(model_path=path, n_ctx=512, run=cfg)) as eng:
        decode_s, n = 0.0, 0
        for p in PROMPTS:
            g = eng.generate(p, tokens)
            decode_s += g.timings.decode_s
            n += max(0, len(g.token_ids) - 1)
        return decode_s, eng.cache_stats.total().to_dict(), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--theta", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hw", default="h100,pcie4")
    args = ap.parse_args()
    path = str(args.model or default_model_path())
    facts = inspect_model(path)
    k = facts.n_expert_used
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    with tempfile.TemporaryDirectory() as tmp:  # the routing every row sees (greedy: the same in every row)
        with Engine(EngineConfig(model_path=path, n_ctx=512)) as eng:
            tr = load_trace(record_trace(eng, PROMPTS, RecordConfig(max_tokens=args.tokens), Path(tmp) / "t.npz"))
    profiles = {h: load_profile(h) for h in args.hw.split(",")}
    print(f"machine: {platform.machine()}, {platform.processor() or platform.platform()}; model {Path(path).name}; "
          f"{len(PROMPTS)} prompts x {args.tokens} tokens, {args.repeats} rounds; θ {args.theta}")
    hws = list(profiles)
    print("| experts' bytes | configuration | slots/layer (+ bottom buffers) | whole hits | top-only hits | misses | link KiB/token | "
          "TPOT ms, this CPU (median) | " + " | ".join(f"TPOT ms est. {h}" for h in hws) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(hws))
    for fraction in (float(f) for f in args.fractions.split(",")):
        cfgs = [cache_for(facts, fraction, row, args.theta, k) for row in ROWS]
        times: dict[int, list[float]] = {i: [] for i in range(len(ROWS))}
        stats: dict[int, tuple[dict, int]] = {}
        for _ in range(args.repeats):
            for i, (cfg, _, _) in enumerate(cfgs):
                s, st, n = live(path, cfg, args.tokens)
                times[i].append(s / max(n, 1))
                stats[i] = (st, n)
        for i, (row, (_, split, slots)) in enumerate(zip(ROWS, cfgs, strict=True)):
            st, n = stats[i]
            uses = max(1, st["hits"] + st["top_hits"] + st["misses"])
            link = (st["host_read_bytes"] + st["bytes_copied"]) / max(n, 1) / 1024
            est = []
            for h in hws:
                sim = simulate(tr, SimConfig(n_slots=slots, policy=row.policy, split=split,
                                             predictor="skip-gate" if row.prefetch else None, stride=1,
                                             n_prefetch=k if row.prefetch else None, predictor_s=20e-6,
                                             decode_mode=row.mode),
                               bpe, profiles[h], model_path=path)
                est.append(f"{sim.tpot_s * 1e3:.3f}")
            buffers = f" + {k}" if split and row.prefetch else ""
            print(f"| {fraction:.0%} | {row.label} | {next(iter(slots.values()))}{buffers} | {st['hits'] / uses:.1%} | "
                  f"{st['top_hits'] / uses:.1%} | {st['misses'] / uses:.1%} | {link:.0f} | "
                  f"{statistics.median(times[i]) * 1e3:.2f} | " + " | ".join(est) + " |")


if __name__ == "__main__":
    main()
