"""Aggregate decode speed of ``serve --parallel`` slots against one request at a time, side by side.

The same requests (short prompts, exactly ``--tokens`` tokens each: end tokens masked, greedy) run:

- one at a time on a model loaded as ``ggmoe serve`` loads it without ``--parallel`` (``GgmoeLlama.eval``);
- through 1, 2 and 4 slots of a model loaded with ``n_seq_max = 4`` (``ggmoe.engine.parallel.LanePool``, the
  code ``serve --parallel`` runs below HTTP): k client threads, each taking the next request as its slot
  frees, as k concurrent clients of the server would.

Each configuration runs ``--rounds`` times, interleaved, and the median is printed: generated tokens per
second of wall time over all requests and the process's CPU time per token, each with its ratio to one at a
time (CPU time is the steadier figure on a machine other jobs load). Writes nothing.

    PYTHONPATH=. python tools/bench/bench_parallel.py [--model M] [--requests 16] [--tokens 64] [--rounds 5]
                                                [--cache-slots 16] [--threads 1] [--no-kv-unified]
                                                [--flash-attn]
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import threading
import time
from typing import Any

import llama_cpp
import numpy as np

import ggmoe
from ggmoe.engine.parallel import LanePool

PROMPTS = ("The king of France", "Once upon a time", "In the year 1900, the", "Water is made of",
           "def main():", "The river", "A list of", "It was the best of times")
SLOT_COUNTS = (1, 2, 4)


def _no_end(llm: Any) -> llama_cpp.LogitsProcessorList:
    """End tokens masked: every request generates exactly max_tokens tokens."""
    eog = np.array([t for t in range(llm.n_vocab()) if llm.is_eog(t)], dtype=np.intc)

    def mask(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[eog] = -np.inf
        return scores

    return llama_cpp.LogitsProcessorList([mask])


class DecodeClock:
    """Wall seconds inside a model's decodes (``eval`` one at a time, ``decode_sequences`` for the slots; the
    ggmoe pipeline around each included): what is left of a run's time is the requests' Python and, with
    slots, their threads waiting for each other."""

    def __init__(self, llm: Any, name: str) -> None:
        self.seconds = 0.0
        inner = getattr(llm, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(llm, name, timed)  # on the instance: the one model object every slot decodes through


def _request(llm: Any, i: int, n_tokens: int, procs: Any) -> int:
    out = llm.create_completion(PROMPTS[i % len(PROMPTS)], max_tokens=n_tokens, temperature=0.0,
                                logits_processor=procs)
    return out["usage"]["completion_tokens"]


def one_at_a_time(llm: Any, n_requests: int, n_tokens: int, clock: DecodeClock) -> tuple[float, float, int, float]:
    """Wall seconds, CPU seconds of the process, tokens generated, wall seconds inside decodes."""
    procs = _no_end(llm)
    d0 = clock.seconds
    t0, c0 = time.perf_counter(), time.process_time()
    done = sum(_request(llm, i, n_tokens, procs) for i in range(n_requests))
    return time.perf_counter() - t0, time.process_time() - c0, done, clock.seconds - d0


def through_slots(pool: LanePool, k: int, n_requests: int, n_tokens: int,
                  clock: DecodeClock) -> tuple[float, float, int, float]:
    """k client threads on slots 0..k-1, each taking the next request when its last one ends."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(n_requests):
        todo.put(i)
    done = [0] * k
    procs = _no_end(pool.llama)

    def client(slot: int) -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            done[slot] += _request(pool.lanes[slot], i, n_tokens, procs)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(k)]
    d0 = clock.seconds
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, time.process_time() - c0, sum(done), clock.seconds - d0


def _print_table(runs: dict[str, list[tuple[float, float, int, float]]]) -> None:
    base = statistics.median(n / w for w, _, n, _ in runs["one at a time"])
    base_cpu = statistics.median(c / n for _, c, n, _ in runs["one at a time"])
    print("tok/s: generated tokens per second of wall time; CPU: the process's CPU time per generated token; "
          "decode / rest: wall ms per token inside the decodes (pipeline included) / outside them")
    print(f"{'':<14} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'x one at a time':>16} {'CPU ms/tok':>11} "
          f"{'x one at a time':>16} {'decode':>7} {'rest':>6}")
    for name, rs in runs.items():
        rate = statistics.median(n / w for w, _, n, _ in rs)
        secs = statistics.median(w for w, _, _, _ in rs)
        cpu = statistics.median(c / n for _, c, n, _ in rs)
        dec = statistics.median(d / n for _, _, n, d in rs)
        rest = statistics.median((w - d) / n for w, _, n, d in rs)
        print(f"{name:<14} {rs[0][2]:>7} {secs:>8.2f} {rate:>8.0f} {rate / base:>15.2f}x {cpu * 1e3:>11.3f} "
              f"{base_cpu / cpu:>15.2f}x {dec * 1e3:>7.3f} {rest * 1e3:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded tiny-moe)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-slots", type=int, default=16, help="expert cache slots per MoE layer (0: no cache)")
    ap.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=True,
                    help="the slots' sequences in one KV cache (serve's default), or a stream each")
    ap.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=False,
                    help="llama.cpp's flash attention, in both models (llama-cpp-python's default: off)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads, one token and several alike "
                                                               "(default: llama-cpp-python's)")
    a = ap.parse_args()
    kw: dict[str, Any] = {"n_ctx": 256 * max(SLOT_COUNTS), "seed": 1}
    if a.cache_slots:
        kw["cache_slots"] = a.cache_slots
    if a.threads:
        kw.update(n_threads=a.threads, n_threads_batch=a.threads)
    kw["flash_attn"] = a.flash_attn
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start "
          "(measured under load from other jobs where that is above 0)")
    with ggmoe.load(a.model, **kw) as serial, ggmoe.load(a.model, n_seq_max=max(SLOT_COUNTS), kv_unified=a.kv_unified, **kw) as par:
        pool = LanePool(par, max(SLOT_COUNTS))
        serial_clock, slots_clock = DecodeClock(serial, "eval"), DecodeClock(par, "decode_sequences")
        att = par.attachment
        print(f"model: {a.model or 'tiny-moe (embedded)'}; cache: "
              f"{f'{a.cache_slots} slots/layer, {att.mode_in_effect}' if att is not None else 'none'}; threads: "
              f"{par.context_params.n_threads} (one token), {par.context_params.n_threads_batch} (several); KV "
              f"{'unified' if a.kv_unified else 'a stream per slot'}; flash attention {'on' if a.flash_attn else 'off'}; "
              f"{a.requests} requests x {a.tokens} tokens, greedy, median of {a.rounds} rounds")
        runs: dict[str, list[tuple[float, float, int, float]]] = {"one at a time": []}
        runs.update({f"{k} slot{'s' if k > 1 else ''}": [] for k in SLOT_COUNTS})
        try:
            for _ in range(a.rounds):
                runs["one at a time"].append(one_at_a_time(serial, a.requests, a.tokens, serial_clock))
                for k in SLOT_COUNTS:
                    runs[f"{k} slot{'s' if k > 1 else ''}"].append(
                        through_slots(pool, k, a.requests, a.tokens, slots_clock))
        finally:
            pool.close()
    _print_table(runs)
    steps = pool.batcher.stats
    widths = ", ".join(f"{w}: {n}" for w, n in sorted(steps.by_width.items()))
    print(f"batcher steps by sequences per llama_decode (all runs): {widths}; "
          f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
