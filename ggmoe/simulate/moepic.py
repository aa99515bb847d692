"""MoEpic's expert split and its configurator, as an analytic model over curves measured from traces.

MoEpic (arXiv 2509.08342) splits every expert vertically: a top segment (a share θ of its neurons) that the
cache keeps for C experts, and a bottom segment fetched for the experts the predictor names (y of them per
layer, one layer ahead). Per layer i and token, with k experts selected:

- H_i(C): the share of selected experts whose top segment is cached (an LRU over tops of C experts: the
  layer's LRU hit curve, measured by replaying the traces);
- P_i(y): the share of selected experts among the predictor's top y (its recall, measured on the traces with
  the predictor the plan runs);
- PH_i(y, C): both at once; taken as H_i(C) * P_i(y) (independence: an approximation, stated as such).

With t, u and b the bytes of a top, a bottom and a whole expert (``ggmoe.cache.split.layer_split``: θ is one
the layer can represent, a multiple of the down tensor's quant block over n_ff), the bytes a layer waits for
per token are k [u (H - PH) + t (P - PH) + b (1 - H - P + PH)] (a cached top with an unpredicted bottom reads
the bottom; a predicted bottom without its top reads the top; neither reads all), at the zero-copy rate for
a split layer (the engine reads them in place) and the copy rate for a whole-expert layer. Prefetched bytes,
y u per token, overlap the previous layer's compute; what does not fit that window is exposed too. VRAM of a
split layer: C t + y u (a bottom buffer holds one packed bottom); of a whole-expert layer C b.

The engine gives every split layer the same number of bottom buffers (the prefetcher's n_prefetch), so the
configurator runs once per candidate y (0, k, 2k), every split layer with that y, and keeps the best. Each run
follows MoEpic's Algorithm 1 in spirit: a fixed point alternating (a) the best θ of every layer for its VRAM
and (b) a re-division of the VRAM between layers in steps of ζ bytes, moving a step from the layer that
loses least to the one that gains most, until neither changes. A candidate with y > 0 also pays the
predictor's time at every MoE layer (the prefetcher calls it on the decode path; not in MoEpic's model). The even split without splitting (θ = 1,
y = 0: a plain LRU cache) is reported beside it. ``moepic_plan`` turns the choice into what a plan file
holds (slots, θ, policy lcp, the prefetcher) and simulates it and the even LRU split with ``des.simulate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import gguf

from ggmoe.base.errors import UsageError
from ggmoe.cache.hardware import HardwareProfile
from ggmoe.cache.split import layer_split, model_split
from ggmoe.inspect.facts import ModelFacts, MoeLayer
from ggmoe.trace.format import Trace

MAX_SHARES = 6  # top shares θ < 1 tried per layer (evenly spread over those it can represent), besides θ = 1
POLICY = "lcp"  # MoEpic's eviction policy


@dataclass(frozen=True)
class Share:
    """One top share θ a layer can represent, with the real sizes of its segments."""

    theta: float  # share of an expert's n_ff neurons in the top segment; 1: whole experts
    top_bytes: int  # bytes of one expert's top segment: what a slot holds
    bottom_bytes: int  # bytes of its bottom segment: read over the link or prefetched (0 for θ = 1)
    expert_bytes: int  # bytes of a whole expert


@dataclass(frozen=True)
class LayerChoice:
    vram: int  # bytes the configurator gave the layer
    theta: float
    y: int  # bottom buffers: experts whose bottoms are prefetched per token (0 for θ = 1)
    c: int  # experts whose tops are cached (slots)
    exposed_s: float  # s per token this layer waits for copies (estimate)
    used_bytes: int  # bytes of VRAM the choice takes: c tops + y bottom buffers (packed bottoms)


@dataclass(frozen=True)
class SplitPlan:
    layers: dict[int, LayerChoice]
    y: int  # bottom buffers of every split layer (the prefetcher's n_prefetch); 0: no prefetching
    exposed_s: float  # s per token, all layers (estimate)
    even_exposed_s: float | None  # the even split of plain LRU slots (θ = 1, y = 0); None: below k per layer
    iterations: int
    tried: tuple[tuple[int, float], ...]  # (y, exposed s per token) of each candidate y that fits the budget


class Curves:
    """H_i(C) and P_i(y) of each layer, as measured, and the predictor's time per call."""

    def __init__(self, hit: Mapping[int, Mapping[int, float]], recall: Mapping[int, Mapping[int, float]],
                 n_expert: int, k: int, predictor_s: float = 0.0) -> None:
        self.hit, self.recall, self.n_expert, self.k = hit, recall, n_expert, k
        self.predictor_s = predictor_s  # s per MoE layer and token that prefetching spends in the predictor

    def h(self, il: int, c: int) -> float:
        if c <= 0:
            return 0.0
        c = min(c, self.n_expert)
        curve = self.hit[il]
        if c in curve:
            return curve[c]
        known = [x for x in curve if x <= c]
        return curve[max(known)] if known else c / self.n_expert * curve[min(curve)]

    def p(self, il: int, y: int) -> float:
        if y <= 0:
            return 0.0
        known = [x for x in self.recall[il] if x <= y]
        return self.recall[il][max(known)] if known else 0.0


