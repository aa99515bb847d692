"""One ``llama_decode`` of 1 token against one of N sequences x 1 token, on a model (the embedded one by default).

Prints, with and without ggmoe's expert cache, the median seconds of each decode over many repetitions (the
two alternate in blocks of ten, so load from other jobs hits both alike while llama.cpp reuses each shape's
graph as a real decode does; each block's first decode, which rebuilds it, is not counted), and the
throughput ratio N x t(1) / t(N): how many times more tokens per second N sequences decoded together give
than one. Writes nothing.

    PYTHONPATH=. python tools/bench/bench_seq_decode.py [--model M] [--sequences 4] [--reps 300] [--cache-slots 16]
                                               [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import ggmoe
from ggmoe.engine.sequences import SeqEntry

PROMPT = 8  # tokens of each sequence before timing starts
BLOCK = 10  # decodes of one shape in a row (the two shapes alternate by block)


def llm_threads(kw: dict[str, Any]) -> str:
    if "n_threads" in kw:
        return f"{kw['n_threads']} (one and several tokens alike)"
    return (f"llama-cpp-python's defaults: {max(os.cpu_count() // 2, 1)} for one token, {os.cpu_count()} for "
            "several (llama.cpp's n_threads / n_threads_batch)")


def _timed(llm: Any, entries: list[SeqEntry], out: dict[str, list[float]]) -> None:
    for e in entries:  # the same positions each repetition: the KV cache never fills
        llm._ctx.kv_cache_seq_rm(e.seq_id, PROMPT, -1)
    w0, c0 = time.perf_counter(), time.process_time()
    llm.decode_sequences(entries)
    out["wall"].append(time.perf_counter() - w0)
    out["cpu"].append(time.process_time() - c0)


def _time_decodes(llm: Any, n_seq: int, reps: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of a 1-sequence and of an n_seq-sequence single-token decode
    (alternating): {"wall": (t1, tn), "cpu": (t1, tn)}."""
    for s in range(n_seq):
        llm.decode_sequences([SeqEntry(s, 0, tuple(range(10 + s, 10 + s + PROMPT)))])
    one: dict[str, list[float]] = {"wall": [], "cpu": []}
    many: dict[str, list[float]] = {"wall": [], "cpu": []}
    for r in range(0, reps, BLOCK):  # blocks of one shape: llama.cpp reuses the graph as in a real decode
        for shape, out in ((1, one), (n_seq, many)):
            for i in range(BLOCK + 1):
                tok = 100 + (r + i) % 50
                _timed(llm, [SeqEntry(s, PROMPT, (tok,)) for s in range(shape)], out)
            del out["wall"][-BLOCK - 1], out["cpu"][-BLOCK - 1]  # the block's first decode rebuilt the graph
    return {k: (statistics.median(one[k]), statistics.median(many[k])) for k in one}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded tiny-moe)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--cache-slots", type=int, default=16, help="slots per MoE layer in the cached run")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    kw = {"n_ctx": 256 * a.sequences, "n_seq_max": a.sequences, "seed": 1}
    if a.threads:
        kw.update(n_threads=a.threads, n_threads_batch=a.threads)
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start "
          f"(measured under load from other jobs where that is above 0)")
    print(f"threads: {llm_threads(kw)}; wall = elapsed time, cpu = this process's CPU time (less sensitive to load)")
    print(f"{'cache':<24} {'clock':<5} {'1 seq (ms)':>11} {f'{a.sequences} seq (ms)':>11} {'tok/s ratio':>12}")
    for label, cache in (("none", {}), (f"{a.cache_slots} slots/layer", {"cache_slots": a.cache_slots})):
        with ggmoe.load(a.model, **cache, **kw) as llm:
            att = llm.attachment
            mode = att.mode_in_effect if att is not None else None
            times = _time_decodes(llm, a.sequences, a.reps)
        name = f"{label} ({mode})" if mode else label
        for clock, (t1, tn) in times.items():
            print(f"{name:<24} {clock:<5} {t1 * 1e3:>11.3f} {tn * 1e3:>11.3f} {a.sequences * t1 / tn:>11.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} at end; median of {a.reps} decodes each")


if __name__ == "__main__":
    main()
