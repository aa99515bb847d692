#!/usr/bin/env python3
"""The benchmark matrix: stock llama.cpp baselines against ggmoe's cache, per routing source and cache size.

For one model, for each routing source (``random``: the model's own router; ``trace``: trace-replay
routing, benchmark only, see trace_routing.py) and each configuration:

    stock-vram   stock llama.cpp, every weight in VRAM (the ceiling; needs the VRAM)
    stock-cpu    stock, experts in host memory computed by the CPU (llama.cpp's -ot exps=CPU)
    n-cpu-moe    stock, whole layers' experts on the GPU at the cache's VRAM, the rest on the host
                 (llama.cpp's --n-cpu-moe)
    lru          ggmoe, on-demand LRU in the sync decode: every miss copied and waited for at its layer
                 (llama.cpp's --moe-cache-mib design)
    async        ggmoe's async decode without fills: experts read through the device-side table (misses by the
                 GPU from pinned host memory), LRU admissions between tokens, one graph per token (each miss
                 crosses the link twice: read in place, then admitted); at 100 % still through the tables
                 (DecodeConfig(identity=False)), where the async-fill rows read every slot with stock's matmuls
    async-fill   the async decode with in-graph fills (patch 0012, the default): the graph copies a layer's
                 misses into fill slots chosen between tokens and reads them there (one crossing per miss)
    async-fill-prefetch  async-fill with the mailbox's stride prefetch (reuse, stride 2): prefetched experts
                 are hits, the rest fills
    async-fill-tinylfu  async-fill under tinylfu: a miss takes a victim's fill slot only when the layer used
                 it more often than the victim (the simulator's fastest row on the shared real routing)
    async-fill-host  async-fill with --miss-policy cpu: the graph's host part computes every miss on the CPU
                 beside the device part's hits (patch 0016), the misses admitted after the token
    async-fill-auto  async-fill with --miss-policy auto: each layer's misses go to the host part where the
                 engine's measured costs put the CPU ahead of the graph's read over the link, else filled
    split        MoEpic's expert split in the sync decode, LRU: each slot holds an expert's top segment (a share
                 θ of its neurons, --split-theta), as many tops as fit the VRAM of the lru row's whole experts;
                 a top-only hit reads the bottom, a miss the whole expert, from pinned host memory (zero-copy);
                 the top of a miss is admitted (fractions below 100 % only)
    split-async  the same split in the async decode (admissions between tokens)
    async-tinylfu  the async decode with tinylfu: LRU eviction, and a miss read in place admitted only if the
                 layer used it more often than LRU's victim (the simulator: 7.3 against async LRU's 13.7 ms a
                 token at 50 % on the shared DeepSeek-V2-Lite routing, H100 profile; docs/policies.md)
    async-prefetch  the async decode with the mailbox's stride prefetch (reuse, stride 2: each layer's
                 experts predicted two layers ahead while the graph runs, into free slots; the
                 simulator's real-shape row of docs/policies.md)
    prefetch     ggmoe, stride prefetching (reuse predictor, stride 1) and the host path (--miss-policy auto)
    prefetch-eam the same with MoE-Infinity's EAM predictor trained on the tiled trace's other prompts
                 (trace routing only)
    prefetch-bg  prefetch with the predictor on a worker thread (PrefetchConfig.background; not in the
                 default --configs: its counts depend on timing)
    lru-auto     lru with --miss-policy auto (not in the default --configs): what the host path costs
                 where auto keeps it, or that it was dropped
    lru-host     lru with --miss-policy cpu (not in the default --configs): every miss computed on the CPU,
                 its copy admitted behind; the host path measured where auto's cost model would drop it
                 (lru-auto and lru-host keep the host part in the main graph, after the device part)
    hybrid       lru with --miss-policy auto, the host part on a worker beside the device part: a layer
                 waits for its copies while the CPU computes its share of the misses (patch 0015; the
                 simulator's hybrid decode)
    hybrid-spin  hybrid with the worker on one core fewer than the machine's (not in the default --configs), so
                 that its hand-off spins instead of sleeping (patch 0018): the default worker takes every core
    prefetch-wait  prefetch with --miss-policy wait (not in the default --configs): what prediction costs
                 without the host path
    prefetch-mlp ggmoe's own configuration: an mlp predictor (hidden 1024) at stride 2, computed in the
                 decode graph, --miss-policy auto; its weights are RANDOM (no trained predictor exists for
                 these random-weight models), so the row measures what the mlp costs, not what it predicts

at each fraction of experts cacheable (--fractions; the stock-vram and stock-cpu rows do not depend on it
and run once; stock rows always route with the model's router: routing does not change what they compute,
so they stand for both routings). Each cell: decode tok/s (median of --runs generations), prefill tok/s of
a --prefill-tokens prompt, TTFT (that prefill and the first token), hit rate, the route callback's median
µs per MoE layer call, experts computed on the CPU. Once per model (unless --no-calibrate): ``ggmoe
calibrate``'s measurements (pinned host-to-device copy bandwidth, CPU time per expert, the route hook),
the hardware profile made of them, and the simulator's TPOT estimate for every cell on the same routing
(random: a trace recorded of the model's own router on the generation's prompt; trace: the held-out tiled
trace) beside the measured TPOT. Then the issue's goals, checked at 50 %.

The split rows' θ is the smallest top share at or above --split-theta (default 0.5) that the down tensor's
quant blocks can represent (Qwen3-30B-A3B's 768 neurons in Q4_K blocks of 256: 2/3; gpt-oss-20b's 2880 in
MXFP4 blocks of 32: 1/2); a model with none below 1 runs no split rows (said in the results).

With --probe (the zero-copy probe's JSON, tools/gpu/zero_copy_probe.cu), every ggmoe cell also gets its
bound: stock-vram's TPOT plus the bytes that crossed the link per token over the measured bandwidth (the
async decode's host reads at the zero-copy rate, the sync mode's copies at the copy engine's).

Results are written after every cell (a command stopped at its time limit still leaves them):
OUT/matrix.json and OUT/matrix.md. ``--append`` adds to an earlier run's OUT/matrix.json (say, the other
routing in a second command), replacing cells measured again.

    python tools/gpu/matrix.py --model M.gguf --trace TRACE.npz --out DIR [--routing random,trace]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from ggmoe.cache import CacheConfig  # noqa: E402
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import PrefetchConfig  # noqa: E402
from ggmoe.control.run_config import RunConfig
from ggmoe.inspect import inspect_model  # noqa: E402
from ggmoe.inspect.fingerprint import model_fingerprint  # noqa: E402
from ggmoe.trace import load_trace  # noqa: E402
from tools.gpu.faults import cause  # noqa: E402
from tools.gpu.trace_routing import ROUTING_NAME, TraceRouting, routing_name, split_tiled  # noqa: E402

if TYPE_CHECKING:
    from ggmoe.engine import Engine, EngineConfig
# the engine (llama.cpp) is imported where it runs: the pure parts here are unit-tested without it

CONFIGS = ("stock-vram", "stock-cpu", "n-cpu-moe", "lru", "async", "async-prefetch", "split", "split-async",
           "prefetch", "prefetch-eam", "prefetch-bg", "lru-auto", "prefetch-wait", "prefetch-mlp", "lru-host",
           "async-tinylfu", "async-fill", "async-fill-prefetch", "async-fill-tinylfu", "hybrid", "async-fill-host",
           "async-fill-auto", "hybrid-spin")
DEFAULT_CONFIGS = (*CONFIGS[:10], "prefetch-mlp", "async-tinylfu", "async-fill", "async-fill-prefetch",
                   "async-fill-tinylfu", "hybrid", "async-fill-host")
BASELINES = ("stock-vram", "stock-cpu", "n-cpu-moe")  # stock llama.cpp: no hook, measured under random only
PER_FRACTION = ("n-cpu-moe", "lru", "async", "async-prefetch", "split", "split-async", "prefetch", "prefetch-eam", "prefetch-bg",
                "lru-auto", "prefetch-wait", "prefetch-mlp", "lru-host", "async-tinylfu", "async-fill",
                "async-fill-prefetch", "async-fill-tinylfu", "hybrid", "async-fill-host", "async-fill-auto", "hybrid-spin")
GGMOE = ("lru", "async", "async-prefetch", "split", "split-async", "prefetch", "prefetch-eam", "prefetch-bg", "lru-auto",
         "prefetch-wait", "prefetch-mlp", "lru-host", "async-tinylfu", "async-fill", "async-fill-prefetch",
         "async-fill-tinylfu", "hybrid", "async-fill-host", "async-fill-auto", "hybrid-spin")
LRU_MISS = {"lru": "wait", "lru-auto": "auto", "lru-host": "cpu", "hybrid": "auto",
            "hybrid-spin": "auto"}  # the lru rows' --miss-policy
HYBRID = ("hybrid", "hybrid-spin")  # the sync decode with the CPU beside the link
# the host part's worker (CacheConfig.host_threads; None: the engine's default, the context's threads on a GPU): the
# lru-auto and lru-host rows keep the host part in the main graph after the device part (in turn), hybrid runs
# it beside the device part and splits a layer's misses between the link and the CPU
HOST_THREADS = {"lru-auto": 0, "lru-host": 0}


def _host_threads(config: str) -> int | None:
    """The row's worker threads (None: the engine's default); hybrid-spin leaves the main thread a core, so that the
    hand-off spins (``ggmoe.engine.host_part.host_spin_us``)."""
    if config == "hybrid-spin":
        return max(1, (os.cpu_count() or 2) - 1)
    return HOST_THREADS.get(config)
ASYNC_MISS = {"async-fill-host": "cpu", "async-fill-auto": "auto"}  # the async host part's rows (patch 0016)
SPLIT = ("split", "split-async")  # MoEpic's split: only below 100 % (with every expert cacheable it is moot)
WHOLE_LRU = ("lru", "async")  # whole-expert LRU, the split rows' reference at the same VRAM
TRACE_ONLY = ("prefetch-eam",)  # learns from the tiled trace's training prompts
PROMPT = "The expert cache keeps the experts a model uses most on the device"
GOAL_FRACTION = 0.5
SPLIT_GOAL_FRACTION = 0.25  # the split's goal: at 25 % of the experts' bytes the split beats whole-expert LRU
DEFAULT_SPLIT_THETA = 0.5
# Generations sample: greedy decoding of a random-weight model soon repeats tokens, and repeated tokens route
# to the same experts, which would flatter the cache under the model's own (random) router.
TEMP = 1.0


@dataclass(frozen=True)
class Cell:
    model: str
    routing: str  # "random" or ROUTING_NAME
    config: str
    fraction: float | None  # experts cacheable per layer (None: does not apply)
    slots: int | None  # cache slots per layer, or layers with experts on the GPU (n-cpu-moe)
    decode_tps: float  # tokens/s, median of the runs
    decode_tps_runs: tuple[float, ...]  # tokens/s per run
    prefill_tps: float  # tokens/s
    ttft_s: float  # s: the prefill and the first decoded token
    hit_rate: float | None  # of the cache, during the timed generations
    hook_us_p50: float | None  # µs per route callback (Python side; the device sync is in the decode time)
    host_computed: int | None  # experts computed on the CPU (host path) during the timed generations
    override_us: float | None = None  # µs per call of trace-replay routing's override (inside hook_us_p50)
    wall_s: float = 0.0  # s the cell took, loading included
    tpot_sim_ms: float | None = None  # the simulator's TPOT estimate for this cell (ms), None: not simulated
    error: str | None = None  # why the cell could not run (e.g. out of VRAM)
    decode_mode: str | None = None  # async or sync as the cell ran (None: stock)
    miss_policy: str | None = None  # the miss policy in effect as the cell ran (auto may have become wait)
    host_read_bytes_per_token: float | None = None  # bytes the GPU read from host memory per decoded token
    copied_bytes_per_token: float | None = None  # bytes the copy engine moved per decoded token
    bound_tpot_ms: float | None = None  # stock-vram TPOT + link bytes per token / measured bandwidth (--probe)
    theta: float | None = None  # split rows: the top share of each slot (n_top / n_ff); None: whole experts
    top_hit_rate: float | None = None  # split rows: accesses that found at least the top on the device
    cache_bytes: int | None = None  # VRAM of the cached experts over all MoE layers (slots, or n-cpu-moe's layers)
    teardown_error: str | None = None  # measured, then the cell's process died closing the engine (a bug to fix)
    cpu_experts_per_token: float | None = None  # experts the CPU computed per decoded token (None: none measured)
    # rows with a predictor: prefetches issued, used and late during the timed generations; and of the layers the
    # async decode's mailbox reader read with a target over the cell's life, those read after the target started
    prefetch_issued: int | None = None
    prefetch_used: int | None = None
    prefetch_late: int | None = None
    reader_behind: int | None = None
    reader_targeted: int | None = None

    @property
    def is_random(self) -> bool:
        return self.routing == "random"

    @property
    def key(self) -> tuple[str, str, float | None]:
        return ("random" if self.is_random else "trace", self.config, self.fraction)

    @property
    def tpot_ms(self) -> float | None:
        return 1e3 / self.decode_tps if self.decode_tps > 0 else None


def describe(facts) -> str:
    """One line: the model's shape."""
    types = ", ".join(f"{n} x{c}" for n, c in facts.ggml_types)
    return (f"{facts.name} ({facts.arch}): {facts.n_layer} layers, n_embd {facts.n_embd}, {facts.n_expert} experts "
            f"x {facts.n_ff_exp}, top-{facts.n_expert_used}, {facts.file_bytes / 2**30:.2f} GiB; tensors {types}")


