#!/usr/bin/env python3
"""The cache's own per-token cost in Python, without a model: what a decode step adds on the host.

Two paths over one random routing (fixed seed), each on a fresh cache whose copies land at once
(``NullCopyBackend``: no copy costs anything here, so what is timed is the bookkeeping alone):
- ``async``: the async decode's step between tokens, ``land_ready`` then ``TokenController.on_routing``
  (``after_token`` per layer and the step plan's cut), with the step log followed as the engine's tables do;
- ``sync``: the route op's callback, ``route_flat`` per layer.

The model shape is a mid-size MoE's (24 layers, 32 experts, top-4) with half the experts cached (LRU), so
about half the selections miss and are admitted. Pure Python on one core: far less noisy than a decode
benchmark, so a before/after pair compares two trees (run each with ``PYTHONPATH`` on it). Medians over
``--repeats``; microseconds per token.

    python tools/bench/bench_cache_path.py [--repeats 5] [--tokens 1500] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from ggmoe.cache import ExpertCache
from ggmoe.cache.copy import NullCopyBackend
from ggmoe.cache.policies import POLICIES
from ggmoe.control import TokenController

N_LAYER, N_EXPERT, N_EXPERT_USED, N_SLOTS = 24, 32, 4, 16


def _routing(n_tokens: int, seed: int = 0) -> np.ndarray:
    """I32 [n_tokens, n_layer, n_expert_used]: distinct experts per layer, uniform at random."""
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(N_EXPERT, N_EXPERT_USED, replace=False) for _ in range(N_LAYER)])
                     for _ in range(n_tokens)]).astype(np.int32)


def _cache() -> ExpertCache:
    layers = list(range(N_LAYER))
    return ExpertCache(N_EXPERT, N_EXPERT_USED, dict.fromkeys(layers, N_SLOTS), POLICIES.get("lru")(N_EXPERT, layers),
                       NullCopyBackend(), bytes_per_expert=dict.fromkeys(layers, 1000))


def time_async(routing: np.ndarray) -> tuple[float, float]:
    """(us per token, hit rate) of the async step over ``routing``."""
    cache = _cache()
    cache.follow_tables()
    cache.take_step()
    ctl = TokenController(cache, [])
    layers = list(range(N_LAYER))
    t0 = time.perf_counter()
    for token in routing:
        cache.land_ready()
        ctl.on_routing(layers, token[:, None, :])
    return (time.perf_counter() - t0) / len(routing) * 1e6, cache.stats.total().hit_rate


def time_sync(routing: np.ndarray) -> tuple[float, float]:
    """(us per token, hit rate) of the sync route over ``routing``."""
    cache = _cache()
    flats = routing.tolist()
    t0 = time.perf_counter()
    for token in flats:
        for il, ids in enumerate(token):
            cache.route_flat(il, ids)
    return (time.perf_counter() - t0) / len(flats) * 1e6, cache.stats.total().hit_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeats < 1 or args.tokens < 1:
        ap.error("--repeats and --tokens must be at least 1")
    routing = _routing(args.tokens)
    runs = {"async": [time_async(routing) for _ in range(args.repeats)],
            "sync": [time_sync(routing) for _ in range(args.repeats)]}
    out = {"machine": f"{platform.processor() or platform.machine()}", "tokens": args.tokens,
           "repeats": args.repeats, "shape": {"n_layer": N_LAYER, "n_expert": N_EXPERT,
                                              "n_expert_used": N_EXPERT_USED, "n_slots": N_SLOTS},
           "us_per_token_median": {k: statistics.median(t for t, _ in v) for k, v in runs.items()},
           "hit_rate": {k: v[0][1] for k, v in runs.items()}}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for k in runs:
        print(f"{k:6s} {out['us_per_token_median'][k]:8.1f} us/token  hit rate {out['hit_rate'][k]:.3f}")


if __name__ == "__main__":
    main()
