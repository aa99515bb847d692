"""Measure this machine through the engine: the figures of a hardware profile (``ggmoe calibrate``).

Every figure is measured on the loaded model, medians of repeated runs:

- copies: each expert tensor kind of layer 0's expert 0 copied into a cache slot through the engine's own
  copy path (a ``ggml_backend_tensor_set[_async]`` on the copy stream, then a synchronize), and the whole
  expert; a least-squares line through (bytes, seconds) gives the bandwidth and the fixed cost per copy.
  On a CPU-only build the "device" is host memory: the figure is a memcpy, not a PCIe link, and is
  reported as such.
- decode: seconds per token of greedy decoding with the experts in host memory computed by the CPU
  (``-ot exps=CPU``) and, with a GPU, with every expert resident on the device (a cache holding all of
  them). The CPU's rate is the expert bytes a token reads divided by the seconds the host experts add
  (with a GPU), or by the whole token (CPU-only: every weight is streamed from the same memory).
- the route hook: seconds per callback with every expert cached (``Engine.record_hook_times``).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ggmoe.base.context import check_prompt, decode_batch
from ggmoe.cache import CacheConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import ggml as B
from ggmoe.engine.disk import disk_points
from ggmoe.engine.engine import Engine, EngineConfig
from ggmoe.engine.loader import gpu_device_name

PROMPT = "The expert cache keeps the experts a model uses most on the device, and the rest in host memory."


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured (seconds, bytes); None where this machine has nothing to measure."""

    gpu: str | None  # the GPU's name, None on a CPU-only build
    cpu: str  # the processor, as the OS names it
    copy_points: tuple[tuple[int, float], ...]  # (bytes, seconds) per measured copy
    copy_bytes_per_s: float  # bytes/s of the line through copy_points
    copy_latency_s: float  # s, its intercept (0 when it fits below 0)
    token_host_s: float  # s per decoded token, experts computed by the CPU from host memory
    token_device_s: float | None  # s per decoded token, every expert resident on the GPU (None: no GPU)
    bytes_per_token: int  # weights a token reads: dense + n_moe_layers * k * bytes per expert
    expert_bytes_per_token: int  # of which experts
    n_moe_layers: int
    n_expert_used: int
    bytes_per_expert: int  # bytes, layer 0
    cpu_bytes_per_s: float  # expert bytes the CPU multiplies per second
    gpu_bytes_per_s: float | None  # weights the GPU reads per second at batch 1 (None: no GPU)
    hook_s: float  # s per route callback, median
    notes: tuple[str, ...] = field(default=())  # what was not measured, and why
    disk_points: tuple[tuple[int, float], ...] = ()  # (bytes, seconds) per timed read of the model file
    disk_bytes_per_s: float | None = None  # bytes/s of the line through disk_points (None: not measured)
    disk_latency_s: float | None = None  # s, its intercept

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["copy_points"] = [list(p) for p in self.copy_points]
        d["disk_points"] = [list(p) for p in self.disk_points]
        d["notes"] = list(self.notes)
        return d


