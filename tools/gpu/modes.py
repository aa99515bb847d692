#!/usr/bin/env python3
"""One minute, every decode mode: greedy tokens beside stock's, and hits where the cache must hit.

The GPU loan's first check after the engine loads (tools/gpu/pipeline.py, step "modes"): for one model,
stock (every weight on the device, no hook) decodes --tokens greedy tokens; then each mode, at --fraction
of the experts cached per layer, decodes the same, each in its own process with a time limit (a CUDA fault
loses one mode):

    sync         the route op per MoE layer, LRU, misses copied and waited for
    async        the device-side expert tables, in-graph fills of one-token decodes (patch 0012), LRU admissions
                 of the rest between tokens
    host         sync with the host path (--miss-policy cpu: the CPU computes misses)
    prefetch     sync with stride prefetching (reuse predictor, stride 1)
    async-prefetch  async with stride prefetching from the mailbox (patch 0010: reuse, stride 1)
    split        MoEpic's split (θ 1/2) in the sync decode
    split-async  the split in the async decode

Stock decodes in the modes' micro-batches (n_ubatch 4), so that every matmul runs the same kernel on the
same values: a mode whose experts are all computed on the GPU (sync, async, prefetch, split) is the same
arithmetic as stock and passes when its tokens equal stock's (async: and its cache hit). host passes when
it ran, hit, and its prompt's logits lie within HOST_DRIFT of stock's (the largest difference over stock's
largest logit): its misses run the CPU's kernels, whose rounding differs from the GPU's, and a real-shape
model of random weights turns any rounding difference into other tokens within a few steps (even stock
with other micro-batch sizes parts from itself), while an expert lost or counted twice moves logits by their
own size (two host entries of a token on one zero slot, which CUDA's mul_mat_id counts once: patch 0011).
Writes OUT/modes.json
(per mode: tokens equal, hits, misses, decode mode in effect, copy stream, seconds, error) and prints a table;
exit 1 if a mode failed. On the CPU build it runs as it would on a GPU with GGMOE_COPY_STREAM=deferred.

    python tools/gpu/modes.py --model M.gguf --out DIR [--fraction 0.5] [--tokens 24] [--modes sync,async]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from tools.gpu.faults import cause  # noqa: E402

MODES = ("sync", "async", "host", "prefetch", "async-prefetch", "split", "split-async")
PROMPT = list(range(3, 40))  # token ids: a prompt every vocabulary has
HOST_DRIFT = 0.05  # host's largest prompt-logit difference from stock's, over stock's largest |logit|
# The rounding floor: stock with its experts in host memory, which llama.cpp computes on the CPU at the modes'
# 4-token micro-batches (below its offload batch). Every expert on the CPU's kernels: host (only its misses
# there) should drift from stock no more than this run does (docs/benchmarks.md has the H100's figures).
FLOOR = "cpu-experts"


def engine_config(model: Path, mode: str | None, fraction: float, gpu: bool):
    """The engine configuration of ``mode`` (None: stock, no hook) at ``fraction`` of the experts cached."""
    from ggmoe.cache import CacheConfig
    from ggmoe.cache.decode_mode import DecodeConfig
    from ggmoe.control.prefetch import PrefetchConfig
    from ggmoe.control.run_config import RunConfig
    from ggmoe.engine import EngineConfig
    from ggmoe.inspect import inspect_model

    layers = -1 if gpu else 0
    if mode in (None, FLOOR):  # the modes' micro-batches (below): the same kernels on the same values
        return EngineConfig(model_path=model, n_ctx=256, n_gpu_layers=layers, experts_on_host=mode == FLOOR,
                            gate_hook=False, n_batch=64, n_ubatch=4)
    facts = inspect_model(model)
    n = max(facts.n_expert_used + 1, round(fraction * facts.n_expert))
    decode = DecodeConfig(mode="async" if mode in ("async", "async-prefetch", "split-async") else "sync",
                          miss_policy="cpu" if mode == "host" else "wait")
    pre = PrefetchConfig("reuse", stride=1) if mode in ("prefetch", "async-prefetch") else None
    theta = {il: 0.5 for il in facts.moe_layers} if mode.startswith("split") else None
    run = RunConfig(CacheConfig(n_slots=n, layer_theta=theta), decode, prefetch=pre)
    return EngineConfig(model_path=model, n_ctx=256, n_gpu_layers=layers, n_batch=64, n_ubatch=4, run=run)


def greedy(model: Path, mode: str | None, fraction: float, tokens: int, gpu: bool,
           save_logits: Path | None = None, emit=None) -> dict:
    """Decode ``tokens`` greedy tokens after the prompt in ``mode``; the tokens and the cache's counts.
    ``save_logits``: where the prompt's logits go (.npy), for the parent to compare. ``emit``: called with the
    result before the engine closes (a child prints it then: a process that dies in teardown still hands over
    what it decoded)."""
    import numpy as np

    from ggmoe.engine import Engine

    with Engine(engine_config(model, mode, fraction, gpu)) as eng:
        logits = eng.decode(PROMPT)
        if save_logits is not None:
            np.save(save_logits, np.asarray(logits, dtype=np.float32))
        out = []
        for _ in range(tokens):
            out.append(int(np.argmax(logits)))
            logits = eng.decode([out[-1]])
        cached = mode not in (None, FLOOR)
        st = eng.cache_stats.total() if cached else None
        info = eng.decode_mode if cached else {}
        stream = eng._runtime.stream.stream.name if cached else None
        result = {"tokens": out, "hits": st.hits if st else None, "misses": st.misses if st else None,
                  "decode_mode": info.get("decode_mode_in_effect"), "copy_stream": stream}
        if emit is not None:
            emit(result)
    return result


def run_mode(a, mode: str | None) -> dict:
    """One mode in a child process with a time limit; its result, or why it failed."""
    cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--model", str(a.model), "--out", str(a.out),
           "--fraction", str(a.fraction), "--tokens", str(a.tokens), "--one", mode or "stock",
           *(["--cpu"] if a.cpu else [])]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {a.timeout:.0f} s", "seconds": round(time.monotonic() - t0, 1)}
    secs = round(time.monotonic() - t0, 1)
    decoded = last_json(r.stdout)
    if r.returncode != 0:
        why = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        tail = cause(r.stderr, r.stdout)
        after = "decoded, then died in teardown: " if decoded else ""
        return {**(decoded or {}), "error": f"{after}{why}: {tail}"[:600], "seconds": secs}
    return {**(decoded or {}), "seconds": secs}


def last_json(stdout: str) -> dict | None:
    """The child's result: its JSON line (the last line of stdout that parses), or None."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            got = json.loads(line)
        except ValueError:
            continue
        if isinstance(got, dict):
            return got
    return None


