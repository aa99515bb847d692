#!/usr/bin/env python3
"""Per-token cost of the gate hook: decode tokens/s with and without it, side by side.

Two engines on the same model, one stock (no ``cb_eval``) and one with the gate
hook feeding a trace recorder (ids + router probs + MoE input, as ``ggmoe trace``
does). Rounds alternate between them so machine noise hits both alike; the
table gives medians over rounds and their ratio.

    python tools/bench_hook.py [MODEL] [--rounds 7] [--tokens 64] [--json]
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

from ggmoe.engine import Engine, EngineConfig
from ggmoe.hook import HookRequest, RouteRecorder
from ggmoe.inspect import inspect_model
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
    """Decode tokens/s for ``n_tokens`` greedy-free steps (feeding a fixed token stream)."""
    eng.reset()
    eng.decode(prompt_ids)
    feed = (prompt_ids * (n_tokens // len(prompt_ids) + 1))[:n_tokens]
    t0 = time.perf_counter()
    for tok in feed:
        eng.decode([tok])
        if rec is not None:
            rec.take()
    return n_tokens / (time.perf_counter() - t0)


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
    kw = {"n_threads": a.threads} if a.threads else {}
    stock = Engine(EngineConfig(model_path=model, n_ctx=512, gate_hook=False, **kw))
    rec = RouteRecorder(HookRequest(probs=True, hidden=True))
    hooked = Engine(EngineConfig(model_path=model, n_ctx=512, **kw), observer=rec)
    prompt = stock.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")
    decode_rate(stock, prompt, 8, None)  # warm-up both
    decode_rate(hooked, prompt, 8, rec)
    rates: dict[str, list[float]] = {"stock": [], "hook": []}
    for _ in range(a.rounds):
        rates["stock"].append(decode_rate(stock, prompt, a.tokens, None))
        rates["hook"].append(decode_rate(hooked, prompt, a.tokens, rec))
    med = {k: statistics.median(v) for k, v in rates.items()}
    n_moe = len(inspect_model(model).moe_layers)
    res = {
        "model": model.name, "machine": machine(),
        "rounds": a.rounds, "tokens_per_round": a.tokens,
        "stock_decode_tps_median": med["stock"], "hook_decode_tps_median": med["hook"],
        "ratio_hook_over_stock": med["hook"] / med["stock"],
        "hook_cost_us_per_token": (1 / med["hook"] - 1 / med["stock"]) * 1e6,
        "moe_layers": n_moe,
        "hook_cost_us_per_layer": (1 / med["hook"] - 1 / med["stock"]) * 1e6 / n_moe,
    }
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"model {res['model']}  ({a.rounds} rounds x {a.tokens} decode steps, alternating)")
        print(f"{'path':<8}{'decode tok/s (median)':>24}")
        print(f"{'stock':<8}{med['stock']:>24.1f}")
        print(f"{'hook':<8}{med['hook']:>24.1f}")
        print(f"ratio hook/stock {res['ratio_hook_over_stock']:.3f}; hook costs "
              f"{res['hook_cost_us_per_token']:.0f} us per token, {res['hook_cost_us_per_layer']:.0f} us per MoE layer")
        print(f"machine: {res['machine']}")
    stock.close()
    hooked.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