def representable_thetas(layer: MoeLayer, max_shares: int = MAX_SHARES) -> tuple[float, ...]:
    """The top shares θ in (0, 1] the layer can represent: multiples of its down tensor's quant block over
    n_ff (at most ``max_shares`` of them below 1, evenly spread), then 1."""
    try:
        down = layer.tensor("ffn_down_exps.weight")
    except KeyError:
        return (1.0,)  # no down tensor: not splittable (layer_split refuses it)
    n_ff = down.shape[0]
    blck = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[down.ggml_type]][0]  # elements per quant block
    n_blocks = n_ff // blck  # blocks of one down row
    if n_blocks <= max_shares + 1:
        ms = list(range(1, n_blocks))
    else:
        ms = sorted({max(1, min(n_blocks - 1, round(j * n_blocks / (max_shares + 1))))
                     for j in range(1, max_shares + 1)})
    out = []
    for m in ms:
        theta = m * blck / n_ff
        while int(theta * n_ff) < m * blck:  # layer_split rounds θ n_ff down: never a block short
            theta = math.nextafter(theta, 2.0)
        out.append(theta)
    return (*out, 1.0)


def layer_shares(layer: MoeLayer, max_shares: int = MAX_SHARES) -> tuple[Share, ...]:
    """The layer's representable shares with their top, bottom and whole-expert bytes (``layer_split``)."""
    out = []
    for theta in representable_thetas(layer, max_shares):
        try:
            s = layer_split(layer, theta) if theta < 1 else None
        except UsageError:  # a layout layer_split cannot split (e.g. a fused gate_up of another width)
            continue
        if s is None:
            out.append(Share(1.0, layer.bytes_per_expert, 0, layer.bytes_per_expert))
        else:
            out.append(Share(theta, s.top_bytes, s.bottom_bytes, s.expert_bytes))
    return tuple(out)