TRACE_ROUTING = [ROUTING_NAME]  # what the trace given with --trace is (routing_name), set by main


def routing_label(routing: str) -> str:
    return TRACE_ROUTING[0] if routing == "trace" else "random"


def n_slots_for(fraction: float, n_expert: int, k: int) -> int:
    return max(k, min(n_expert, round(fraction * n_expert)))


def n_gpu_layers_for(n_slots: int, n_moe_layers: int, n_expert: int) -> int:
    """Whole layers' experts that fit the VRAM of ``n_slots`` slots in every layer (--n-cpu-moe)."""
    return round(n_moe_layers * n_slots / n_expert)


def _down_block(layer) -> tuple[int, int]:
    """(n_ff, weights per quant block of the down tensor) of a MoE layer: the split's granularity."""
    import gguf

    down = layer.tensor("ffn_down_exps.weight")
    return down.shape[0], gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[down.ggml_type]][0]


def split_theta(layer, want: float | Fraction | str) -> float | None:
    """The smallest top share θ >= ``want`` (and above 0) that ``layer``'s down tensor can represent (``n_top``
    a whole number of its quant blocks: ggmoe.cache.split), as a float that ``layer_split`` turns back into
    exactly that ``n_top``; None when only the whole expert is (θ would round up to 1)."""
    from ggmoe.cache.split import layer_split

    n_ff, blck = _down_block(layer)
    w = want if isinstance(want, Fraction) else Fraction(str(want))
    n_top = max(1, math.ceil(w * n_ff / blck)) * blck
    if n_top >= n_ff:
        return None
    theta = n_top / n_ff
    if int(theta * n_ff) // blck * blck != n_top:  # float rounding below the block boundary
        theta = (n_top + 0.5) / n_ff
    s = layer_split(layer, theta)
    assert s is not None and s.n_top == n_top, (want, n_top, s)
    return theta


def split_layers(facts, want: float | Fraction | str) -> dict:
    """{il: LayerSplit} of every MoE layer at the smallest representable θ >= ``want`` ({} when a layer has none:
    the model then runs no split rows)."""
    from ggmoe.cache.split import model_split

    thetas = {il: split_theta(facts.layer(il), want) for il in facts.moe_layers}
    if any(t is None for t in thetas.values()):
        return {}
    return model_split(facts, thetas)


