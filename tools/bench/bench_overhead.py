#!/usr/bin/env python3
"""Decode speed of ggmoe's hooks and cache against the stock path, side by side in one run.

Variants (each its own engine on the same model, rounds alternating so that
machine noise hits all alike; medians over rounds):
- ``stock``     llama.cpp as shipped: no hook, no cache;
- ``cb_eval``   the observe-only gate hook of a stock build (scheduler callback), recording
                ids, router probabilities and MoE inputs as ``ggmoe trace`` does;
- ``route``     the patched route op as the gate hook, recording the same;
- ``cache-all`` the patched route op driving an LRU cache that holds every expert
                (every step after warm-up is all hits: the pure cost of the mechanism), sync mode;
- ``async-all`` the same cache in the async decode: experts read through the expert tables, no route
                callback, the controller once per token (the cost of the table and the controller);
- ``sync-half`` half the experts cached in the sync mode (LRU: every miss copied and waited for);
- ``async-half`` the async decode with half the experts cached (LRU admissions between tokens; the
                misses read from host memory, which on a CPU build is the same RAM, so every copy is
                pure cost here: the half rows measure the cache's bookkeeping and copies, not a link).
Also a histogram of the route callback's time per layer call (``cache-all``).

    python tools/bench/bench_overhead.py [MODEL] [--rounds 7] [--tokens 64] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import ModelFacts, inspect_model
from ggmoe.models import default_model_path


def machine() -> str:
    """CPU model and core count, for the record."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def decode_rate(eng: Engine, prompt_ids: list[int], n_tokens: int, rec: RouteRecorder | None) -> float:
    """Decode tokens/s over ``n_tokens`` steps feeding a fixed token stream (no sampling)."""
    eng.reset()
    eng.decode(prompt_ids)
    feed = (prompt_ids * (n_tokens // len(prompt_ids) + 1))[:n_tokens]
    t0 = time.perf_counter()
    for tok in feed:
        eng.decode([tok])
        if rec is not None:
            rec.take()
    return n_tokens / (time.perf_counter() - t0)


def histogram(us: np.ndarray, bins: tuple[float, ...] = (0, 10, 15, 20, 25, 30, 40, 60, 100, 1e9)) -> list[str]:
    counts, _ = np.histogram(us, bins=bins)
    total = max(int(counts.sum()), 1)
    lines = []
    for lo, hi, c in zip(bins[:-1], bins[1:], counts, strict=True):
        label = f"{lo:>4.0f}-{hi:<4.0f}us" if hi < 1e9 else f"{lo:>4.0f}+     us"
        lines.append(f"  {label} {c:>7d} {'#' * round(50 * c / total)}")
    return lines


def _engines(model: Path, facts: ModelFacts, threads: int | None) -> dict[str, tuple[Engine, RouteRecorder | None]]:
    """The variants measured side by side: stock, the two hook paths recording, the cache sync and async."""
    base = {"model_path": model, "n_ctx": 512, **({"n_threads": threads} if threads else {})}
    rec_cb = RouteRecorder(HookRequest(probs=True, hidden=True))
    rec_route = RouteRecorder(HookRequest(probs=True, hidden=True))
    half = max(facts.n_expert // 2, facts.n_expert_used)

    def cached(n_slots: int, mode: str) -> Engine:
        return Engine(EngineConfig(**base, run=RunConfig(CacheConfig(n_slots=n_slots),
                                                         decode=DecodeConfig(mode=mode))))

    return {
        "stock": (Engine(EngineConfig(**base, gate_hook=False)), None),
        "cb_eval": (Engine(EngineConfig(**base, hook_path="cb_eval"), observer=rec_cb), rec_cb),
        "route": (Engine(EngineConfig(**base, hook_path="route"), observer=rec_route), rec_route),
        "cache-all": (cached(facts.n_expert, "sync"), None),
        "sync-half": (cached(half, "sync"), None),
        "async-all": (cached(facts.n_expert, "async"), None),
        "async-half": (cached(half, "async"), None),
    }


def _measure(engines: dict[str, tuple[Engine, RouteRecorder | None]], rounds: int, tokens: int) -> dict[str, float]:
    """Median decode tok/s of each variant, the variants interleaved round by round (after a warm-up)."""
    prompt = engines["stock"][0].tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")
    for eng, rec in engines.values():  # warm-up: caches filled, graphs built
        decode_rate(eng, prompt, 8, rec)
    engines["cache-all"][0].record_hook_times()
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for name, (eng, rec) in engines.items():
            rates[name].append(decode_rate(eng, prompt, tokens, rec))
    return {k: statistics.median(v) for k, v in rates.items()}


def _print_table(res: dict[str, Any], hook_us: np.ndarray) -> None:
    print(f"model {res['model']} ({res['moe_layers']} MoE layers), {res['rounds']} rounds x "
          f"{res['tokens_per_round']} decode steps")
    print(f"machine: {res['machine']}")
    print(f"{'variant':<11}{'decode tok/s':>14}{'vs stock':>10}{'us/token':>10}")
    for k, v in res["decode_tps_median"].items():
        print(f"{k:<11}{v:>14.1f}{res['ratio_vs_stock'][k]:>10.3f}{res['cost_us_per_token'][k]:>10.0f}")
    print(f"async-half hit rate {res['async_half_hit_rate']:.1%}")
    h = res["route_callback_us"]
    print(f"route callback per layer call (cache-all): p50 {h['p50']:.1f} us, p90 {h['p90']:.1f} us, "
          f"p99 {h['p99']:.1f} us over {h['calls']} calls")
    print("\n".join(histogram(hook_us)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF model (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = Path(a.model) if a.model else default_model_path()
    if model is None:
        print("error: no MODEL given and no embedded default model", file=sys.stderr)
        return 2
    facts = inspect_model(model)
    engines = _engines(model, facts, a.threads)
    med = _measure(engines, a.rounds, a.tokens)
    hook_us = engines["cache-all"][0].hook_times * 1e6
    res = {
        "model": model.name, "machine": machine(), "moe_layers": len(facts.moe_layers),
        "rounds": a.rounds, "tokens_per_round": a.tokens,
        "decode_tps_median": med,
        "ratio_vs_stock": {k: v / med["stock"] for k, v in med.items()},
        "cost_us_per_token": {k: (1 / v - 1 / med["stock"]) * 1e6 for k, v in med.items()},
        "route_callback_us": {"p50": float(np.percentile(hook_us, 50)), "p90": float(np.percentile(hook_us, 90)),
                              "p99": float(np.percentile(hook_us, 99)), "calls": int(hook_us.size)},
        "cache_all_hit_rate": engines["cache-all"][0].cache_stats.total().hit_rate,
        "async_half_hit_rate": engines["async-half"][0].cache_stats.total().hit_rate,
    }
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        _print_table(res, hook_us)
    for eng, _ in engines.values():
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