def layer_cost(curves: Curves, il: int, share: Share, vram: int, y: int, profile: HardwareProfile,
               window_s: float) -> LayerChoice | None:
    """The choice (θ, y) for a layer with ``vram`` bytes, or None when it cannot hold its y bottom buffers and
    k tops (the engine needs at least n_expert_used slots)."""
    split = share.theta < 1
    y = y if split else 0
    buffers = y * share.bottom_bytes  # a bottom buffer holds one packed bottom
    c = min(curves.n_expert, (vram - buffers) // share.top_bytes) if vram >= buffers else -1
    if c < curves.k:
        return None
    h, p = curves.h(il, c), curves.p(il, y)
    ph = h * p
    demand = curves.k * (share.bottom_bytes * (h - ph) + share.top_bytes * (p - ph)
                         + share.expert_bytes * (1 - h - p + ph))  # bytes per token
    demand_s = profile.zero_copy_s(int(demand)) if split else demand / profile.copy_bytes_per_s
    prefetch_s = y * share.bottom_bytes / profile.copy_bytes_per_s
    exposed = demand_s + max(0.0, prefetch_s - window_s)
    return LayerChoice(int(vram), share.theta, y, int(c), exposed, int(c * share.top_bytes + buffers))


def best_choice(curves: Curves, il: int, shares: Sequence[Share], vram: int, y: int, profile: HardwareProfile,
                window_s: float) -> LayerChoice | None:
    options = [o for s in shares if (o := layer_cost(curves, il, s, vram, y, profile, window_s)) is not None]
    return min(options, key=lambda o: o.exposed_s) if options else None


def _min_vram(shares: Sequence[Share], k: int, y: int) -> int:
    """Bytes the cheapest feasible choice of a layer takes: k tops (and y bottom buffers when split)."""
    return min(k * s.top_bytes + (y * s.bottom_bytes if s.theta < 1 else 0) for s in shares)


def check_budget(shares: Mapping[int, Sequence[Share]], budget: int, k: int, y: int = 0) -> None:
    """UsageError unless ``budget`` bytes give every layer k tops of its smallest share (and y bottom buffers)."""
    need = sum(_min_vram(ss, k, y) for ss in shares.values())
    if budget < need:
        raise UsageError(f"a budget of {budget} bytes is below n_expert_used = {k} expert tops of the smallest "
                         f"share in every MoE layer: MoEpic needs at least {need} bytes for this model")


def _fixed_point(curves: Curves, shares: Mapping[int, Sequence[Share]], budget: int, profile: HardwareProfile,
                 zeta: int, y: int, window: float, max_iter: int) -> tuple[dict[int, LayerChoice], int] | None:
    layers = sorted(shares)
    need = {il: _min_vram(shares[il], curves.k, y) for il in layers}
    if sum(need.values()) > budget:
        return None
    even = budget // len(layers)
    if all(even >= n for n in need.values()):
        vram = dict.fromkeys(layers, even)
    else:  # uneven layers: each its minimum, then the rest evenly
        rest = (budget - sum(need.values())) // len(layers)
        vram = {il: need[il] + rest for il in layers}

    def best(il: int, v: int) -> LayerChoice | None:
        return best_choice(curves, il, shares[il], v, y, profile, window)

    choice = {il: best(il, vram[il]) for il in layers}
    steps = 0
    while steps < max_iter:
        # (b) move one step of zeta bytes from the cheapest donor to the best taker, if it pays
        loss = {}
        for il in layers:
            less = best(il, vram[il] - zeta) if vram[il] - zeta >= need[il] else None
            if less is not None:
                loss[il] = less.exposed_s - choice[il].exposed_s
        if not loss:
            break
        gain = {il: choice[il].exposed_s - best(il, vram[il] + zeta).exposed_s for il in layers}
        donor = min(loss, key=lambda il: loss[il])
        taker = max((il for il in layers if il != donor), key=lambda il: gain[il], default=None)
        if taker is None or gain[taker] - loss[donor] <= 1e-15:
            break
        vram[donor] -= zeta
        vram[taker] += zeta
        steps += 1
        # (a) every layer's best θ for its new VRAM
        choice = {il: best(il, vram[il]) for il in layers}
    return choice, steps


def layer_window_s(profile: HardwareProfile, bpe: Mapping[int, int], k: int) -> float:
    """Seconds of one MoE layer on the GPU (attention and k experts): how long a prefetch for the next layer
    has before it is waited for."""
    return profile.gpu_layer_s + k * max(profile.gpu_expert_s(b) for b in bpe.values())


def configure(curves: Curves, shares: Mapping[int, Sequence[Share]], budget: int, profile: HardwareProfile,
              zeta: int, ys: Sequence[int] | None = None, max_iter: int = 200) -> SplitPlan:
    """The best of the fixed points of per-layer θ and the VRAM division in steps of ``zeta`` bytes, one per
    candidate y (bottom buffers of every split layer; default 0, k and 2k). UsageError when no candidate
    gives every layer n_expert_used tops within ``budget`` bytes."""
    k = curves.k
    ys = tuple(ys) if ys is not None else tuple(sorted({0, min(k, curves.n_expert), min(2 * k, curves.n_expert)}))
    bpe = {il: max(s.expert_bytes for s in ss) for il, ss in shares.items()}
    window = layer_window_s(profile, bpe, k)
    even = budget // len(shares)
    whole = {il: next(s for s in ss if s.theta == 1.0) for il, ss in shares.items()}
    plain = [layer_cost(curves, il, whole[il], even, 0, profile, window) for il in shares]
    even_plain = None if any(c is None for c in plain) else sum(c.exposed_s for c in plain)
    runs = []
    for y in ys:
        got = _fixed_point(curves, shares, budget, profile, zeta, y, window, max_iter)
        if got is not None:
            choice, steps = got
            pred = curves.predictor_s * len(choice) if y else 0.0  # the prefetcher calls it at every layer
            runs.append((sum(c.exposed_s for c in choice.values()) + pred, y, choice, steps))
    if not runs:
        check_budget(shares, budget, k, min(ys))
    exposed, y, choice, steps = min(runs, key=lambda r: (r[0], r[1]))
    # y only counts when some layer is split (whole-expert layers have no bottom buffers)
    y_used = y if any(c.theta < 1 for c in choice.values()) else 0
    return SplitPlan(choice, y_used, exposed, even_plain, steps, tuple((r[1], r[0]) for r in runs))


def measure_curves(trace: Trace, predictor: str, stride: int, train: Trace | None = None,
                   model_path: str | None = None) -> Curves:
    """H_i(C) by LRU replay for every C, P_i(y) as the predictor's recall at y for y = k .. 3k (``model_path``:
    the GGUF, for skip-gate's routers)."""
    from ggmoe.predict.evaluate import evaluate
    from ggmoe.simulate.des import SimConfig, sim_predictor
    from ggmoe.simulate.plan import hit_curves

    m = trace.meta
    hit = hit_curves(trace, range(m.n_expert_used, m.n_expert + 1))
    recall: dict[int, dict[int, float]] = {int(il): {} for il in trace.layers}
    pred = sim_predictor(SimConfig(n_slots={}, predictor=predictor, stride=stride), trace,
                           train if train is not None else trace, model_path)
    lat_us = 0.0  # µs per call: observe + predict, median (evaluate's timing on this CPU)
    for y in range(m.n_expert_used, min(3 * m.n_expert_used, m.n_expert) + 1, m.n_expert_used):
        res = evaluate(pred, trace, prefetch=y)
        for s in res.layers:
            recall[s.il][y] = 0.0 if math.isnan(s.recall) else s.recall  # nan: a layer never predicted
        if not lat_us and math.isfinite(res.overall.latency_us_p50):
            lat_us = res.overall.latency_us_p50
    return Curves(hit, recall, m.n_expert, m.n_expert_used, lat_us * 1e-6)


@dataclass(frozen=True)
class MoepicPlan:
    """What ``ggmoe plan --moepic`` writes, with its estimates."""

    split: SplitPlan  # the configurator's choice and its analytic estimate
    slots: dict[int, int]  # tops cached per MoE layer, in [n_expert_used, n_expert]
    theta: dict[int, float]  # top share of each split layer (θ < 1); the others cache whole experts
    predictor: str | None  # the prefetcher's predictor (stride 1), None when no layer prefetches bottoms
    n_prefetch: int | None  # experts prefetched per layer = bottom buffers of each split layer
    vram_bytes: int  # bytes of VRAM the configuration takes: tops and bottom buffers
    tpot_s: float  # simulated TPOT of the configuration (estimate)
    hit_rate: float  # its simulated hit rate (whole experts found on the device)
    top_hit_rate: float  # its simulated share of uses that found at least the top segment
    baseline_tpot_s: float | None  # the even whole-expert LRU split, simulated; None: it does not fit
    baseline_slots: int | None  # slots per layer of that baseline


def moepic_plan(trace: Trace, facts: ModelFacts, budget: int, profile: HardwareProfile, model_path: str,
                predictor_s: float | None = None) -> MoepicPlan:
    """MoEpic's configuration for ``budget`` bytes, as the engine runs it: per-layer θ and tops from the
    configurator over curves measured with the predictor the plan prefetches with (skip-gate when the traces
    have hidden states, else reuse; stride 1), policy lcp; then simulated beside the even LRU split."""
    from ggmoe.cache.config import slots_for_budget
    from ggmoe.simulate.des import SimConfig, simulate

    k, n_expert = facts.n_expert_used, facts.n_expert
    shares = {il: layer_shares(facts.layer(il)) for il in facts.moe_layers}
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    check_budget(shares, budget, k)  # before measuring anything
    predictor = "skip-gate" if trace.hidden is not None else "reuse"
    curves = measure_curves(trace, predictor, 1, model_path=model_path)
    if predictor_s is not None:
        curves.predictor_s = predictor_s
    split = configure(curves, shares, budget, profile, max(1, sum(bpe.values()) // len(bpe) // 4))
    slots = {il: max(k, min(n_expert, c.c)) for il, c in split.layers.items()}
    theta = {il: c.theta for il, c in split.layers.items() if c.theta < 1}
    y = split.y
    sim = simulate(trace, SimConfig(n_slots=slots, policy=POLICY, split=model_split(facts, theta),
                                    predictor=predictor if y else None, stride=1, n_prefetch=y or None,
                                    predictor_s=predictor_s), bpe, profile, model_path=model_path)
    try:
        even = slots_for_budget(budget, bpe, n_expert, k)
    except UsageError:
        even = None  # whole experts do not fit k per layer: no baseline at this budget
    base = simulate(trace, SimConfig(n_slots=even, predictor_s=predictor_s), bpe, profile,
                    model_path=model_path) if even else None
    return MoepicPlan(split, slots, theta, predictor if y else None, y or None,
                      sum(c.used_bytes for c in split.layers.values()), sim.tpot_s, sim.hit_rate,
                      sim.stats["total"]["top_hit_rate"],
                      base.tpot_s if base else None, next(iter(even.values())) if even else None)