def cpu_name() -> str:
    """The processor as the OS names it (/proc/cpuinfo's model name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _copy_points(eng: Engine, repeat: int) -> list[tuple[int, float]]:
    """(bytes, seconds) of single-kind copies and whole-expert copies into slot 0 of the first layer."""
    runtime = eng._runtime
    copies, pairs = runtime.stream, runtime.slots.pairs
    il = next(iter(pairs))
    backend = getattr(copies, "backend", None)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if backend:
            B.libggml_base.ggml_backend_synchronize(backend)
        return time.perf_counter() - t0

    points = []
    for i, p in enumerate(pairs[il]):
        ts = [timed(lambda i=i: copies.copy_chunk(il, 0, 0, i)) for _ in range(repeat)]
        points.append((int(p.nb2), _median(ts)))
    whole = sum(int(p.nb2) for p in pairs[il])
    ts = [timed(lambda: copies.copy_now(il, 0, 0)) for _ in range(repeat)]
    points.append((whole, _median(ts)))
    return points


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(bytes per second, latency s) of the least-squares line seconds = latency + bytes / bandwidth."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
    else:
        slope, intercept = float(y.mean() / x.mean()), 0.0
    if slope <= 0:  # timing noise swamped the size: bandwidth from the largest copy alone
        i = int(np.argmax(x))
        return float(x[i] / max(y[i], 1e-9)), 0.0
    return float(1.0 / slope), float(max(intercept, 0.0))


def _decode_s(eng: Engine, n_tokens: int, repeat: int) -> float:
    """Median seconds per decoded token of ``repeat`` greedy generations (after one warm-up)."""
    eng.generate(PROMPT, max_tokens=4)  # first touch of the weights, graph allocation
    per_token = []
    for _ in range(repeat):
        t = eng.generate(PROMPT, max_tokens=n_tokens).timings
        per_token.append(t.decode_s / max(t.decode_tokens, 1))
    return _median(per_token)


def calibrate(model: Path, n_threads: int, n_tokens: int = 32, repeat: int = 5) -> Calibration:
    """Measure the machine on ``model`` (the embedded one is enough for copies and rates)."""
    from ggmoe.inspect import inspect_model

    facts = inspect_model(model)
    gpu = gpu_device_name()
    notes: list[str] = []
    k, n_moe = facts.n_expert_used, len(facts.moe_layers)
    bpe = facts.bytes_per_expert(facts.moe_layers[0])
    expert_bytes = sum(facts.bytes_per_expert(il) for il in facts.moe_layers) * k
    dense_bytes = facts.dense_bytes  # bytes; the token embedding is counted whole (a token reads one row)
    all_cached = RunConfig(CacheConfig(n_slots=facts.n_expert, policy="lru"))
    n_ctx = 512 + n_tokens  # the prompt and every timed token: a generation never stops early on a full context
    base = {"model_path": model, "n_ctx": n_ctx, "n_threads": n_threads, "n_batch": decode_batch(n_ctx),
            "n_ubatch": decode_batch(n_ctx)}

    # copies and the hook: a cache that holds every expert (copied in once, then all hits)
    with Engine(EngineConfig(**base, run=all_cached)) as eng:
        check_prompt(len(eng.tokenize(PROMPT)), eng.n_ctx, "the calibration prompt", room=n_tokens)
        points = _copy_points(eng, repeat)
        eng.generate(PROMPT, max_tokens=4)
        eng.record_hook_times()
        eng.generate(PROMPT, max_tokens=n_tokens)
        hook_s = float(np.median(eng.hook_times)) if eng.hook_times.size else 0.0
        eng.record_hook_times(False)
        token_cached_s = _decode_s(eng, n_tokens, repeat) if gpu else None
    copy_bps, copy_lat = _fit(points)
    if not gpu:
        notes.append("CPU-only build: the copy figures are a host memcpy into CPU memory, not a PCIe link")

    with Engine(EngineConfig(**base, gate_hook=False)) as eng:
        token_host_s = _decode_s(eng, n_tokens, repeat)
    if gpu and token_cached_s is not None and token_host_s > token_cached_s:
        cpu_bps = expert_bytes / (token_host_s - token_cached_s)
        gpu_bps = (dense_bytes + expert_bytes) / token_cached_s
    else:
        cpu_bps = (dense_bytes + expert_bytes) / token_host_s
        gpu_bps = None
        if gpu:
            notes.append("the host experts did not slow decoding measurably: CPU rate from the whole token")
        else:
            notes.append("CPU-only build: no GPU figures; the CPU rate is the weights a token reads over its "
                         "decode time (every weight is streamed from the same memory)")
    disk, direct = disk_points(model, repeat)
    disk_bps, disk_lat = _fit(disk)
    if not direct:
        notes.append("the model's filesystem refuses O_DIRECT: the disk reads dropped their pages first")
    return Calibration(gpu=gpu, cpu=cpu_name(), copy_points=tuple(points), copy_bytes_per_s=copy_bps,
                       copy_latency_s=copy_lat, token_host_s=token_host_s, token_device_s=token_cached_s,
                       bytes_per_token=dense_bytes + expert_bytes, expert_bytes_per_token=expert_bytes,
                       n_moe_layers=n_moe, n_expert_used=k, bytes_per_expert=bpe, cpu_bytes_per_s=cpu_bps,
                       gpu_bytes_per_s=gpu_bps, hook_s=hook_s, notes=tuple(notes), disk_points=tuple(disk),
                       disk_bytes_per_s=disk_bps, disk_latency_s=disk_lat)
