#!/usr/bin/env python3
"""Stride prefetch on the async decode against the sync decode's, on the CPU build behaving like a GPU.

    python tools/bench/bench_stride.py DOCS.jsonl [DOCS2.jsonl ...] --predictor PRED.npz [--model M.gguf]
        [--docs-per-file 10] [--share 0.25] [--stride 2] [--link-us 10] [--stream deferred|immediate]
        [--lockstep] [--json]
    python tools/bench/bench_stride.py --speed --predictor PRED.npz [--model M.gguf] [--threads 2] [--rounds 7]

Hit rates: every configuration runs the same held-out documents teacher-forced (64 prefill tokens, then
the document's next 64 tokens one decode step each) on the deferred copy stream (copies land later, out
of submission order, seen only through the readiness query) with a simulated link (``copy_delay_s``: each
expert tensor kind's copy takes ``--link-us`` microseconds on the link's timeline, in priority order, and
the link's thread, the stream's copy engine, lands it then; ``--stream-delay-ms`` adds the stream's own
random delay, after which a stream thread lands it; or
``--stream immediate --link-us -1``: copies land when issued, the predictor's ceiling), at
``--share`` of each layer's experts cached: sync LRU, sync LRU + the predictor (stride prefetch inside the
layers), async LRU, and async + the predictor (the mailbox: stride prefetch while the graph runs). A
prefetched expert its layer then read from its slot counts as a hit; the async decode's hits are what was
readable when its layer started.

``--speed``: decode tok/s with every expert cached, stock (no cache), async without and with the
predictor, rounds alternating (each engine first in turn), ``--threads`` compute threads (the core count:
the mailbox's reader must not steal the decode's cores); each ratio is the median over rounds of the
round's tok/s over that round's stock. Run alone on the machine.
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

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path
from ggmoe.trace.prompts import read_prompts

PREFILL, STEPS = 64, 64


def _teacher(eng: Engine, docs: list[str]) -> int:
    """Teacher-forced decode of every document; returns decode steps run."""
    steps = 0
    for doc in docs:
        ids = eng.tokenize(doc)
        if len(ids) < PREFILL + 2:
            continue
        eng.reset()
        eng.decode(ids[:PREFILL])
        for t in ids[PREFILL: PREFILL + STEPS]:
            eng.decode([t])
            steps += 1
    return steps


def _hits(model: Path, docs: list[str], cache: CacheConfig, threads: int) -> dict:
    with Engine(EngineConfig(model_path=model, n_ctx=256, n_threads=threads, run=cache)) as eng:
        mode = eng.decode_mode
        t0 = time.perf_counter()
        steps = _teacher(eng, docs)
        wall = time.perf_counter() - t0
        t = eng.cache_stats.total()
    return {"mode": mode["decode_mode_in_effect"], "copy_stream": mode["copy_stream"], "steps": steps,
            "hit_rate": t.hit_rate, "prefetch_issued": t.prefetch_issued, "prefetch_hits": t.prefetch_hits,
            "prefetch_late": t.prefetch_late, "prefetch_wasted": t.prefetch_wasted,
            "admission_copies": t.admission_copies, "pred_accuracy": t.pred_accuracy, "wall_s": wall}


def hit_rows(model: Path, docs: list[str], predictor: str, share: float, stride: int, link_s: float | None,
             threads: int) -> list[dict]:
    facts = inspect_model(model)
    n = max(facts.n_expert_used, round(share * facts.n_expert))
    pre = PrefetchConfig(predictor, stride=stride, in_graph=False)
    name = Path(predictor).name
    rows = []
    for label, mode, p in (("sync LRU", "sync", None), (f"sync LRU + {name} s{stride}", "sync", pre),
                           ("async LRU", "async", None), (f"async + {name} s{stride} (mailbox)", "async", pre)):
        cache = RunConfig(CacheConfig(n_slots=n, policy="lru"),
                          decode=DecodeConfig(mode=mode),
                          prefetch=p,
                          copy_delay_s=link_s)
        r = _hits(model, docs, cache, threads)
        rows.append({"config": label, "slots": n, **r})
        print(f"{label:<44} {r['mode']:<5} hit {r['hit_rate']:.1%}  prefetch used {r['prefetch_hits']} / "
              f"{r['prefetch_issued']} (late {r['prefetch_late']})  {r['wall_s']:.1f} s", file=sys.stderr)
    return rows


def speed_rows(model: Path, predictor: str, stride: int, threads: int, rounds: int = 7) -> dict:
    n = inspect_model(model).n_expert
    pre = PrefetchConfig(predictor, stride=stride, in_graph=False)

    def engine(cache: CacheConfig | None) -> Engine:
        return Engine(EngineConfig(model_path=model, n_ctx=512, n_threads=threads, run=cache))

    engines = {"stock (no cache)": engine(None),
               "async, every expert cached": engine(RunConfig(CacheConfig(n_slots=n),
                                                              decode=DecodeConfig(mode="async"))),
               "async + predictor (mailbox), every expert cached": engine(
                   RunConfig(CacheConfig(n_slots=n), decode=DecodeConfig(mode="async"), prefetch=pre))}
    ids = next(iter(engines.values())).tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n" * 4)
    names = list(engines)
    tps: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each engine first in turn
            eng = engines[name]
            eng.reset()
            eng.decode(ids[:16])
            t0 = time.perf_counter()
            for t in ids[16: 16 + 64]:
                eng.decode([t])
            tps[name].append(64 / (time.perf_counter() - t0))
    for eng in engines.values():
        eng.close()
    med = {k: statistics.median(v) for k, v in tps.items()}
    base = tps["stock (no cache)"]
    # the ratio is the median of each round's ratio to that round's stock: this VM's speed drifts by tens of
    # percent between rounds, which a ratio of medians taken over different rounds would carry
    ratios = {k: statistics.median(a / b for a, b in zip(v, base, strict=True)) for k, v in tps.items()}
    return {"decode_tps": med, "ratio_to_stock": ratios, "threads": threads, "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs", nargs="*", help="JSONL files of held-out documents")
    ap.add_argument("--predictor", required=True, help="PRED.npz (or a predictor name such as reuse)")
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--docs-per-file", type=int, default=10)
    ap.add_argument("--share", type=float, default=0.25, help="share of each layer's experts cached")
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--link-us", type=float, default=10.0,
                    help="simulated link: microseconds per tensor kind copied, on one copy thread (-1: no simulated "
                         "link, copies go straight to the stream)")
    ap.add_argument("--stream", choices=("deferred", "immediate"), default="deferred",
                    help="the CPU build's copy stream (immediate with --link-us -1: copies land when issued)")
    ap.add_argument("--stream-delay-ms", type=float, default=0.0,
                    help="the deferred stream's own largest random delay per copy (GGMOE_COPY_DELAY_MS)")
    ap.add_argument("--lockstep", action="store_true",
                    help="GGMOE_MAILBOX_LOCKSTEP=1: each layer waits until the mailbox's reader handled it (the CPU "
                         "build cannot give the reader the idle cores a GPU machine has; hit rates only)")
    ap.add_argument("--speed", action="store_true", help="decode speed with every expert cached instead")
    ap.add_argument("--rounds", type=int, default=7, help="--speed: alternating rounds of 64 decode steps")
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads (speed: default the core count; hit rates: default 1, so that on the CPU "
                         "build a core is left to what a GPU's copy engine and host thread would do)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.threads_set = a.threads is not None
    if a.threads is None:
        a.threads = os.cpu_count() or 1
    machine = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "model": str(a.model), "predictor": a.predictor}
    if a.speed:
        print(json.dumps({**machine, **speed_rows(a.model, a.predictor, a.stride, a.threads, a.rounds)}, indent=2))
        return 0
    if not a.docs:
        ap.error("give DOCS.jsonl files (or --speed)")
    os.environ["GGMOE_COPY_STREAM"] = a.stream  # deferred: the CPU build behaving like a GPU
    # the link is --link-us; the deferred stream adds no random delay of its own (copies still land on its
    # threads, out of order, seen only through the readiness query)
    os.environ["GGMOE_COPY_DELAY_MS"] = str(a.stream_delay_ms)
    if a.lockstep:  # the device waits for the host at each layer: a host that keeps pace, as on a GPU machine
        os.environ["GGMOE_MAILBOX_LOCKSTEP"] = "1"
    docs = [d for f in a.docs for d in read_prompts(f)[: a.docs_per_file]]
    threads = a.threads if a.threads_set else 1
    link_s = a.link_us * 1e-6 if a.link_us >= 0 else None
    rows = hit_rows(a.model, docs, a.predictor, a.share, a.stride, link_s, threads)
    out = {**machine, "docs": len(docs), "share": a.share, "link_us": a.link_us, "stream": a.stream,
           "threads": threads,
           "lockstep": a.lockstep,
           "stream_delay_ms": a.stream_delay_ms, "rows": rows}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"| configuration | mode | hit rate | prefetches used / issued (late) |   ({len(docs)} docs, "
          f"{rows[0]['slots']} slots/layer, link {a.link_us:g} us/kind, {a.stream} stream"
          f"{', mailbox lockstep' if a.lockstep else ''})")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['mode']} | {r['hit_rate']:.1%} | {r['prefetch_hits']} / {r['prefetch_issued']} "
              f"({r['prefetch_late']}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
