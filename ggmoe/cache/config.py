"""How big the expert cache is: slots per layer, or a VRAM budget spread evenly."""

from __future__ import annotations

from dataclasses import dataclass

from ggmoe.errors import UsageError


@dataclass(frozen=True)
class CacheConfig:
    """How big the expert cache is and how it evicts: slots per layer, or a VRAM budget."""

    n_slots: int | None = None  # slots per MoE layer
    vram_bytes: int | None = None  # budget in bytes for all layers' slots (spread evenly)
    policy: str = "lru"
    # Tests and benchmarks only: copies run on a worker thread after this many seconds each (a slow link
    # simulated on a CPU-only machine, so readiness and priorities meet real concurrency). None: direct.
    copy_delay_s: float | None = None
    # what to do with an expert that is not on the device: wait for its copy, compute it on the CPU, or
    # whichever the measured cost model says is sooner (ggmoe.cache.miss)
    miss_policy: str = "wait"
    # the auto miss policy's cost model: a hardware profile name or TOML file; None: measured at startup
    hw_profile: str | None = None
    # stride prefetching from a predictor (ggmoe.cache.prefetch.PrefetchConfig), or None
    prefetch: object | None = None

    def slots(self, bytes_per_expert: dict[int, int], n_expert: int, n_expert_used: int) -> dict[int, int]:
        if (self.n_slots is None) == (self.vram_bytes is None):
            raise UsageError("give the cache size as slots per layer or as a VRAM budget, not both or neither")
        if self.n_slots is not None:
            return {il: self.n_slots for il in bytes_per_expert}
        return slots_for_budget(self.vram_bytes, bytes_per_expert, n_expert, n_expert_used)


def slots_for_budget(budget: int, bytes_per_expert: dict[int, int], n_expert: int,
                     n_expert_used: int) -> dict[int, int]:
    """Spread a VRAM budget (bytes) for cached experts evenly over the MoE layers: slots per layer."""
    per_slot = sum(bytes_per_expert.values())  # bytes of one slot in every layer
    n = min(budget // per_slot, n_expert) if per_slot else n_expert
    if n < n_expert_used:
        raise UsageError(f"a budget of {budget} bytes gives {n} slots per layer; at least n_expert_used = "
                         f"{n_expert_used} are needed ({n_expert_used * per_slot} bytes)")
    return {il: int(n) for il in bytes_per_expert}