def split_slots(n_slots: int, split: dict, bytes_per_expert: dict[int, int], n_expert: int) -> dict[int, int]:
    """Tops per layer that fit the VRAM of ``n_slots`` whole experts in that layer (at most n_expert)."""
    from ggmoe.cache.split import tops_in

    return tops_in(split, dict.fromkeys(split, n_slots), bytes_per_expert, n_expert)


def split_note(split: dict) -> str:
    """One line: the split's θ and bytes (from the first layer; the harness's models are uniform)."""
    s = next(iter(split.values()))
    return (f"MoEpic's split at θ {s.n_top}/{s.n_ff} = {s.n_top / s.n_ff:.3f} (the down tensor's quant blocks): "
            f"top {s.top_bytes / 1e6:.3g} MB in a slot, bottom {s.bottom_bytes / 1e6:.3g} MB read from pinned host "
            f"memory on a top-only hit, a miss reads the whole {s.expert_bytes / 1e6:.3g} MB; slots = the tops "
            "that fit the VRAM of the lru row's whole experts")


def plan_cells(routings: list[str], configs: list[str], fractions: list[float]) -> list[tuple[str, str, float | None]]:
    """(routing, config, fraction) in run order: per routing, the fixed baselines, then fraction by fraction."""
    out: list[tuple[str, str, float | None]] = []
    for routing in routings:
        for config in configs:
            if config in PER_FRACTION or (routing == "trace" and config in BASELINES):
                continue
            out.append((routing, config, None))
        for f in fractions:
            for config in configs:
                if config not in PER_FRACTION or (routing == "trace" and config in BASELINES) or \
                        (routing == "random" and config in TRACE_ONLY) or (config in SPLIT and f >= 1.0):
                    continue
                out.append((routing, config, f))
    return out


def engine_config(model: Path, config: str, fraction: float | None, facts, n_threads: int, n_ctx: int,
                  train: Path | None, split: dict | None = None) -> tuple[EngineConfig, int | None]:
    """The engine's configuration of a cell and its slots per layer (n-cpu-moe: layers with experts on the GPU);
    ``split`` ({il: LayerSplit}, split_layers) for the split rows."""
    from ggmoe.engine import EngineConfig

    base = {"model_path": model, "n_ctx": n_ctx, "n_threads": n_threads}
    if config == "stock-vram":
        return EngineConfig(**base, experts_on_host=False, gate_hook=False), None
    if config == "stock-cpu":
        return EngineConfig(**base, experts_on_host=True, gate_hook=False), None
    n_slots = n_slots_for(fraction, facts.n_expert, facts.n_expert_used)
    if config == "n-cpu-moe":
        n_gpu = n_gpu_layers_for(n_slots, len(facts.moe_layers), facts.n_expert)
        host = tuple(facts.moe_layers[n_gpu:])
        return EngineConfig(**base, experts_on_host=True, host_expert_layers=host, gate_hook=False), n_gpu
    if config in LRU_MISS:
        decode = DecodeConfig(mode="sync", miss_policy=LRU_MISS[config], host_threads=_host_threads(config))
        return EngineConfig(**base, run=RunConfig(CacheConfig(n_slots=n_slots, policy="lru"), decode)), n_slots
    if config in ("async", "async-tinylfu", "async-fill", "async-fill-tinylfu", *ASYNC_MISS):
        policy = "tinylfu" if config.endswith("tinylfu") else "lru"
        # async (no fills) keeps reading through the tables with every expert cached: beside async-fill, whose
        # warmed cache is read with stock's matmuls (identity, patch 0017), it measures what the tables cost
        decode = DecodeConfig(mode="async", fills=config.startswith("async-fill"),
                              miss_policy=ASYNC_MISS.get(config, "wait"), identity=config != "async")
        return EngineConfig(**base, run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy), decode)), n_slots
    if config in ("async-prefetch", "async-fill-prefetch"):
        pre = PrefetchConfig(predictor="reuse", stride=2)
        decode = DecodeConfig(mode="async", fills=config == "async-fill-prefetch")
        return EngineConfig(**base, run=RunConfig(CacheConfig(n_slots=n_slots, policy="lru"), decode,
                                                  prefetch=pre)), n_slots
    if config in SPLIT:
        if not split:
            raise SystemExit(f"error: {config} needs the model's split geometry (split_layers)")
        bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
        tops = split_slots(n_slots, split, bpe, facts.n_expert)
        mode = "async" if config == "split-async" else "sync"
        theta = {il: s.theta for il, s in split.items()}
        cache = CacheConfig(layer_slots=tops, policy="lru", layer_theta=theta)
        return EngineConfig(**base, run=RunConfig(cache, DecodeConfig(mode=mode))), tops[facts.moe_layers[0]]
    if config == "prefetch-mlp":
        pre = PrefetchConfig(predictor=str(random_mlp(model)), stride=2)
        return EngineConfig(**base, run=RunConfig(CacheConfig(n_slots=n_slots, policy="lru"),
                                                  decode=DecodeConfig(miss_policy="auto"),
                                                  prefetch=pre)), n_slots
    if config in ("prefetch", "prefetch-eam", "prefetch-bg", "prefetch-wait"):
        pre = {"prefetch": PrefetchConfig(predictor="reuse", stride=1),
               "prefetch-wait": PrefetchConfig(predictor="reuse", stride=1),
               "prefetch-bg": PrefetchConfig(predictor="reuse", stride=1, background=True),
               "prefetch-eam": PrefetchConfig(predictor="eam", stride=1, train=(str(train),))}[config]
        miss = "wait" if config == "prefetch-wait" else "auto"
        return EngineConfig(**base, run=RunConfig(CacheConfig(n_slots=n_slots, policy="lru"),
                                                  decode=DecodeConfig(miss_policy=miss),
                                                  prefetch=pre)), n_slots
    raise SystemExit(f"error: unknown config {config!r}; choose from {', '.join(CONFIGS)}")


_RANDOM_MLP: dict[Path, Path] = {}  # model -> its random-weight mlp file (written once per run)


def random_mlp(model: Path) -> Path:
    """A random-weight mlp predictor file for ``model`` (hidden 1024, stride 2): what the mlp costs."""
    from tools.fixtures.random_predictor import random_predictor_file

    if model not in _RANDOM_MLP:
        out = Path(tempfile.mkdtemp(prefix="ggmoe-mlp-")) / "random-mlp.npz"
        _RANDOM_MLP[model] = random_predictor_file(model, out, stride=2, hidden=1024)
    return _RANDOM_MLP[model]


@dataclass(frozen=True)
class Measured:
    prefill_tps: float  # tokens/s
    decode_tps: tuple[float, ...]  # tokens/s per run
    ttft_s: float  # s
    decode_stats: object | None  # ggmoe.cache.stats.LayerStats of the decode runs alone (None: no cache)
    decoded_tokens: int = 0  # tokens the generations decoded (the per-token figures divide by it)


def _delta(after, before):
    """LayerStats after - before (the decode runs' counts)."""
    from ggmoe.cache.stats import LayerStats

    return LayerStats(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(LayerStats)})


def measure(eng: Engine, vocab: int, prefill_tokens: int, decode_tokens: int, runs: int, seed: int) -> Measured:
    """Warm-up, then ``runs`` times a ``prefill_tokens`` prompt of random tokens and one token (TTFT; the
    medians), then ``runs`` generations of ``decode_tokens`` from PROMPT, sampled (TEMP, seeds seed,
    seed + 1, ...); cache counts are those of the generations alone. The warm-up includes one untimed
    prefill: the first micro-batch of a new size builds and allocates its graph (a single timed prefill
    carries that, and moves the prefill figures by up to 8 % between two runs of a cell)."""
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, vocab, size=prefill_tokens)]
    eng.generate(PROMPT, max_tokens=4)  # warm-up: graphs, first touch, the cache's first copies
    eng.reset()
    eng.decode(prompt)  # warm-up of the prefill's graph
    prefills, ttfts = [], []
    for _ in range(max(1, runs)):
        eng.reset()
        t0 = time.perf_counter()
        logits = eng.decode(prompt)
        t_prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        eng.decode([int(np.argmax(logits))])
        prefills.append(t_prefill)
        ttfts.append(t_prefill + (time.perf_counter() - t1))
    t_prefill, ttft = statistics.median(prefills), statistics.median(ttfts)
    eng.reset()
    before = eng.cache_stats.total() if eng.cache_stats is not None else None
    gens = [eng.generate(PROMPT, max_tokens=decode_tokens, temp=TEMP, seed=seed + i) for i in range(runs)]
    tps = tuple(g.timings.decode_tps for g in gens)
    decoded = sum(g.timings.decode_tokens + 1 for g in gens)  # decode steps and each generation's prefill token
    stats = _delta(eng.cache_stats.total(), before) if before is not None else None
    return Measured(prefill_tokens / t_prefill, tps, ttft, stats, decoded)


