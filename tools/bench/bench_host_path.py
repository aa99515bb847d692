#!/usr/bin/env python3
"""The host path's decode speed against stock's, side by side in one process (CPU build).

Modes, each an engine of its own on the same model, decoding the same teacher-forced tokens one at a time:
- ``stock``: no hook, every expert computed by llama.cpp on the CPU (the CPU build's ``cpu-experts`` reference);
- ``host``: ``--cache-slots K --policy on-demand --miss-policy cpu --decode-mode sync``: every selected
  expert computed by the host path (K = n_expert_used, nothing ever resident);
- ``host-async``: the same in the async decode (``--decode-mode async``): the graph's host part (patch 0016)
  computes every selected expert, with no route callback per layer;
- ``sync-cached``: a slot for every expert, the sync decode, no host path (the route op's own cost);
- ``auto-cached``: a slot for every expert with ``--miss-policy auto`` (how a user turns the host path on):
  the cache is warmed before the first token, so auto leaves the host path off (what it costs when unused);
- ``cpu-cached``: the same with ``--miss-policy cpu``: no miss is ever left for the CPU either, so the host
  path is off too, and the run says so.

Rounds alternate the modes (stock, host, ... stock, host, ...), so a drift of the machine's speed reaches every
mode alike; each figure is the median over rounds of decode tokens per second, and each ratio is the median of
the per-round ratios against stock. ``us/expert`` is a decode step's time over the experts it computes
(MoE layers x n_expert_used): the host path's against stock's is the issue's "time per expert".

    python tools/bench/bench_host_path.py [MODEL.gguf | toy] [--rounds 7] [--tokens 128] [--threads N] [--json]

``toy`` writes the real-shape writer's Q4_K preset (tools/gpu/realshape.py) to a temporary file first.
Time it alone: two CPU-heavy jobs on two cores slow each other many times over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("stock", "host", "host-async", "sync-cached", "auto-cached", "cpu-cached")


def _config(mode: str, path: Path, n_expert: int, k: int, threads: int):
    from ggmoe.cache import CacheConfig
    from ggmoe.cache.decode_mode import DecodeConfig
    from ggmoe.control.run_config import RunConfig
    from ggmoe.engine import EngineConfig

    base = dict(model_path=path, n_ctx=512, n_threads=threads)
    if mode == "stock":
        return EngineConfig(**base, gate_hook=False)
    if mode in ("host", "host-async"):
        cache = RunConfig(CacheConfig(n_slots=k, policy="on-demand"),
                          decode=DecodeConfig(miss_policy="cpu", mode="async" if mode == "host-async" else "sync"))
    elif mode == "sync-cached":
        cache = RunConfig(CacheConfig(n_slots=n_expert), decode=DecodeConfig(mode="sync"))
    else:
        cache = RunConfig(CacheConfig(n_slots=n_expert),
                          decode=DecodeConfig(miss_policy=mode.split("-")[0], mode="sync"))
    return EngineConfig(**base, run=cache)


def _tps(eng, tokens: list[int]) -> float:
    """Decode tokens per second of one pass: the tokens one at a time after a fresh first token."""
    eng.reset()
    eng.decode(tokens[:1])
    t0 = time.perf_counter()
    for t in tokens[1:]:
        eng.decode([t])
    return (len(tokens) - 1) / (time.perf_counter() - t0)


def measure(path: Path, rounds: int, n_tokens: int, threads: int) -> dict:
    from ggmoe.engine import Engine
    from ggmoe.inspect import inspect_model

    facts = inspect_model(path)
    engines = {m: Engine(_config(m, path, facts.n_expert, facts.n_expert_used, threads)) for m in MODES}
    try:
        tokens = [(7 * i + 3) % 200 + 1 for i in range(n_tokens)]  # ids every fixture vocabulary has
        for eng in engines.values():  # warm: every slot of the cached modes filled, pages touched
            _tps(eng, tokens)
        runs = {m: [] for m in MODES}
        for _ in range(rounds):
            for m, eng in engines.items():
                runs[m].append(_tps(eng, tokens))
        host_share = {m: eng.cache_stats.total().host_computed if eng.cache_stats else 0
                      for m, eng in engines.items()}
    finally:
        for eng in engines.values():
            eng.close()
    experts = len(facts.moe_layers) * facts.n_expert_used  # computed per decode step
    out = {"model": str(path), "threads": threads, "rounds": rounds, "tokens": n_tokens, "modes": {}}
    for m in MODES:
        tps = statistics.median(runs[m])
        ratio = statistics.median(a / b for a, b in zip(runs[m], runs["stock"], strict=True))
        out["modes"][m] = {"tok_s": round(tps, 1), "vs_stock": round(ratio, 3),
                           "us_per_expert": round(1e6 / tps / experts, 2), "host_computed": host_share[m]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="a GGUF (default: the embedded model), or toy")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.model == "toy":
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.*
            from tools.gpu.realshape import write_model

            path, _, _ = write_model("toy", Path(tmp) / "toy.gguf")
        else:
            from ggmoe.models import default_model_path

            path = Path(a.model) if a.model else default_model_path()
        out = measure(path, a.rounds, a.tokens, a.threads)
    out["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['model']}: {out['rounds']} rounds x {out['tokens']} tokens, {out['threads']} threads ({out['machine']})")
    print(f"{'mode':<12} {'tok/s':>9} {'x stock':>8} {'us/expert':>10} {'host experts':>13}")
    for m, r in out["modes"].items():
        print(f"{m:<12} {r['tok_s']:>9} {r['vs_stock']:>8} {r['us_per_expert']:>10} {r['host_computed']:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
