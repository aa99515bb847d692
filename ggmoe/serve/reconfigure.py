"""MoEpic's reconfiguration between requests: the recent routing through its configurator, every τ tokens.

MoEpic re-runs its configurator every τ tokens while the device is idle. Here a
``Reconfigurer`` observes the routing (a route observer: once per token in the
async decode, per layer call in the sync one) and keeps the last ``window``
tokens of each MoE layer. When ``due`` (τ tokens since the last look) and the
server is idle (between requests, no one waiting), ``propose`` measures each
layer's LRU hit curve H_i(C) on that window (one pass of stack distances, every C
at once), runs the configurator (``ggmoe.simulate.moepic.configure``: per-layer
slots and top share θ for the same VRAM bytes), and estimates the current
configuration on the same curves. A proposal that waits at least ``min_gain``
less per token (an estimate, from the hardware profile) replaces the cache
(``GgmoeLlama.reconfigure``). Prefetching stays as configured: the live
routing gives no predictor recall, so the configurator keeps no bottom buffers
(y = 0) of its own.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import HookRequest, RouteEvent
from ggmoe.cache.hardware import HardwareProfile
from ggmoe.cache.split import layer_split
from ggmoe.control.run_config import RunConfig
from ggmoe.inspect.facts import ModelFacts
from ggmoe.simulate.moepic import Curves, Share, configure, layer_cost, layer_shares, layer_window_s


def lru_hit_curve(calls: Sequence[Sequence[int]], n_expert: int) -> dict[int, float]:
    """{C: hit rate} of an LRU over C experts for every C in [1, n_expert], from one pass of stack distances:
    each call's distinct experts are looked up (a hit at C when fewer than C other experts were used since
    its last use), then become the most recent. Equal to ``ExpertCache`` with the lru policy (C >= the
    experts of any call): after a call it holds the C most recent experts."""
    hits = np.zeros(n_expert + 1, dtype=np.int64)  # hits[d]: accesses at stack depth d (0: most recent)
    n = 0
    stack: list[int] = []  # most recent first
    for call in calls:
        need = sorted(set(call))
        for e in need:
            n += 1
            if e in stack:
                hits[stack.index(e)] += 1
        for e in need:
            if e in stack:
                stack.remove(e)
        stack[:0] = need[::-1]  # ties within a call as ggmoe's LRU breaks them: the lowest id is the oldest
    cum = np.cumsum(hits)  # cum[d]: hits at depth <= d, i.e. with C = d + 1 slots
    return {c: float(cum[c - 1]) / n if n else 0.0 for c in range(1, n_expert + 1)}


@dataclass(frozen=True)
class Proposal:
    """A configuration for the same VRAM bytes and its estimate against the current one's (same curves)."""

    config: RunConfig
    exposed_s: float  # estimate: s per token the proposal waits for the link
    current_s: float  # estimate: s per token the current configuration waits
    tokens: int  # tokens of routing the curves came from (the window)

    @property
    def gain(self) -> float:
        """Share of the current wait the proposal saves (estimate)."""
        return 1.0 - self.exposed_s / self.current_s if self.current_s > 0 else 0.0


class Reconfigurer:
    """Collects each MoE layer's routing (a route observer) and proposes MoEpic's configuration every τ tokens."""

    request = HookRequest(probs=False, hidden=False)

    def __init__(self, facts: ModelFacts, profile: HardwareProfile, every_tokens: int, window_tokens: int = 512,
                 min_gain: float = 0.05) -> None:
        if every_tokens < 1 or window_tokens < 1:
            raise UsageError("reconfiguration needs every_tokens >= 1 and window_tokens >= 1")
        if not 0.0 <= min_gain < 1.0:
            raise UsageError(f"min_gain {min_gain!r} must be in [0, 1)")
        self.facts = facts
        self.profile = profile
        self.every = every_tokens  # τ: tokens between looks
        self.min_gain = min_gain
        self.history = {il: deque(maxlen=window_tokens) for il in facts.moe_layers}  # per token: its experts
        self.first = facts.moe_layers[0]  # the layer that counts tokens
        self.since = 0  # tokens since the last look
        self.applied = 0  # reconfigurations made (the caller counts them here)
        self.shares = {il: layer_shares(facts.layer(il)) for il in facts.moe_layers}

    def on_route(self, event: RouteEvent) -> None:
        rows = self.history.get(event.il)
        if rows is None:
            return
        rows.extend(tuple(r) for r in event.ids.tolist())
        if event.il == self.first:
            self.since += int(event.ids.shape[0])

    def due(self) -> bool:
        return self.since >= self.every

    def _current(self, il: int, config: RunConfig, n_slots: int) -> tuple[Share, int]:
        """The layer's share and VRAM bytes as configured now."""
        layer = self.facts.layer(il)
        theta = (config.cache.layer_theta or {}).get(il, 1.0)
        s = layer_split(layer, theta)
        b = layer.bytes_per_expert
        share = Share(1.0, b, 0, b) if s is None else Share(theta, s.top_bytes, s.bottom_bytes, s.expert_bytes)
        return share, n_slots * share.top_bytes

    def propose(self, config: RunConfig, n_slots: dict[int, int]) -> Proposal | None:
        """The configurator's choice for the VRAM the current ``config`` (``n_slots`` per layer) takes, when it
        beats the current one by ``min_gain`` on the recent routing; None otherwise. Resets the token count."""
        self.since = 0
        k, n_expert = self.facts.n_expert_used, self.facts.n_expert
        if any(len(rows) == 0 for rows in self.history.values()):
            return None
        hit = {il: lru_hit_curve(rows, n_expert) for il, rows in self.history.items()}
        curves = Curves(hit, {il: {} for il in hit}, n_expert, k)
        current = {il: self._current(il, config, n) for il, n in n_slots.items()}
        budget = sum(v for _, v in current.values())
        bpe = {il: self.facts.bytes_per_expert(il) for il in hit}
        window = layer_window_s(self.profile, bpe, k)
        costs = [layer_cost(curves, il, share, vram, 0, self.profile, window) for il, (share, vram) in current.items()]
        if any(c is None for c in costs):
            return None
        current_s = sum(c.exposed_s for c in costs)
        zeta = max(1, sum(bpe.values()) // len(bpe) // 4)
        try:
            plan = configure(curves, self.shares, budget, self.profile, zeta, ys=(0,))
        except UsageError:
            return None
        if plan.exposed_s > current_s * (1.0 - self.min_gain):
            return None
        slots = {il: max(k, min(n_expert, c.c)) for il, c in plan.layers.items()}
        theta = {il: c.theta for il, c in plan.layers.items() if c.theta < 1.0}
        cache = dataclasses.replace(config.cache, n_slots=None, vram_bytes=None, layer_slots=slots,
                                    layer_theta=theta or None)
        new = dataclasses.replace(config, cache=cache)
        return Proposal(new, plan.exposed_s, current_s, len(self.history[self.first]))