def _prefetch_figures(eng, s) -> dict:
    """A row with a predictor: its prefetches' outcomes (``s``: the timed generations' statistics) and how often the
    mailbox's reader was behind the device (none for the route op's predictor, which runs in step)."""
    pre = eng.report().get("prefetch")
    if not pre or s is None:
        return {}
    out = {"prefetch_issued": s.prefetch_issued, "prefetch_used": s.prefetch_hits, "prefetch_late": s.prefetch_late}
    if pre.get("runs_on") == "mailbox":
        out |= {"reader_behind": pre["layers_behind"], "reader_targeted": pre["layers_targeted"]}
    return out


def vram_bytes(cfg: EngineConfig, config: str, slots: int | None, facts, split: dict | None) -> int | None:
    """VRAM of the experts kept on the device over all MoE layers: every expert (stock-vram), none (stock-cpu),
    whole layers' (n-cpu-moe), or the cache's slots (a split row's hold tops)."""
    if config == "stock-vram":
        return facts.expert_bytes
    if config == "stock-cpu":
        return 0
    if config == "n-cpu-moe":
        return sum(facts.n_expert * facts.bytes_per_expert(il) for il in facts.moe_layers[:slots])
    c = cfg.run.cache
    per = c.layer_slots or dict.fromkeys(facts.moe_layers, c.n_slots)
    top = split if config in SPLIT and split else {}
    return sum(n * (top[il].top_bytes if il in top else facts.bytes_per_expert(il)) for il, n in per.items())


def run_cell(model: Path, facts, config: str, fraction: float | None, routing: str, held: Path | None,
             args, train: Path | None, split: dict | None = None, emit=None) -> Cell:
    """One cell measured in this process. ``emit``: called with the cell before the engine closes (a child
    writes it then, so a process that dies in teardown still hands over its figures)."""
    from ggmoe.engine import Engine

    t0 = time.monotonic()
    cfg, slots = engine_config(model, config, fraction, facts, args.threads, args.n_ctx, train, split)
    name = routing_label(routing)
    is_split = config in SPLIT
    theta = None
    if is_split:
        first = split[facts.moe_layers[0]]
        theta = first.n_top / first.n_ff
    vram = vram_bytes(cfg, config, slots, facts, split)
    try:
        with Engine(cfg) as eng:
            override = None
            if routing == "trace" and cfg.run is not None:
                override = TraceRouting(load_trace(held, hidden=False))
                eng.set_routing_override(override)
            if cfg.run is not None:
                eng.record_hook_times()
            m = measure(eng, eng.n_vocab, args.prefill_tokens, args.decode_tokens, args.runs, args.seed)
            hook = eng.hook_times if cfg.run is not None else np.zeros(0)
            mode = eng.decode_mode.get("decode_mode_in_effect")
            miss = eng.miss_policy[0] if eng.miss_policy is not None else None
            s = m.decode_stats
            per = max(m.decoded_tokens, 1)
            cell = Cell(str(model), name, config, fraction, slots, float(statistics.median(m.decode_tps)),
                        m.decode_tps, m.prefill_tps, m.ttft_s, s.hit_rate if s else None,
                        float(np.median(hook)) * 1e6 if hook.size else None, s.host_computed if s else None,
                        override_us=override.seconds / override.calls * 1e6 if override and override.calls else None,
                        wall_s=time.monotonic() - t0, decode_mode=mode, miss_policy=miss,
                        host_read_bytes_per_token=s.host_read_bytes / per if s else None,
                        copied_bytes_per_token=s.bytes_copied / per if s else None, theta=theta,
                        top_hit_rate=s.top_hit_rate if s and is_split else None, cache_bytes=vram,
                        cpu_experts_per_token=cpu_experts_per_token(
                            config, slots, len(facts.moe_layers), facts.n_expert_used,
                            s.host_computed if s else None, m.decoded_tokens),
                        **_prefetch_figures(eng, s))
            if emit is not None:
                emit(cell)
        return cell
    except Exception as e:  # noqa: BLE001 - a cell that cannot run (e.g. out of VRAM) is reported, not fatal
        return Cell(str(model), name, config, fraction, slots, 0.0, (), 0.0, 0.0, None, None, None,
                    wall_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}", theta=theta, cache_bytes=vram)


# --------------------------------------------------------------------------- the simulator beside it


def record_random_trace(model: Path, args, path: Path) -> Path:
    """The model's own routing on the cells' first generation (PROMPT, sampled, --decode-tokens): a trace."""
    from ggmoe.engine import Engine, EngineConfig
    from ggmoe.engine.record import RecordConfig, record_trace

    with Engine(EngineConfig(model_path=model, n_ctx=args.n_ctx, n_threads=args.threads)) as eng:
        return record_trace(eng, [PROMPT], RecordConfig(mode="sample", max_tokens=args.decode_tokens, temp=TEMP,
                                                        seed=args.seed, keep_hidden=False), path)


def sim_miss_policy(cell: Cell) -> str:
    """The miss policy to simulate ``cell`` with: the one in effect as it ran, where it was recorded (the
    engine's auto weighs its own measurements and may drop the host path where the profile's costs would
    keep it, and the two runs then differ by more than the simulator's error), else the configuration's."""
    if cell.miss_policy is not None:
        return cell.miss_policy
    if cell.config in LRU_MISS:
        return LRU_MISS[cell.config]
    if cell.config in ASYNC_MISS:
        return ASYNC_MISS[cell.config]
    return "wait" if cell.config in ("async", "async-tinylfu", "async-prefetch", "prefetch-wait", "async-fill",
                                     "async-fill-prefetch", "async-fill-tinylfu") else "auto"


def simulate_cell(cell: Cell, facts, trace, train, profile, split: dict | None = None) -> float | None:
    """The simulator's TPOT (ms) for ``cell`` on ``trace`` (the same routing) and ``profile``; ``split``
    ({il: LayerSplit}) for the split rows."""
    from ggmoe.simulate.des import SimConfig, baseline, simulate

    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    if cell.config in BASELINES:
        budget = None
        if cell.config == "n-cpu-moe":
            budget = sum(facts.n_expert * bpe[il] for il in facts.moe_layers[:cell.slots])
        return baseline(trace, cell.config, bpe, profile, budget).tpot_s * 1e3
    if cell.config == "prefetch-mlp":
        return None  # the simulator would need the random net's predictions: not modelled
    if cell.config in SPLIT:
        if not split:
            return None
        tops = split_slots(n_slots_for(cell.fraction, facts.n_expert, facts.n_expert_used), split, bpe,
                           facts.n_expert)
        sim = SimConfig(n_slots=tops, policy="lru", miss_policy="wait", split=split,
                        decode_mode="async" if cell.decode_mode == "async" else "sync")
        r = simulate(trace, sim, bpe, profile)
        return r.tpot_s * 1e3 if r.tpot_s is not None else None
    pred = {"lru": None, "async": None, "async-tinylfu": None, "lru-auto": None, "lru-host": None, "hybrid": None,
            "hybrid-spin": None,
            "prefetch": "reuse", "prefetch-bg": "reuse",
            "prefetch-wait": "reuse", "prefetch-eam": "eam", "async-prefetch": "reuse", "async-fill": None,
            "async-fill-prefetch": "reuse", "async-fill-tinylfu": None, "async-fill-host": None,
            "async-fill-auto": None}[cell.config]
    miss = sim_miss_policy(cell)
    sim = SimConfig(n_slots=dict.fromkeys(facts.moe_layers, cell.slots),
                    policy="tinylfu" if cell.config.endswith("tinylfu") else "lru", predictor=pred,
                    stride=2 if cell.config in ("async-prefetch", "async-fill-prefetch") else 1,
                    miss_policy=miss,
                    decode_mode="async" if cell.decode_mode == "async" else "sync",
                    fills=cell.decode_mode == "async" and cell.config.startswith("async-fill"),
                    hybrid=cell.config in HYBRID and miss == "auto")  # auto run as wait: the sync decode
    r = simulate(trace, sim, bpe, profile, train=train if pred == "eam" else None)
    return r.tpot_s * 1e3 if r.tpot_s is not None else None


