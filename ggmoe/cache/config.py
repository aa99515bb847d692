"""How big the expert cache is: slots per layer, or a VRAM budget spread evenly."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ggmoe.base.errors import UsageError

if TYPE_CHECKING:
    from ggmoe.inspect.facts import ModelFacts


@dataclass(frozen=True)
class CacheConfig:
    """How big the expert cache is and how it evicts: slots per layer, or a VRAM budget."""

    n_slots: int | None = None  # slots per MoE layer
    layer_slots: Mapping[int, int] | None = None  # slots of each MoE layer (a plan's uneven split)
    vram_bytes: int | None = None  # budget in bytes for all layers' slots (spread evenly)
    policy: str = "lru"
    # the policy's keyword arguments (e.g. static's per-layer counts from saved routing statistics)
    policy_options: Mapping[str, Any] | None = None
    # MoEpic's split: the share θ of each named MoE layer's neurons whose top segment a slot holds (the rest is
    # read from host memory or prefetched); layers not named, and θ = 1, cache whole experts (ggmoe.cache.split)
    layer_theta: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        """The policy's options checked against what it declares (ggmoe.base.params), and every top share θ a
        number from 0 to 1 of a layer >= 0, before anything is built."""
        for il, t in (self.layer_theta or {}).items():
            if isinstance(il, bool) or not isinstance(il, int) or il < 0:
                raise UsageError(f"top share θ for layer {il!r}: layers are numbers >= 0")
            if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 <= t <= 1:
                raise UsageError(f"layer {il}: top share θ = {t!r}; it must be a number from 0 to 1")
        if self.policy_options:
            from ggmoe.base.params import check_params
            from ggmoe.cache.policies import POLICIES

            check_params(f"policy {self.policy!r}", POLICIES.get(self.policy).PARAMS, self.policy_options)

    def check_model(self, facts: ModelFacts) -> None:
        """This configuration against a model's facts, before the model loads: per-layer slots and top shares
        name its MoE layers, every split is possible, a budget gives enough slots (UsageError otherwise)."""
        from ggmoe.cache.split import model_split

        split = model_split(facts, self.layer_theta)
        self.slots({il: split[il].top_bytes if il in split else facts.bytes_per_expert(il) for il in facts.moe_layers},
                   facts.n_expert, facts.n_expert_used)

    def slots(self, bytes_per_expert: dict[int, int], n_expert: int, n_expert_used: int) -> dict[int, int]:
        """Slots of each MoE layer, each in [n_expert_used, n_expert]: checked before any slot is allocated."""
        given = [x is not None for x in (self.n_slots, self.vram_bytes, self.layer_slots)]
        if sum(given) != 1:
            raise UsageError("give the cache size as slots per layer, per-layer slots or a VRAM budget: one of them")
        if self.layer_slots is not None:
            missing = sorted(set(bytes_per_expert) - set(self.layer_slots))
            extra = sorted(set(self.layer_slots) - set(bytes_per_expert))
            if missing or extra:
                raise UsageError(f"the per-layer slots name MoE layers {sorted(self.layer_slots)}; the model's are "
                                 f"{sorted(bytes_per_expert)}")
            out = {il: self.layer_slots[il] for il in bytes_per_expert}
        elif self.n_slots is not None:
            out = dict.fromkeys(bytes_per_expert, self.n_slots)
        else:
            return slots_for_budget(self.vram_bytes, bytes_per_expert, n_expert, n_expert_used)
        for il, n in out.items():
            if isinstance(n, bool) or not isinstance(n, int) or not n_expert_used <= n <= n_expert:
                raise UsageError(f"layer {il}: {n!r} cache slots; the model needs an integer from n_expert_used = "
                                 f"{n_expert_used} to n_expert = {n_expert}")
        return out


def slots_for_budget(budget: int, bytes_per_expert: dict[int, int], n_expert: int,
                     n_expert_used: int) -> dict[int, int]:
    """Spread a VRAM budget (bytes) for cached experts evenly over the MoE layers: slots per layer."""
    per_slot = sum(bytes_per_expert.values())  # bytes of one slot in every layer
    n = min(budget // per_slot, n_expert) if per_slot else n_expert
    if n < n_expert_used:
        raise UsageError(f"a budget of {budget} bytes gives {n} slots per layer; at least n_expert_used = "
                         f"{n_expert_used} are needed ({n_expert_used * per_slot} bytes)")
    return {il: int(n) for il in bytes_per_expert}
