"""MoEpic's expert split and its configurator, as an analytic model over curves measured from traces.

MoEpic (arXiv 2509.08342) splits every expert vertically: a top segment (a share θ of its bytes) that the
cache keeps for C experts, and a bottom segment fetched for the experts the predictor names (y of them per
layer, one layer ahead). Per layer i and token, with b the bytes of an expert and k experts selected:

- H_i(C): the share of selected experts whose top segment is cached (an LRU over tops of C experts: the
  layer's LRU hit curve, measured by replaying the traces);
- P_i(y): the share of selected experts among the predictor's top y (its recall, measured on the traces);
- PH_i(y, C): both at once; taken as H_i(C) * P_i(y) (independence: an approximation, stated as such).

Bytes a layer waits for per token: k b [(1-θ)(H - PH) + θ(P - PH) + (1 - H - P + PH)] (a cached top with an
unpredicted bottom loads the bottom; a predicted bottom without its top loads the top; neither loads all).
Prefetched bytes, y (1-θ) b per token, overlap the previous layer's compute; what does not fit that window is
exposed too. VRAM of the layer: C θ b + y (1-θ) b.

The configurator follows MoEpic's Algorithm 1 in spirit: a fixed point alternating (a) the best (θ_i, y_i)
of every layer for its VRAM and (b) a re-division of the VRAM between layers in steps of ζ bytes, moving a
step from the layer that loses least to the one that gains most, until neither changes. The even split
without splitting (θ = 1, y = 0: a plain LRU cache) is reported beside it. The engine does not run split
experts: this is the simulator's estimate of what the split would buy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ggmoe.cache.hardware import HardwareProfile

THETAS = (0.25, 0.5, 0.75, 1.0)  # shares of an expert's bytes in its top segment


@dataclass(frozen=True)
class LayerChoice:
    vram: int  # bytes
    theta: float
    y: int  # experts whose bottoms are prefetched per token
    c: int  # experts whose tops are cached
    exposed_s: float  # s per token this layer waits for copies (estimate)


@dataclass(frozen=True)
class SplitPlan:
    layers: dict[int, LayerChoice]
    exposed_s: float  # s per token, all layers (estimate)
    even_exposed_s: float  # the even split of plain LRU slots (θ = 1, y = 0)
    iterations: int


class Curves:
    """H_i(C) and P_i(y) of each layer, as measured."""

    def __init__(self, hit: Mapping[int, Mapping[int, float]], recall: Mapping[int, Mapping[int, float]],
                 n_expert: int, k: int) -> None:
        self.hit, self.recall, self.n_expert, self.k = hit, recall, n_expert, k

    def h(self, il: int, c: int) -> float:
        if c <= 0:
            return 0.0
        c = min(c, self.n_expert)
        known = [x for x in self.hit[il] if x <= c]
        return self.hit[il][max(known)] if known else c / self.n_expert * self.hit[il][min(self.hit[il])]

    def p(self, il: int, y: int) -> float:
        if y <= 0:
            return 0.0
        known = [x for x in self.recall[il] if x <= y]
        return self.recall[il][max(known)] if known else 0.0


def layer_cost(curves: Curves, il: int, b: int, vram: int, theta: float, y: int, profile: HardwareProfile,
               window_s: float) -> LayerChoice | None:
    """The choice (θ, y) for a layer with ``vram`` bytes, or None when it cannot hold the bottoms."""
    bottoms = y * (1 - theta) * b
    if bottoms > vram:
        return None
    c = min(curves.n_expert, int((vram - bottoms) // (theta * b)))
    h, p = curves.h(il, c), curves.p(il, y)
    ph = h * p
    k = curves.k
    demand = k * b * ((1 - theta) * (h - ph) + theta * (p - ph) + (1 - h - p + ph))
    prefetch_s = bottoms / profile.copy_bytes_per_s
    exposed = demand / profile.copy_bytes_per_s + max(0.0, prefetch_s - window_s)
    return LayerChoice(int(vram), theta, y, c, exposed)


def best_choice(curves: Curves, il: int, b: int, vram: int, profile: HardwareProfile, window_s: float,
                ys: Sequence[int]) -> LayerChoice:
    options = [layer_cost(curves, il, b, vram, t, y if t < 1 else 0, profile, window_s) for t in THETAS for y in ys]
    return min((o for o in options if o is not None), key=lambda o: o.exposed_s)


def configure(curves: Curves, bpe: Mapping[int, int], budget: int, profile: HardwareProfile, zeta: int,
              ys: Sequence[int] | None = None, max_iter: int = 200) -> SplitPlan:
    """The fixed point of per-layer (θ, y) and the VRAM division in steps of ``zeta`` bytes."""
    k = curves.k
    ys = tuple(ys or (k, 2 * k))
    window = profile.gpu_layer_s + k * max(profile.gpu_expert_s(b) for b in bpe.values())  # s: one layer
    layers = sorted(bpe)
    even = budget // len(layers)
    vram = dict.fromkeys(layers, even)
    even_plain = sum(layer_cost(curves, il, bpe[il], even, 1.0, 0, profile, window).exposed_s for il in layers)
    choice = {il: best_choice(curves, il, bpe[il], vram[il], profile, window, ys) for il in layers}
    steps = 0
    while steps < max_iter:
        # (b) move one step of zeta bytes from the cheapest donor to the best taker, if it pays
        loss = {il: best_choice(curves, il, bpe[il], vram[il] - zeta, profile, window, ys).exposed_s
                - choice[il].exposed_s for il in layers if vram[il] - zeta >= 0}
        gain = {il: choice[il].exposed_s
                - best_choice(curves, il, bpe[il], vram[il] + zeta, profile, window, ys).exposed_s for il in layers}
        if not loss:
            break
        donor = min(loss, key=lambda il: loss[il])
        taker = max((il for il in layers if il != donor), key=lambda il: gain[il], default=None)
        if taker is None or gain[taker] - loss[donor] <= 1e-15:
            break
        vram[donor] -= zeta
        vram[taker] += zeta
        steps += 1
        # (a) every layer's best (θ, y) for its new VRAM
        choice = {il: best_choice(curves, il, bpe[il], vram[il], profile, window, ys) for il in layers}
    return SplitPlan(choice, sum(c.exposed_s for c in choice.values()), even_plain, steps)


def measure_curves(trace, predictor: str, stride: int, train=None) -> Curves:
    """H_i(C) by LRU replay for every C, P_i(y) as the predictor's recall at y for y = k .. 3k."""
    from ggmoe.predict import ModelShape, make_predictor
    from ggmoe.predict.evaluate import evaluate
    from ggmoe.simulate.plan import hit_curves

    m = trace.meta
    hit = hit_curves(trace, range(m.n_expert_used, m.n_expert + 1))
    recall: dict[int, dict[int, float]] = {int(il): {} for il in trace.layers}
    for y in range(m.n_expert_used, min(3 * m.n_expert_used, m.n_expert) + 1, m.n_expert_used):
        pred = make_predictor(predictor, ModelShape.from_trace(m, trace.layers), stride)
        if pred.needs_fit:
            pred.fit(train if train is not None else trace)
        res = evaluate(pred, trace, prefetch=y)
        for s in res.layers:
            recall[s.il][y] = s.recall
    return Curves(hit, recall, m.n_expert, m.n_expert_used)