# --------------------------------------------------------------------------- goals and tables


def goals(cells: list[Cell], sim_tolerance: float = 0.15) -> list[dict]:
    """The issue's goals, per routing: at 50 % cacheable, ggmoe's best decode >= 2x n-cpu-moe, >= 1.3x on-demand
    LRU and >= 0.9x all in VRAM; never below experts-on-CPU (decode and prefill, every size); simulator TPOT
    within 15 % of the measured. A goal whose cells are missing is not listed."""
    ok = [c for c in cells if c.error is None and c.decode_tps > 0]

    def one(routing: str | None, config: str, fraction: float | None) -> Cell | None:
        for c in ok:
            if c.config == config and c.fraction == fraction and (routing is None or c.key[0] == routing):
                return c
        return None

    out: list[dict] = []
    for routing in ("random", "trace"):
        ours = [c for c in ok if c.key[0] == routing and c.config in GGMOE]
        if not ours:
            continue
        at = [c for c in ours if c.fraction == GOAL_FRACTION]
        best = max(at, key=lambda c: c.decode_tps, default=None)
        refs = (("n-cpu-moe", GOAL_FRACTION, 3.0), ("lru", GOAL_FRACTION, 1.3), ("stock-vram", None, 0.85))
        for config, fraction, target in refs:
            ref = one(routing if config in GGMOE else None, config, fraction)
            if best is not None and ref is not None:
                ratio = best.decode_tps / ref.decode_tps
                out.append({"routing": routing, "goal": f"decode at 50 %: best ggmoe ({best.config}) / {config}",
                            "value": ratio, "target": f">= {target}", "met": ratio >= target})
        splits = [c for c in ours if c.config in SPLIT and c.fraction == SPLIT_GOAL_FRACTION]
        wholes = [c for c in ours if c.config in WHOLE_LRU and c.fraction == SPLIT_GOAL_FRACTION]
        if splits and wholes:
            bs, bw = max(splits, key=lambda c: c.decode_tps), max(wholes, key=lambda c: c.decode_tps)
            ratio = bs.decode_tps / bw.decode_tps
            out.append({"routing": routing, "goal": f"decode at 25 %, the same VRAM: best split ({bs.config}) / "
                        f"best whole-expert LRU ({bw.config})", "value": ratio, "target": "> 1.0",
                        "met": ratio > 1.0})
        out += _hybrid_goal(routing, one) + _cpu_beside_goal(routing, one) + _full_cache_goals(routing, one)
        out += _host_free_goals(routing, one)
        bounded = [c for c in ours if c.bound_tpot_ms and c.tpot_ms]
        if bounded:
            worst = max(bounded, key=lambda c: c.tpot_ms / c.bound_tpot_ms)
            ratio = worst.tpot_ms / worst.bound_tpot_ms
            out.append({"routing": routing, "goal": f"TPOT within 1.25x of its bound, worst ({worst.config} "
                        f"{worst.fraction:.0%})", "value": ratio, "target": "<= 1.25", "met": ratio <= 1.25})
        cpu = one(None, "stock-cpu", None)
        if cpu is not None:
            for what, attr in (("decode", "decode_tps"), ("prefill", "prefill_tps")):
                worst = min(ours, key=lambda c: getattr(c, attr))
                ratio = getattr(worst, attr) / getattr(cpu, attr)
                out.append({"routing": routing, "goal": f"{what}, every size: worst ggmoe ({worst.config} "
                            f"{worst.fraction:.0%}) / stock-cpu", "value": ratio, "target": ">= 1.0",
                            "met": ratio >= 1.0})
    return out + _sim_goal(ok, sim_tolerance)


def _hybrid_goal(routing: str, one) -> list[dict]:
    """The hybrid goal: at 50 %, hybrid (the CPU beside the link; the better of hybrid and hybrid-spin where both ran)
    >= 1.2x the better of sync LRU and the async decode
    (``one(routing, config, fraction)`` finds a cell)."""
    hybrid = _best(routing, one, HYBRID, GOAL_FRACTION)
    refs = [c for c in (one(routing, "lru", GOAL_FRACTION), one(routing, "async", GOAL_FRACTION)) if c is not None]
    if hybrid is None or not refs:
        return []
    ref = max(refs, key=lambda c: c.decode_tps)
    ratio = hybrid.decode_tps / ref.decode_tps
    return [{"routing": routing, "goal": f"decode at 50 %: {hybrid.config} / the better of lru and async ({ref.config})",
             "value": ratio, "target": ">= 1.2", "met": ratio >= 1.2}]


def _best(routing: str, one, configs: tuple[str, ...], fraction: float) -> Cell | None:
    """The fastest decode of ``configs`` at ``fraction`` (None: none of them ran)."""
    cells = [c for c in (one(routing, k, fraction) for k in configs) if c is not None]
    return max(cells, key=lambda c: c.decode_tps) if cells else None


def _cpu_beside_goal(routing: str, one) -> list[dict]:
    """The CPU beside the link at its best (hybrid, the async host part) against ggmoe at its best without the CPU
    (sync LRU, async with and without fills), at 50 %: the hybrid goal where in-graph fills are the default."""
    best = _best(routing, one, (*HYBRID, "async-fill-host", "async-fill-auto"), GOAL_FRACTION)
    ref = _best(routing, one, ("lru", "async", "async-fill"), GOAL_FRACTION)
    if best is None or ref is None:
        return []
    ratio = best.decode_tps / ref.decode_tps
    return [{"routing": routing, "goal": f"decode at 50 %: the CPU beside the link ({best.config}) / the best "
             f"without it ({ref.config})", "value": ratio, "target": ">= 1.2", "met": ratio >= 1.2}]


def _full_cache_goals(routing: str, one) -> list[dict]:
    """Every expert cached: the async decode as it runs by default (async-fill: identity, stock's matmuls on the
    slots) against stock-vram, and the same cache read through its tables (async) against identity."""
    fill, tables, vram = one(routing, "async-fill", 1.0), one(routing, "async", 1.0), one(None, "stock-vram", None)
    full = fill or tables
    out = []
    if full is not None and vram is not None:
        ratio = full.decode_tps / vram.decode_tps
        out.append({"routing": routing, "goal": f"decode, every expert cached: {full.config} / stock-vram",
                    "value": ratio, "target": ">= 0.97", "met": ratio >= 0.97})
    if fill is not None and tables is not None:
        ratio = fill.decode_tps / tables.decode_tps
        out.append({"routing": routing, "goal": "decode, every expert cached: identity (async-fill) / the tables "
                    "(async)", "value": ratio, "target": ">= 1.0", "met": ratio >= 1.0})
    return out


# every expert cached: each row with the host path asked for, and the same row without it
HOST_FREE_PAIRS = (("hybrid", "lru"), ("lru-auto", "lru"), ("lru-host", "lru"), ("async-fill-host", "async-fill"),
                   ("async-fill-auto", "async-fill"))


