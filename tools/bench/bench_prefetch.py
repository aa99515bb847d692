"""Hit rate of the live cache with and without stride prefetching, on held-out teacher-forced documents.

    python tools/bench/bench_prefetch.py DOCS.jsonl [DOCS2.jsonl ...] --predictor PRED.npz [--docs 50]
        [--slots 8 16] [--stride 2] [--decode-mode sync|async|auto] [--json]

Each configuration runs the embedded model (or --model) over the same documents,
teacher-forced as ``ggmoe trace --mode teacher`` does (64 prefill tokens, 64
decode steps), with an LRU cache of N slots per layer: LRU alone, LRU plus the
predictor's prefetching, and the same with misses computed on the CPU, in the sync decode (the figures in
docs/benchmarks.md; ``--decode-mode async`` measures the async decode's mailbox prefetch, as ``ggmoe trace``
does on an async cache; its row of misses on the CPU stays sync, as the host path needs the route op). Reports
hit rate (prefetch hits included: a prefetched expert that was used is a hit),
prefetches issued and used, the predictor's run-time accuracy, and decode speed.
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.record import RecordConfig, record_trace
from ggmoe.models import default_model_path
from ggmoe.trace.prompts import read_prompts


def _run(model: Path, docs: list[str], cache: CacheConfig) -> dict:
    cfg = RecordConfig(mode="teacher", max_tokens=64, prefill_tokens=64, keep_hidden=False)
    with Engine(EngineConfig(model_path=model, n_ctx=512, run=cache)) as eng, \
            tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        record_trace(eng, docs, cfg, Path(tmp) / "trace.npz")
        wall = time.perf_counter() - t0
        t = eng.cache_stats.total()
    return {"hit_rate": t.hit_rate, "hits": t.hits, "misses": t.misses, "prefetch_issued": t.prefetch_issued,
            "prefetch_hits": t.prefetch_hits, "prefetch_wasted": t.prefetch_wasted,
            "pred_accuracy": t.pred_accuracy, "host_computed": t.host_computed, "wall_s": wall}


def _speed(model: Path, predictor: str, stride: int, rounds: int = 7, tokens: int = 64) -> dict:
    """Decode tok/s with every expert cached, prediction on and off, side by side (rounds alternate)."""
    import statistics

    from ggmoe.inspect import inspect_model

    n = inspect_model(model).n_expert

    def engine(pre: PrefetchConfig | None) -> Engine:
        return Engine(EngineConfig(model_path=model, n_ctx=512, run=RunConfig(CacheConfig(n_slots=n),
                                                                              prefetch=pre)))

    engines = {
        "cache-all": engine(None),
        "cache-all + prefetch (numpy)": engine(PrefetchConfig(predictor, stride=stride, in_graph=False)),
        "cache-all + prefetch (background)": engine(PrefetchConfig(predictor, stride=stride, background=True,
                                                                   in_graph=False)),
    }
    graph = engine(PrefetchConfig(predictor, stride=stride))
    if graph._graph_predictor is not None:  # the mlp predictor: its nets in the decode graph
        engines["cache-all + prefetch (in graph)"] = graph
    else:
        graph.close()
    ids = next(iter(engines.values())).tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n" * 4)
    tps: dict[str, list[float]] = {k: [] for k in engines}
    hook: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            eng.reset()
            eng.decode(ids[:16])
            eng.record_hook_times()
            t0 = time.perf_counter()
            for t in ids[16 : 16 + tokens]:
                eng.decode([t])
            tps[name].append(tokens / (time.perf_counter() - t0))
            hook[name].extend(eng.hook_times.tolist())
            eng.record_hook_times(False)
    for eng in engines.values():
        eng.close()
    med = {k: statistics.median(v) for k, v in tps.items()}
    p50 = {k: 1e6 * statistics.median(v) for k, v in hook.items()}
    return {"decode_tps": med, "ratio": {k: v / med["cache-all"] for k, v in med.items()}, "hook_p50_us": p50}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs", nargs="+", help="JSONL files of held-out documents")
    ap.add_argument("--predictor", required=True, help="PRED.npz (or a predictor name)")
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--docs-per-file", type=int, default=50)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--decode-mode", choices=("sync", "async", "auto"), default="sync",
                    help="the decode the rows run (sync: docs/benchmarks.md's figures)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--speed", action="store_true",
                    help="only the decode speed with every expert cached, prefetching on and off")
    a = ap.parse_args()
    if a.speed:
        r = _speed(a.model, a.predictor, a.stride)
        print(json.dumps(r, indent=2))
        return 0
    docs = [d for f in a.docs for d in read_prompts(f)[: a.docs_per_file]]
    rows = []
    for n in a.slots:
        pre = PrefetchConfig(a.predictor, stride=a.stride)
        mode = a.decode_mode
        for label, cache in (("lru", RunConfig(CacheConfig(n_slots=n), decode=DecodeConfig(mode=mode))),
                             (f"lru + {Path(a.predictor).name} s{a.stride}",
                              RunConfig(CacheConfig(n_slots=n),
                                        decode=DecodeConfig(mode=mode),
                                        prefetch=pre)),
                             (f"lru + {Path(a.predictor).name} s{a.stride} + cpu misses",
                              RunConfig(CacheConfig(n_slots=n),
                                        decode=DecodeConfig(miss_policy="cpu",
                                                            mode="sync" if mode == "async" else mode),
                                        prefetch=pre))):
            r = _run(a.model, docs, cache)
            rows.append({"slots": n, "config": label, **r})
            print(f"{n:>3} slots  {label:<40} hit {r['hit_rate']:.1%}  prefetch {r['prefetch_hits']}/"
                  f"{r['prefetch_issued']} used  pred acc {r['pred_accuracy']:.1%}  {r['wall_s']:.1f} s",
                  file=sys.stderr)
    out = {"model": str(a.model), "docs": len(docs), "machine": platform.processor() or platform.machine(),
           "rows": rows}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print("| slots/layer | configuration | hit rate | prefetches used / issued | predictor accuracy |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['slots']} | {r['config']} | {r['hit_rate']:.1%} | {r['prefetch_hits']} / "
                  f"{r['prefetch_issued']} | {r['pred_accuracy']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