def verdicts(stock: dict, results: dict[str, dict], drift: dict[str, float] | None = None) -> dict[str, dict]:
    """Each mode's result with ``ok`` and, when not, ``why``: tokens equal stock's (host: its prompt's logits
    within the larger of HOST_DRIFT and the rounding floor's, ``drift``: mode -> largest difference over
    stock's largest logit, FLOOR among them when it ran); async and host hit; ``same_as_stock``: how many
    leading tokens equal stock's."""
    out, drift = {}, drift or {}
    allowed = max(HOST_DRIFT, drift.get(FLOOR, 0.0))
    for mode, r in results.items():
        why = r.get("error") or stock.get("error")
        if why is None:
            pairs = list(zip(r["tokens"], stock["tokens"], strict=True))
            r = {**r, "same_as_stock": next((i for i, (x, y) in enumerate(pairs) if x != y), len(pairs))}
            if mode in drift:
                r["prompt_drift"] = round(drift[mode], 6)
        if why is None and mode != "host" and r["tokens"] != stock["tokens"]:
            why = f"tokens differ from stock's from token {r['same_as_stock']}"
        if why is None and mode == "host" and drift.get(mode, 0.0) > allowed:
            floor = f", the CPU's rounding floor {drift[FLOOR]:.3f}" if FLOOR in drift else ""
            why = (f"its prompt's logits differ from stock's by {drift[mode]:.3f} of their size (> {HOST_DRIFT}"
                   f"{floor})")
        if why is None and mode in ("async", "host") and not r["hits"]:
            why = f"the {mode} decode never hit its cache"
        out[mode] = {**r, "ok": why is None, **({"why": why} if why else {})}
    return out


def logits_path(out: Path, name: str) -> Path:
    return out / f"prompt-logits-{name}.npy"


def prompt_drift(out: Path, modes: list[str]) -> dict[str, float]:
    """Each mode's largest prompt-logit difference from stock's, over stock's largest |logit| (modes whose
    child saved its logits)."""
    import numpy as np

    if not logits_path(out, "stock").is_file():
        return {}
    ref = np.load(logits_path(out, "stock"))
    scale = float(np.abs(ref).max()) or 1.0
    return {m: float(np.abs(np.load(logits_path(out, m)) - ref).max()) / scale
            for m in modes if logits_path(out, m).is_file()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fraction", type=float, default=0.5, help="experts cached per layer (0, 1]")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens decoded per mode")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one mode's process may run")
    ap.add_argument("--cpu", action="store_true", help="no GPU: every layer on the CPU")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one mode, its JSON on the last stdout line
    a = ap.parse_args(argv)
    if a.one:
        mode = None if a.one == "stock" else a.one
        greedy(a.model, mode, a.fraction, a.tokens, not a.cpu, logits_path(a.out, a.one),
               emit=lambda r: print(json.dumps(r), flush=True))
        return 0
    modes = [m for m in a.modes.split(",") if m]
    if not a.model.is_file() or set(modes) - set(MODES) or not 0 < a.fraction <= 1:
        raise SystemExit(f"error: need an existing --model, --modes from {', '.join(MODES)}, --fraction in (0, 1]")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in ("stock", FLOOR, *modes):  # a child that fails saves none: an earlier run's file must not stand in
        logits_path(a.out, name).unlink(missing_ok=True)
    stock = run_mode(a, None)
    floor = run_mode(a, FLOOR) if "host" in modes else None  # --cpu: the same kernels as stock, drift 0
    ran = {m: run_mode(a, m) for m in modes}
    drift = prompt_drift(a.out, [*modes, FLOOR])
    result = verdicts(stock, ran, drift)
    (a.out / "modes.json").write_text(json.dumps({"model": str(a.model), "fraction": a.fraction,
                                                  "tokens": a.tokens, "stock": stock, "modes": result,
                                                  "floor": floor and {**floor, "prompt_drift": drift.get(FLOOR)}},
                                                 indent=2))
    print(f"{'mode':12} {'ok':4} {'hits':>6} {'misses':>6} {'mode in effect':14} {'stream':9} {'s':>5}  why")
    for m, r in result.items():
        print(f"{m:12} {'yes' if r['ok'] else 'NO':4} {r.get('hits') or 0:>6} {r.get('misses') or 0:>6} "
              f"{r.get('decode_mode') or '-':14} {r.get('copy_stream') or '-':9} {r['seconds']:>5.0f}  {r.get('why', '')}")
    return 0 if all(r["ok"] for r in result.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
