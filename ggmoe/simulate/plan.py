"""``ggmoe plan``: the cache configuration for a VRAM budget on a machine, chosen by simulating candidates.

With traces, a coordinate search over the discrete-event simulator (``des.simulate``), the estimated TPOT
the objective:

1. slots per layer: the even split of the budget, and an uneven one: starting from top-k slots per layer,
   each further slot goes to the layer whose LRU hit rate gains most per byte (``hit_curves``: H_i(C) for
   every C, from one replay per slot count: the curves MoEpic's configurator starts from);
2. the eviction policy (lru, lfu, lcp, classlru, fmoe) on the better split;
3. prefetching: none, or the reuse predictor at stride 1 or 2 (predictors that need training data at run
   time are left to the user);
4. the miss policy: wait or auto (the host path).

With routing statistics only (``--stats``), the split follows the static policy's hit curves (the top-C
frequencies of each layer) and the TPOT is an analytic estimate: every token pays, per layer, the hook,
the layer, its experts on the GPU and its expected misses' copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.cache.config import slots_for_budget
from ggmoe.cache.hardware import HardwareProfile
from ggmoe.simulate.des import SimConfig, SimResult, simulate
from ggmoe.simulate.replay import replay
from ggmoe.trace.format import Trace

POLICY_CANDIDATES = ("lru", "lfu", "lcp", "classlru", "fmoe")
PREFETCH_CANDIDATES: tuple[tuple[str | None, int], ...] = ((None, 2), ("reuse", 1), ("reuse", 2))
MISS_CANDIDATES = ("wait", "auto")


@dataclass(frozen=True)
class Plan:
    config: SimConfig  # the choice
    tpot_s: float  # its estimated TPOT
    baseline_tpot_s: float  # even split, LRU, no prefetching, misses waited for (llama.cpp's design)
    allocation: str  # "even" or "uneven"
    hit_rate: float | None  # the choice's simulated hit rate (None: analytic)
    tried: tuple[tuple[str, float], ...]  # (label, estimated TPOT s) of every candidate simulated
    analytic: bool  # True: estimated from routing statistics, not simulated


def hit_curves(trace: Trace, n_slots_range: range) -> dict[int, dict[int, float]]:
    """il -> {slots: LRU hit rate of the layer}: H_i(C), from one replay per slot count."""
    out: dict[int, dict[int, float]] = {}
    for c in n_slots_range:
        for il, s in replay(trace, c, "lru").layers.items():
            out.setdefault(il, {})[c] = s.hit_rate
    return out


def static_curves(frequencies: np.ndarray, layers: tuple[int, ...], k: int) -> dict[int, dict[int, float]]:
    """il -> {slots: hit rate of pinning the C most frequent experts} from per-layer frequencies [L, E]."""
    out = {}
    for j, il in enumerate(layers):
        f = np.sort(frequencies[j])[::-1]
        cum = np.cumsum(f) / max(float(f.sum()), 1e-12)
        out[il] = {c: float(cum[c - 1]) for c in range(k, f.size + 1)}
    return out


def allocate(budget: int, bpe: Mapping[int, int], curves: Mapping[int, Mapping[int, float]], k: int,
             n_expert: int) -> dict[int, int]:
    """Greedy split of ``budget`` bytes: top-k slots per layer, then each slot to the best gain per byte."""
    slots = dict.fromkeys(bpe, k)
    left = budget - sum(k * b for b in bpe.values())
    if left < 0:
        raise UsageError(f"a budget of {budget} bytes is below top-k ({k}) slots in every layer "
                         f"({budget - left} bytes)")
    while True:
        best, gain = None, -1.0
        for il, b in bpe.items():
            c = slots[il]
            if c >= n_expert or b > left:
                continue
            g = (curves[il].get(c + 1, 1.0) - curves[il].get(c, 0.0)) / b
            if g > gain:
                best, gain = il, g
        if best is None:
            return slots
        slots[best] += 1
        left -= bpe[best]


def _search(run: Callable[[SimConfig], SimResult], even: dict[int, int], uneven: dict[int, int]
            ) -> tuple[SimConfig, SimResult, list[tuple[str, float]], str]:
    tried: list[tuple[str, float]] = []

    def best_of(configs: list[SimConfig]) -> tuple[SimConfig, SimResult]:
        scored = []
        for c in configs:
            r = run(c)
            tried.append((c.label, r.tpot_s))
            scored.append((r.tpot_s, c, r))
        t, c, r = min(scored, key=lambda x: x[0])
        return c, r

    base = SimConfig(n_slots=even, predictor_s=None)
    cfg, res = best_of([base, replace(base, n_slots=uneven)])
    allocation = "uneven" if cfg.n_slots == uneven and uneven != even else "even"
    cfg, res = best_of([replace(cfg, policy=p) for p in POLICY_CANDIDATES])
    # a stride reaches that many layers ahead: a model with fewer MoE layers (Llama 4's interleaving) skips it
    cfg, res = best_of([replace(cfg, predictor=p, stride=s) for p, s in PREFETCH_CANDIDATES
                        if p is None or s < len(even)])
    cfg, res = best_of([replace(cfg, miss_policy=m) for m in MISS_CANDIDATES])
    return cfg, res, tried, allocation


def plan_from_traces(trace: Trace, bpe: Mapping[int, int], budget: int, profile: HardwareProfile,
                     predictor_s: float | None = None, host_slots: int | None = None) -> Plan:
    """The search over candidates, each simulated on ``trace``; ``host_slots``: every candidate (the baseline
    too) over a host tier of that many slots per layer and the disk (``ggmoe.simulate.disk``)."""
    m = trace.meta
    even = slots_for_budget(budget, dict(bpe), m.n_expert, m.n_expert_used)
    curves = hit_curves(trace, range(m.n_expert_used, m.n_expert + 1))
    uneven = allocate(budget, bpe, curves, m.n_expert_used, m.n_expert)

    def run(c: SimConfig) -> SimResult:
        return simulate(trace, replace(c, predictor_s=predictor_s, host_slots=host_slots), bpe, profile)

    baseline = run(SimConfig(n_slots=even))
    cfg, res, tried, allocation = _search(run, even, uneven)
    return Plan(cfg, res.tpot_s, baseline.tpot_s, allocation, res.hit_rate, tuple(tried), analytic=False)


def analytic_tpot(slots: Mapping[int, int], curves: Mapping[int, Mapping[int, float]], bpe: Mapping[int, int],
                  k: int, profile: HardwareProfile) -> float:
    """s per token: per layer the hook, the layer, k experts on the GPU, and (1 - H) k misses copied."""
    t = 0.0
    for il, c in slots.items():
        miss = (1.0 - curves[il].get(c, 1.0)) * k
        t += profile.hook_s + profile.gpu_layer_s + k * profile.gpu_expert_s(bpe[il]) + miss * profile.copy_s(
            bpe[il], 3)
    return t


def plan_from_stats(frequencies: np.ndarray, layers: tuple[int, ...], n_expert: int, k: int,
                    bpe: Mapping[int, int], budget: int, profile: HardwareProfile) -> Plan:
    curves = static_curves(frequencies, layers, k)
    even = slots_for_budget(budget, dict(bpe), n_expert, k)
    uneven = allocate(budget, bpe, curves, k, n_expert)
    t_even, t_uneven = (analytic_tpot(s, curves, bpe, k, profile) for s in (even, uneven))
    slots, t, allocation = (uneven, t_uneven, "uneven") if t_uneven < t_even else (even, t_even, "even")
    cfg = SimConfig(n_slots=slots, policy="static")
    return Plan(cfg, t, t_even, allocation, None, (("static, even", t_even), ("static, uneven", t_uneven)),
                analytic=True)