def _host_free_goals(routing: str, one) -> list[dict]:
    """Issue 42's "free when unused": with every expert cached, a row with the host path asked for (``auto`` or
    ``cpu``) decodes at >= 0.97x the same row without it (the cache is warmed, so no miss is left for the CPU
    and the host path stays off: no graph split)."""
    out = []
    for host, plain in HOST_FREE_PAIRS:
        a, b = one(routing, host, 1.0), one(routing, plain, 1.0)
        if a is not None and b is not None:
            ratio = a.decode_tps / b.decode_tps
            out.append({"routing": routing, "goal": f"decode, every expert cached: {host} / {plain} (the host "
                        "path unused)", "value": ratio, "target": ">= 0.97", "met": ratio >= 0.97})
    return out


def _sim_goal(ok: list[Cell], tolerance: float) -> list[dict]:
    """The simulator's worst relative TPOT error over the cells that have an estimate (none: no goal)."""
    sims = [c for c in ok if c.tpot_sim_ms is not None]
    if not sims:
        return []
    worst = max(abs(c.tpot_sim_ms - c.tpot_ms) / c.tpot_ms for c in sims)
    return [{"routing": "both", "goal": f"simulator TPOT vs measured, {len(sims)} cells: worst error",
             "value": worst, "target": f"<= {tolerance}", "met": worst <= tolerance}]


def bounds(cells: list[Cell], probe: dict | None) -> list[Cell]:
    """Every ggmoe cell's bound: stock-vram's TPOT plus the bytes that crossed the link per token over the
    probe's bandwidth (host reads at the zero-copy rate, copies at the copy engine's). Needs the probe and a
    stock-vram cell; otherwise the cells come back unchanged. A cell whose misses the CPU computed (the host
    path) has none: its time is the CPU's and the host path's graph splits, not the link's, and a link bound
    would make it the bound goal's "worst" row for the wrong reason."""
    from dataclasses import replace

    vram = next((c for c in cells if c.error is None and c.config == "stock-vram" and c.tpot_ms), None)
    if probe is None or vram is None:
        return cells
    zc, ce = probe["zero_copy_gb_s"] * 1e9, probe["copy_engine_gb_s"] * 1e9  # bytes/s
    out = []
    for c in cells:
        if (c.error is None and c.config in GGMOE and c.host_read_bytes_per_token is not None
                and c.miss_policy in (None, "wait")):
            link_s = c.host_read_bytes_per_token / zc + (c.copied_bytes_per_token or 0.0) / ce
            c = replace(c, bound_tpot_ms=vram.tpot_ms + link_s * 1e3)
        out.append(c)
    return out


def hook_overhead_us(cells: list[Cell], n_moe_layers: int) -> float | None:
    """µs per MoE layer that the route hook (callback and device sync) and the slot indirection cost:
    decode time of lru at 100 % (every expert resident after warm-up) less stock-vram's, per layer."""
    lru = [c for c in cells if c.error is None and c.is_random and c.config == "lru" and c.fraction == 1.0]
    vram = [c for c in cells if c.error is None and c.config == "stock-vram"]
    if not lru or not vram or not lru[0].tpot_ms or not vram[0].tpot_ms:
        return None
    return (lru[0].tpot_ms - vram[0].tpot_ms) * 1e3 / n_moe_layers


def cpu_experts_per_token(config: str, slots: int | None, n_moe_layers: int, n_expert_used: int,
                          host_computed: int | None, decoded_tokens: int) -> float | None:
    """Experts a cell's CPU computes per decoded token: every layer's (stock-cpu, the cpu-experts floor), the
    layers left on the CPU (n-cpu-moe: ``slots`` layers on the GPU), or the host path's count (ggmoe rows)."""
    if config == "stock-cpu":
        return float(n_moe_layers * n_expert_used)
    if config == "n-cpu-moe":
        return float((n_moe_layers - (slots or 0)) * n_expert_used)
    if host_computed and decoded_tokens > 0:
        return host_computed / decoded_tokens
    return None


def cpu_us_per_expert(cell: Cell, vram_tpot_ms: float | None) -> float | None:
    """µs a CPU expert costs a token, transfers and graph splits included: the cell's TPOT less stock-vram's,
    over the experts its CPU computed per token (the host path against llama.cpp's own CPU experts)."""
    if not vram_tpot_ms or not cell.tpot_ms or not cell.cpu_experts_per_token:
        return None
    return (cell.tpot_ms - vram_tpot_ms) * 1e3 / cell.cpu_experts_per_token


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(cells: list[Cell]) -> str:
    head = ("| routing | config | mode | cacheable | slots | expert VRAM GB | decode tok/s | TPOT ms | bound ms | "
            "sim TPOT ms | prefill tok/s | TTFT ms | hit rate | MB/token host reads + copies | hook µs (replay) | "
            "CPU experts | CPU µs/expert | prefetches used/issued (late); reader behind |")
    rows = [head, "|" + "---|" * 18]
    vram = next((c.tpot_ms for c in cells if c.error is None and c.config == "stock-vram" and c.tpot_ms), None)
    order = {c: i for i, c in enumerate(CONFIGS)}
    for c in sorted(cells, key=lambda c: (not c.is_random, c.fraction or 0.0, order[c.config])):
        routing = "random" if c.is_random else "trace"
        frac = "-" if c.fraction is None else f"{c.fraction:.0%}"
        slots = _f(c.slots, "d") + ("" if c.theta is None else f" tops (θ {c.theta:.2f})")
        gb = _f(None if c.cache_bytes is None else c.cache_bytes / 1e9, ".3g")
        if c.error:
            rows.append(f"| {routing} | {c.config} | - | {frac} | {slots} | {gb} | failed: "
                        f"{c.error[:160].replace('|', '/')} ||||||||||||")
            continue
        link = ("-" if c.host_read_bytes_per_token is None else
                f"{c.host_read_bytes_per_token / 1e6:.1f} + {(c.copied_bytes_per_token or 0) / 1e6:.1f}")
        hit = _f(c.hit_rate, ".1%") + ("" if c.top_hit_rate is None else f" (top {c.top_hit_rate:.1%})")
        mode = (c.decode_mode or "-") + (f", misses {c.miss_policy}" if c.miss_policy not in (None, "wait") else "")
        mark = " †" if c.teardown_error else ""
        rows.append(f"| {routing} | {c.config}{mark} | {mode} | {frac} | {slots} | {gb} | "
                    f"{c.decode_tps:.1f} | {_f(c.tpot_ms, '.2f')} | {_f(c.bound_tpot_ms, '.2f')} | "
                    f"{_f(c.tpot_sim_ms, '.2f')} | {c.prefill_tps:.1f} | "
                    f"{c.ttft_s * 1e3:.1f} | {hit} | {link} | {_f(c.hook_us_p50, '.1f')}"
                    f"{'' if c.override_us is None else f' ({c.override_us:.1f})'} | "
                    f"{_f(c.host_computed, 'd')} | {_f(cpu_us_per_expert(c, vram), '.0f')} | {_prefetch_cell(c)} |")
    died = [c for c in cells if c.teardown_error]
    if died:
        rows.append("\n† measured, then the cell's process failed closing the engine: "
                    + "; ".join(f"{c.config} {_f(c.fraction, '.0%')}: {c.teardown_error[:200]}" for c in died[:3]))
    return "\n".join(rows)


def _prefetch_cell(c: Cell) -> str:
    """The table's prefetch column: used/issued (late), and the mailbox reader's layers read too late."""
    if c.prefetch_issued is None:
        return "-"
    out = f"{c.prefetch_used}/{c.prefetch_issued} ({c.prefetch_late})"
    if c.reader_targeted:
        out += f"; {c.reader_behind}/{c.reader_targeted} behind"
    return out


