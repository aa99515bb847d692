#!/usr/bin/env python3
"""The benchmark matrix: stock llama.cpp baselines against ggmoe's cache, per routing source and cache size.

For one model, for each routing source (``random``: the model's own router; ``trace``: trace-replay
routing, benchmark only, see trace_routing.py) and each configuration:

    stock-vram   stock llama.cpp, every weight in VRAM (the ceiling; needs the VRAM)
    stock-cpu    stock, experts in host memory computed by the CPU (llama.cpp's -ot exps=CPU)
    n-cpu-moe    stock, whole layers' experts on the GPU at the cache's VRAM, the rest on the host
                 (llama.cpp's --n-cpu-moe)
    lru          ggmoe, on-demand LRU: every miss copied and waited for (llama.cpp's --moe-cache-mib design)
    prefetch     ggmoe, stride prefetching (reuse predictor, stride 1) and the host path (--miss-policy auto)
    prefetch-eam the same with MoE-Infinity's EAM predictor trained on the tiled trace's other prompts
                 (trace routing only)

at each fraction of experts cacheable (--fractions, default 0.25, 0.5, 1.0; the stock-vram and stock-cpu
rows do not depend on it and run once). Each cell: decode tok/s (median of --runs generations), prefill
tok/s of a --prefill-tokens prompt, TTFT (that prefill and the first token), hit rate, the route hook's
median seconds per MoE layer call. Once per model: pinned host-to-device copy bandwidth and CPU time per
expert (``ggmoe.engine.calibrate``). Stock rows always route with the model's router: routing does not
change what they compute.

Writes OUT/matrix.json and OUT/matrix.md, and prints the table.

    python tools/gpu/matrix.py --model M.gguf --trace TRACE.npz --out $OUT [--fractions 0.25,0.5,1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_routing import ROUTING_NAME, TraceRouting, split_tiled  # noqa: E402

from ggmoe.cache import CacheConfig  # noqa: E402
from ggmoe.cache.prefetch import PrefetchConfig  # noqa: E402
from ggmoe.engine import Engine, EngineConfig  # noqa: E402
from ggmoe.engine.loader import gpu_device_name  # noqa: E402
from ggmoe.inspect import inspect_model  # noqa: E402
from ggmoe.inspect.fingerprint import model_fingerprint  # noqa: E402
from ggmoe.trace import load_trace  # noqa: E402

CONFIGS = ("stock-vram", "stock-cpu", "n-cpu-moe", "lru", "prefetch", "prefetch-eam")
PER_FRACTION = ("n-cpu-moe", "lru", "prefetch", "prefetch-eam")
TRACE_ONLY = ("prefetch-eam",)  # learns from the tiled trace's training prompts
PROMPT = "The expert cache keeps the experts a model uses most on the device"


@dataclass(frozen=True)
class Cell:
    model: str
    routing: str  # "random" or ROUTING_NAME
    config: str
    fraction: float | None  # experts cacheable per layer (None: does not apply)
    slots: int | None  # cache slots per layer, or layers with experts on the GPU (n-cpu-moe)
    decode_tps: float  # median of the runs
    decode_tps_runs: tuple[float, ...]
    prefill_tps: float
    ttft_s: float
    hit_rate: float | None
    hook_us_p50: float | None  # route callback, µs per MoE layer call (with its device sync)
    host_computed: int | None  # experts computed on the CPU (host path)
    error: str | None = None  # why the cell could not run (e.g. out of VRAM)


def engine_config(model: Path, config: str, fraction: float | None, facts, n_threads: int, n_ctx: int,
                  train: Path | None) -> tuple[EngineConfig, int | None]:
    base = {"model_path": model, "n_ctx": n_ctx, "n_threads": n_threads}
    if config == "stock-vram":
        return EngineConfig(**base, experts_on_host=False, gate_hook=False), None
    if config == "stock-cpu":
        return EngineConfig(**base, experts_on_host=True, gate_hook=False), None
    n_slots = max(facts.n_expert_used, round(fraction * facts.n_expert))
    if config == "n-cpu-moe":
        # the same VRAM as n_slots slots in every layer, spent on whole layers' experts instead
        n_gpu = round(len(facts.moe_layers) * n_slots / facts.n_expert)
        host = tuple(facts.moe_layers[n_gpu:])
        return EngineConfig(**base, experts_on_host=True, host_expert_layers=host, gate_hook=False), n_gpu
    if config == "lru":
        return EngineConfig(**base, cache=CacheConfig(n_slots=n_slots, policy="lru", miss_policy="wait")), n_slots
    if config in ("prefetch", "prefetch-eam"):
        pre = PrefetchConfig(predictor="reuse", stride=1) if config == "prefetch" else \
            PrefetchConfig(predictor="eam", stride=1, train=(str(train),))
        return EngineConfig(**base, cache=CacheConfig(n_slots=n_slots, policy="lru", miss_policy="auto",
                                                      prefetch=pre)), n_slots
    raise SystemExit(f"error: unknown config {config!r}; choose from {', '.join(CONFIGS)}")


def measure(eng: Engine, vocab: int, prefill_tokens: int, decode_tokens: int, runs: int,
            seed: int) -> tuple[float, list[float], float, float]:
    """(prefill tok/s, decode tok/s per run, TTFT s, median decode tok/s)."""
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, vocab, size=prefill_tokens)]
    eng.generate(PROMPT, max_tokens=4)  # warm-up: graphs, first touch, the cache's first copies
    eng.reset()
    t0 = time.perf_counter()
    logits = eng.decode(prompt)
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    eng.decode([int(np.argmax(logits))])
    ttft = t_prefill + (time.perf_counter() - t1)
    tps = []
    for _ in range(runs):
        g = eng.generate(PROMPT, max_tokens=decode_tokens)
        tps.append(g.timings.decode_tps)
    return prefill_tokens / t_prefill, tps, ttft, float(statistics.median(tps))


def run_cell(model: Path, facts, config: str, fraction: float | None, routing: str, held: Path | None,
             args, train: Path | None) -> Cell:
    cfg, slots = engine_config(model, config, fraction, facts, args.threads, args.n_ctx, train)
    name = ROUTING_NAME if routing == "trace" else "random"
    try:
        with Engine(cfg) as eng:
            if routing == "trace" and cfg.cache is not None:
                eng.set_routing_override(TraceRouting(load_trace(held, hidden=False)))
            if cfg.cache is not None:
                eng.record_hook_times()
            prefill, runs, ttft, decode = measure(eng, eng.n_vocab, args.prefill_tokens, args.decode_tokens,
                                                  args.runs, args.seed)
            stats = eng.cache_stats
            hook = eng.hook_times
            total = stats.total() if stats is not None else None
        return Cell(str(model), name, config, fraction, slots, decode, tuple(runs), prefill, ttft,
                    total.hit_rate if total else None,
                    float(np.median(hook)) * 1e6 if hook.size else None,
                    total.host_computed if total else None)
    except Exception as e:  # noqa: BLE001 - a cell that cannot run (e.g. out of VRAM) is reported, not fatal
        return Cell(str(model), name, config, fraction, slots, 0.0, (), 0.0, 0.0, None, None, None,
                    error=f"{type(e).__name__}: {e}")


def table(cells: list[Cell]) -> str:
    head = "| routing | config | cacheable | slots | decode tok/s | prefill tok/s | TTFT ms | hit rate | hook µs | CPU experts |"
    rows = [head, "|" + "---|" * 10]
    for c in cells:
        routing = "trace" if c.routing != "random" else "random"
        if c.error:
            rows.append(f"| {routing} | {c.config} | {c.fraction or '-'} | {c.slots or '-'} | {c.error} |||||")
            continue
        rows.append(f"| {routing} | {c.config} | {'-' if c.fraction is None else f'{c.fraction:.0%}'} | "
                    f"{'-' if c.slots is None else c.slots} | {c.decode_tps:.1f} | {c.prefill_tps:.1f} | "
                    f"{c.ttft_s * 1e3:.1f} | {'-' if c.hit_rate is None else f'{c.hit_rate:.1%}'} | "
                    f"{'-' if c.hook_us_p50 is None else f'{c.hook_us_p50:.1f}'} | "
                    f"{'-' if c.host_computed is None else c.host_computed} |")
    return "\n".join(rows)


def machine() -> dict:
    return {"gpu": gpu_device_name(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trace", type=Path, help="a trace of the embedded model (for trace-replay routing)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--routing", default="random,trace", help="random, trace or both (comma list)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--fractions", default="0.25,0.5,1.0")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate", action="store_true", help="also measure copy bandwidth and CPU time per expert")
    a = ap.parse_args(argv)
    facts = inspect_model(a.model)
    routings = [r for r in a.routing.split(",") if r]
    configs = [c for c in a.configs.split(",") if c]
    fractions = [float(f) for f in a.fractions.split(",") if f]
    bad = set(configs) - set(CONFIGS) or set(routings) - {"random", "trace"}
    if bad:
        raise SystemExit(f"error: unknown {sorted(bad)}; configs: {', '.join(CONFIGS)}; routing: random, trace")
    held = train = None
    if "trace" in routings:
        if a.trace is None:
            raise SystemExit("error: trace routing needs --trace (a trace of the embedded model)")
        train, held = split_tiled(a.trace, tuple(facts.moe_layers), facts.n_expert, facts.n_expert_used,
                                  model_fingerprint(a.model), a.out / "tiled")
    a.out.mkdir(parents=True, exist_ok=True)
    cells: list[Cell] = []
    for routing in routings:
        for config in configs:
            if routing == "trace" and config not in ("lru", "prefetch", "prefetch-eam"):
                continue  # stock rows compute the same whatever the routing: measured once, under random
            if routing == "random" and config in TRACE_ONLY:
                continue
            for f in fractions if config in PER_FRACTION else [None]:
                t0 = time.monotonic()
                cell = run_cell(a.model, facts, config, f, routing, held, a, train)
                cells.append(cell)
                print(f"{routing:6} {config:10} {'' if f is None else f'{f:.0%}':>5}  "
                      f"{cell.error or f'{cell.decode_tps:.1f} tok/s'}  ({time.monotonic() - t0:.0f} s)", flush=True)
    result = {"machine": machine(), "model": str(a.model), "facts": {"n_expert": facts.n_expert,
              "n_expert_used": facts.n_expert_used, "moe_layers": len(facts.moe_layers),
              "bytes_per_expert": facts.bytes_per_expert(facts.moe_layers[0])},
              "routing_note": ROUTING_NAME if "trace" in routings else None,
              "cells": [asdict(c) for c in cells]}
    if a.calibrate:
        from ggmoe.engine.calibrate import calibrate

        result["calibration"] = calibrate(a.model, n_threads=a.threads, n_tokens=16, repeat=3).to_dict()
    (a.out / "matrix.json").write_text(json.dumps(result, indent=2))
    md = table(cells)
    notes = [f"machine: {result['machine']}", f"model: {a.model.name}"]
    if "trace" in routings:
        notes.append(f"'trace' rows: {ROUTING_NAME}")
    (a.out / "matrix.md").write_text("\n".join(notes) + "\n\n" + md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