def markdown(result: dict, cells: list[Cell]) -> str:
    m = result["machine"]
    lines = [f"# {Path(result['model']).name}: {result['facts']['what']}", "",
             f"machine: GPU {m['gpu'] or 'none (CPU-only build)'} (nvidia-smi: {m.get('nvidia_smi') or '-'}; "
             f"{m.get('nvcc') or 'no nvcc'}), {m['cpu']}, {m['cores']} cores, Python {m['python']}, {m['date']}; "
             f"runs: {result['args']}"]
    if result.get("routing_note"):
        lines.append(f"'trace' rows: {result['routing_note']}; stock rows route with the model's router "
                     "(routing does not change what they compute) and stand for both routings.")
    cal = result.get("calibration")
    if cal:
        cpu_us = cal["bytes_per_expert"] / cal["cpu_bytes_per_s"] * 1e6
        lines.append(f"calibration: copies {cal['copy_bytes_per_s'] / 1e9:.2f} GB/s + "
                     f"{cal['copy_latency_s'] * 1e6:.1f} µs each ({'pinned host to device' if cal['gpu'] else 'a host memcpy: no GPU'}); "
                     f"CPU time per expert {cpu_us:.0f} µs ({cal['bytes_per_expert'] / 2**20:.2f} MiB); "
                     f"route callback {cal['hook_s'] * 1e6:.1f} µs")
    if result.get("sim_note"):
        lines.append(f"sim TPOT: {result['sim_note']}")
    probe = result.get("probe")
    if probe:
        lines.append(f"zero-copy probe ({probe.get('gpu', '?')}, {probe.get('mib')} MiB): SMs reading pinned host "
                     f"memory {probe['zero_copy_gb_s']:.1f} GB/s, copy engine {probe['copy_engine_gb_s']:.1f} GB/s, "
                     f"device memory {probe.get('device_read_gb_s', float('nan')):.0f} GB/s; bound = stock-vram "
                     "TPOT + host reads / zero-copy + copies / copy engine, per token")
    if result.get("hook_overhead_us") is not None:
        lines.append(f"route hook with its device sync, per MoE layer (lru 100 % less stock-vram, per layer): "
                     f"{result['hook_overhead_us']:.1f} µs")
    if result.get("split_note"):
        lines.append(f"split rows: {result['split_note']}")
    lines += ["hit rate and CPU experts: the timed generations only (a split row's hit rate counts whole experts on "
              "the device; in brackets the accesses that found the top); hook µs: the route callback's median per "
              "MoE layer call, and in brackets what trace-replay routing's override took of it; expert VRAM: the "
              "experts kept on the device, all MoE layers", "", table(cells)]
    if result.get("goals"):
        lines += ["", "| routing | goal | value | target | met |", "|---|---|---|---|---|"]
        lines += [f"| {g['routing']} | {g['goal']} | {g['value']:.2f} | {g['target']} | {'yes' if g['met'] else 'no'} |"
                  for g in result["goals"]]
    if result.get("skipped"):
        lines += ["", f"not run (--budget-s): {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def _cmd(*cmd: str) -> str | None:
    """A tool's output, stripped, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def _cpu_name() -> str:
    from ggmoe.engine.calibrate import cpu_name

    return cpu_name()


def machine() -> dict:
    """The GPU (ggml's name; nvidia-smi's name, driver and memory), CUDA's compiler, the CPU, the engine."""
    import llama_cpp

    from ggmoe.engine.loader import gpu_device_name

    nvcc = _cmd("nvcc", "--version")
    return {"gpu": gpu_device_name(), "engine": llama_cpp.__file__,
            "nvidia_smi": _cmd("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
            "nvcc": next((x.strip() for x in nvcc.splitlines() if "release" in x), None) if nvcc else None, "cpu": _cpu_name(), "cores": os.cpu_count(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


def cell_from_dict(d: dict) -> Cell:
    names = {f.name for f in fields(Cell)}
    d = {k: v for k, v in d.items() if k in names}
    d["decode_tps_runs"] = tuple(d.get("decode_tps_runs") or ())
    return Cell(**d)


def write(out: Path, result: dict, cells: list[Cell]) -> None:
    result["cells"] = [asdict(c) for c in cells]
    (out / "matrix.json").write_text(json.dumps(result, indent=2))
    (out / "matrix.md").write_text(markdown(result, cells))


def cell_in_process(a, argv: list[str], routing: str, config: str, f: float | None, held: Path | None,
                    train: Path | None) -> Cell:
    """One cell in a fresh process with a time limit (--cell-timeout): a CUDA fault, an abort or a hang loses
    this cell only, reported with why."""
    fd, name = tempfile.mkstemp(prefix="ggmoe-cell-", suffix=".json")
    os.close(fd)
    out = Path(name)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--one-cell",
           f"{routing}:{config}:{'' if f is None else f}", "--cell-json", str(out),
           *(["--cell-held", str(held)] if held else []), *(["--cell-train", str(train)] if train else [])]
    t0 = time.monotonic()
    err = None
    try:
        r = subprocess.run(cmd, timeout=a.cell_timeout, capture_output=True, text=True)
        if r.returncode != 0 or not out.stat().st_size:
            why = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
            err = f"the cell's process failed ({why}): {cause(r.stderr, r.stdout)}"[:600]
    except subprocess.TimeoutExpired:
        err = f"the cell's process ran past --cell-timeout {a.cell_timeout:.0f} s and was killed"
    try:
        if out.stat().st_size:  # measured (written before teardown); a failure after that is kept beside it
            return replace(cell_from_dict(json.loads(out.read_text())), teardown_error=err)
    finally:
        out.unlink(missing_ok=True)
    return Cell(str(a.model), routing_label(routing), config, f, None, 0.0, (), 0.0, 0.0, None, None, None,
                wall_s=time.monotonic() - t0, error=err)


def one_cell(a, facts, split: dict) -> int:
    """--one-cell: run that cell here and write it to --cell-json (the parent's child process)."""
    routing, config, f = a.one_cell.split(":")
    measured: list[Cell] = []

    def save(cell: Cell) -> None:
        measured.append(cell)
        a.cell_json.write_text(json.dumps(asdict(cell)))

    cell = run_cell(a.model, facts, config, float(f) if f else None, routing, a.cell_held, a, a.cell_train,
                    split, emit=save)
    if measured and cell.error:  # measured, then closing the engine raised: the figures stand, the error beside
        cell = replace(measured[0], teardown_error=cell.error)
    save(cell)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--trace", type=Path, help="the routing replayed (trace routing): a trace of the embedded model "
                    "(tiled), or an imported real routing (ggmoe trace import; mapped to the model's shape)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--routing", default="random,trace", help="random, trace or both (comma list)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--fractions", default="0.5,0.25,1.0", help="run in this order (50 %% first: the goals)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-calibrate", action="store_true", help="skip calibration and the simulator's estimates")
    ap.add_argument("--append", action="store_true", help="add to OUT/matrix.json of an earlier run")
    ap.add_argument("--budget-s", type=float, default=None, help="start no cell after this many seconds")
    ap.add_argument("--split-theta", default=str(DEFAULT_SPLIT_THETA),
                    help="the split rows' top share: the smallest the model's down tensor can represent at or above "
                         "this (a number or a fraction such as 1/2; default %(default)s)")
    ap.add_argument("--probe", type=Path, default=None,
                    help="the zero-copy probe's JSON (tools/gpu/zero_copy_probe.cu): each cell's bound")
    ap.add_argument("--cell-timeout", type=float, default=300.0,
                    help="seconds one cell's process may run (each cell runs in its own process)")
    ap.add_argument("--in-process", action="store_true", help="run the cells in this process (tests)")
    ap.add_argument("--one-cell", help=argparse.SUPPRESS)  # ROUTING:CONFIG:FRACTION, in a child process
    ap.add_argument("--cell-json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cell-held", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cell-train", type=Path, help=argparse.SUPPRESS)
    return ap


def checked_lists(a) -> tuple[list[str], list[str], list[float]]:
    """--routing, --configs and --fractions as lists; SystemExit with one line when one is not valid."""
    routings = [r for r in a.routing.split(",") if r]
    configs = [c for c in a.configs.split(",") if c]
    try:
        fractions = [float(f) for f in a.fractions.split(",") if f]
    except ValueError:
        raise SystemExit(f"error: --fractions {a.fractions!r}: a comma list of numbers in (0, 1]") from None
    bad = set(configs) - set(CONFIGS) or set(routings) - {"random", "trace"}
    if bad or not all(0 < f <= 1 for f in fractions):
        raise SystemExit(f"error: unknown {sorted(bad) or a.fractions}; configs: {', '.join(CONFIGS)}; "
                         "routing: random, trace; fractions in (0, 1]")
    return routings, configs, fractions


def split_setup(a, facts, configs: list[str], result: dict) -> tuple[dict, list[str]]:
    """MoEpic's split layers at --split-theta ({} when no split row runs), and the configs left to run (the
    split rows dropped, with a note, where no top share fits the down tensor's blocks)."""
    if not any(c in SPLIT for c in configs):
        return {}, configs
    try:
        want = Fraction(a.split_theta)
    except (ValueError, ZeroDivisionError):
        raise SystemExit(f"error: --split-theta {a.split_theta!r}: a number or fraction in (0, 1)") from None
    if not 0 < want < 1:
        raise SystemExit(f"error: --split-theta {a.split_theta}: a top share in (0, 1)")
    split = split_layers(facts, want)
    if split:
        result["split_note"] = split_note(split)
    else:
        n_ff, blck = _down_block(facts.layer(facts.moe_layers[0]))
        result["split_note"] = (f"not run: no top share from {a.split_theta} to below 1 fits the down tensor's "
                                f"quant blocks ({n_ff} neurons in blocks of {blck})")
        configs = [c for c in configs if c not in SPLIT]
    print(f"split rows: {result['split_note']}", flush=True)
    return split, configs


def traces_for(a, facts, routings: list[str], work: Path) -> tuple[Path | None, Path | None]:
    """Trace routing's (training, held-out) traces mapped to the model, (None, None) without trace rows."""
    if "trace" not in routings:
        return None, None
    if a.trace is None or not a.trace.is_file():
        raise SystemExit("error: trace routing needs --trace (a trace of the embedded model: gpu-pack/trace.npz, "
                         "or an imported real routing: gpu-pack/real-routing.npz)")
    TRACE_ROUTING[0] = routing_name(load_trace(a.trace, hidden=False))
    return split_tiled(a.trace, tuple(facts.moe_layers), facts.n_expert, facts.n_expert_used,
                       model_fingerprint(a.model), work / "tiled")


def start_result(a, facts, routings: list[str]) -> tuple[dict, list[Cell]]:
    """The result to fill (an earlier one's with --append) and its cells."""
    cells: list[Cell] = []
    result: dict = {}
    if a.append and (a.out / "matrix.json").is_file():
        result = json.loads((a.out / "matrix.json").read_text())
        cells = [cell_from_dict(d) for d in result.get("cells", [])]
    result.update({"machine": machine(), "model": str(a.model), "facts": {
        "what": describe(facts), "n_expert": facts.n_expert, "n_expert_used": facts.n_expert_used,
        "moe_layers": len(facts.moe_layers), "bytes_per_expert": facts.bytes_per_expert(facts.moe_layers[0])},
        "args": f"{a.runs} x {a.decode_tokens} decoded tokens (median), {a.prefill_tokens}-token prefill, "
                f"{a.threads} threads"})
    if "trace" in routings or any(not c.is_random for c in cells):
        result["routing_note"] = TRACE_ROUTING[0]
    if a.probe is not None and a.probe.is_file():
        result["probe"] = json.loads(a.probe.read_text())
    return result, cells


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    t_start = time.monotonic()
    if not a.model.is_file():
        raise SystemExit(f"error: no model at {a.model}")
    facts = inspect_model(a.model)
    routings, configs, fractions = checked_lists(a)
    if a.one_cell:
        return one_cell(a, facts, split_layers(facts, Fraction(a.split_theta)) if any(
            c in SPLIT for c in configs) else {})
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ggmoe-matrix-"))  # tiled traces: not into OUT (files back are few)
    train, held = traces_for(a, facts, routings, work)
    result, cells = start_result(a, facts, routings)
    probe = result.get("probe") if a.probe is not None and a.probe.is_file() else None
    split, configs = split_setup(a, facts, configs, result)
    skipped = []
    for routing, config, f in plan_cells(routings, configs, fractions):
        if a.budget_s is not None and time.monotonic() - t_start > a.budget_s:
            skipped.append(f"{routing} {config} {'' if f is None else f'{f:.0%}'}".strip())
            continue
        cell = run_cell(a.model, facts, config, f, routing, held, a, train, split) if a.in_process else \
            cell_in_process(a, argv, routing, config, f, held, train)
        cells = bounds([c for c in cells if c.key != cell.key] + [cell], probe)
        print(f"{routing:6} {config:12} {'' if f is None else f'{f:.0%}':>5}  "
              f"{cell.error or f'{cell.decode_tps:.1f} tok/s decode, {cell.prefill_tps:.0f} tok/s prefill'}"
              f"  ({cell.wall_s:.0f} s)", flush=True)
        result["goals"] = goals(cells)
        write(a.out, result, cells)
    result["skipped"] = skipped
    result["hook_overhead_us"] = hook_overhead_us(cells, len(facts.moe_layers))
    if not a.no_calibrate and not skipped:
        cells = estimate(a, facts, cells, result, work, held, train, split)
    result["goals"] = goals(cells)
    write(a.out, result, cells)
    print(markdown(result, cells))
    print(f"matrix: {len(cells)} cells in {time.monotonic() - t_start:.0f} s -> {a.out / 'matrix.md'}")
    return 0


def estimate(a, facts, cells: list[Cell], result: dict, work: Path, held: Path | None,
             train: Path | None, split: dict | None = None) -> list[Cell]:
    """Calibrate on the model, make its hardware profile, and fill every cell's simulated TPOT."""
    from dataclasses import replace

    from ggmoe.cache.hardware import load_profile
    from ggmoe.engine.calibrate import Calibration, calibrate
    from ggmoe.simulate.calibration import profile_from, render

    t0 = time.monotonic()
    prev = result.get("calibration")
    if prev is not None and result.get("calibrated_model") == str(a.model):  # --append: measured already
        cal = Calibration(**{**prev, "copy_points": tuple(tuple(p) for p in prev["copy_points"]),
                             "notes": tuple(prev["notes"])})
    else:
        cal = calibrate(a.model, n_threads=a.threads, n_tokens=16, repeat=3)
    result["calibrated_model"] = str(a.model)
    base = load_profile("h100" if cal.gpu else "pcie4")
    probe = result.get("probe")  # the zero-copy probe's rate beats the base profile's quoted one
    zero_copy = ((probe["zero_copy_gb_s"] * 1e9, f"measured by tools/gpu/zero_copy_probe.cu on {probe.get('gpu')}")
                 if probe and cal.gpu else None)
    profile, _ = profile_from(cal, base, "matrix", zero_copy)
    result["calibration"] = cal.to_dict()
    result["profile_toml"] = render(cal, base, "matrix", zero_copy)
    result["sim_note"] = (f"the simulator on the calibrated profile (base {base.name}); random rows on a trace of "
                          f"the model's own routing of the generation, trace rows on {TRACE_ROUTING[0]}")
    if not cal.gpu:
        result["sim_note"] += ("; CPU-only machine: the profile models a GPU's link and the measured rows ran "
                               "on the CPU, so the two are not comparable here")
    traces = {}
    if any(c.is_random for c in cells):
        traces["random"] = load_trace(record_random_trace(a.model, a, work / "random.npz"), hidden=False)
    if held is not None:
        traces["trace"] = load_trace(held, hidden=False)
    train_trace = load_trace(train, hidden=False) if train is not None else None
    out = []
    for c in cells:
        trace = traces.get(c.key[0])
        if c.error is None and trace is not None:
            c = replace(c, tpot_sim_ms=simulate_cell(c, facts, trace, train_trace, profile, split))
        out.append(c)
    print(f"calibration and simulation: {time.monotonic() - t0:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
