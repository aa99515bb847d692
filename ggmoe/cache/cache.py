"""The expert cache: per-layer slot tables, hit/miss decisions, loads, statistics.

One implementation, used by the live engine (through the route callback of the
patched llama.cpp) and by the simulator (replaying traces). What a load costs
is not its business: it asks a ``Loader`` to copy an expert into a slot and,
before the layer may run, to wait for that layer's copies. The engine's loader
issues real copies; the simulator's charges a cost model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ggmoe.cache.policies.base import Policy
from ggmoe.errors import UsageError


class Loader(Protocol):
    def load(self, il: int, expert: int, slot: int) -> None:
        """Start copying ``expert`` of layer ``il`` into ``slot`` (may return before it lands)."""

    def wait(self, il: int) -> None:
        """Block until every copy started for layer ``il`` has landed."""


class NullLoader:
    """Copies nothing (pure bookkeeping: tests, the simulator without a cost model)."""

    def load(self, il: int, expert: int, slot: int) -> None:
        pass

    def wait(self, il: int) -> None:
        pass


@dataclass
class LayerStats:
    calls: int = 0  # routed layer calls (micro-batches)
    native_calls: int = 0  # calls that ran the native path (more distinct experts than slots)
    hits: int = 0  # distinct experts per call found resident
    misses: int = 0  # distinct experts per call loaded
    bytes_copied: int = 0  # bytes
    wait_s: float = 0.0  # seconds spent waiting for this layer's copies
    hook_s: float = 0.0  # seconds inside route() for this layer

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


@dataclass
class CacheStats:
    layers: dict[int, LayerStats] = field(default_factory=dict)

    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers.values():
            for k in ("calls", "native_calls", "hits", "misses", "bytes_copied", "wait_s", "hook_s"):
                setattr(t, k, getattr(t, k) + getattr(s, k))
        return t

    def to_dict(self) -> dict:
        def one(s: LayerStats) -> dict:
            return {"calls": s.calls, "native_calls": s.native_calls, "hits": s.hits, "misses": s.misses,
                    "hit_rate": s.hit_rate, "bytes_copied": s.bytes_copied, "wait_s": s.wait_s,
                    "hook_s": s.hook_s}

        return {"total": one(self.total()), "layers": {str(il): one(s) for il, s in sorted(self.layers.items())}}


class SlotTable:
    """One layer's slots: expert -> slot and slot -> expert (-1 where empty).

    Plain lists, not numpy: the route callback touches a handful of entries per
    call, where Python indexing costs far less than numpy's per-call overhead.
    """

    def __init__(self, n_expert: int, n_slots: int) -> None:
        self.slot_of_list = [-1] * n_expert  # [n_expert] slot or -1
        self.expert_in_list = [-1] * n_slots  # [n_slots] expert or -1
        self.free = list(range(n_slots))  # empty slots, lowest first

    @property
    def n_slots(self) -> int:
        return len(self.expert_in_list)

    @property
    def slot_of(self) -> np.ndarray:
        return np.asarray(self.slot_of_list, dtype=np.int32)

    @property
    def expert_in(self) -> np.ndarray:
        return np.asarray(self.expert_in_list, dtype=np.int32)

    def place(self, expert: int, slot: int) -> None:
        old = self.expert_in_list[slot]
        if old >= 0:
            self.slot_of_list[old] = -1
        self.expert_in_list[slot] = expert
        self.slot_of_list[expert] = slot

    def resident(self) -> list[int]:
        return [e for e in self.expert_in_list if e >= 0]

    def clear(self) -> None:
        self.slot_of_list = [-1] * len(self.slot_of_list)
        self.expert_in_list = [-1] * len(self.expert_in_list)
        self.free = list(range(len(self.expert_in_list)))


@dataclass(frozen=True)
class CacheConfig:
    """How big the expert cache is and how it evicts: slots per layer, or a VRAM budget."""

    n_slots: int | None = None  # slots per MoE layer
    vram_bytes: int | None = None  # budget in bytes for all layers' slots (spread evenly)
    policy: str = "lru"

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


class ExpertCache:
    """Slot tables for every MoE layer, driven by a policy; ``route`` maps ids to slots."""

    def __init__(self, n_expert: int, n_expert_used: int, n_slots: dict[int, int], policy: Policy,
                 loader: Loader | None = None, bytes_per_expert: dict[int, int] | None = None) -> None:
        for il, n in n_slots.items():
            if n < n_expert_used:
                raise UsageError(f"layer {il}: {n} cache slots < n_expert_used {n_expert_used}: "
                                 "a token could not have all its experts resident")
            if n > n_expert:
                raise UsageError(f"layer {il}: {n} cache slots > n_expert {n_expert}")
        self.n_expert = n_expert
        self.n_expert_used = n_expert_used
        self.n_slots = dict(n_slots)
        self.policy = policy
        self.loader = loader or NullLoader()
        self.bytes_per_expert = bytes_per_expert or {}
        self.tables = {il: SlotTable(n_expert, n) for il, n in n_slots.items()}
        self.stats = CacheStats({il: LayerStats() for il in n_slots})
        self.clock = 0  # access counter: one per routed layer call

    def fits(self, il: int, n_tokens: int) -> bool:
        """Whether a micro-batch of ``n_tokens`` runs on the cache (else the native path)."""
        return min(n_tokens * self.n_expert_used, self.n_expert) <= self.n_slots[il]

    def route(self, il: int, ids: np.ndarray) -> np.ndarray:
        """ids [n_tokens, n_expert_used] -> slots [n_tokens, n_expert_used] int32, experts resident."""
        slots = self.route_flat(il, ids.ravel().tolist())
        return np.asarray(slots, dtype=np.int32).reshape(ids.shape)

    def route_flat(self, il: int, flat: list[int]) -> list[int]:
        """``route`` on a flat list of ids (the engine's hot path: no numpy per call)."""
        t0 = time.perf_counter()
        st = self.stats.layers[il]
        table = self.tables[il]
        self.clock += 1
        st.calls += 1
        if not self.policy.reuse:
            for e in table.resident():
                self.policy.on_evict(il, e)
            table.clear()
        need = sorted(set(flat))  # distinct experts, ascending
        if len(need) > table.n_slots:
            raise UsageError(f"layer {il}: {len(need)} distinct experts do not fit {table.n_slots} slots "
                             "(the caller should have used the native path)")
        slot_of = table.slot_of_list
        missing = [e for e in need if slot_of[e] < 0]
        st.hits += len(need) - len(missing)
        st.misses += len(missing)
        if missing:
            self._load(il, table, need, missing)
            tw = time.perf_counter()
            self.loader.wait(il)
            st.wait_s += time.perf_counter() - tw
        self.policy.on_access(il, need, self.clock)
        slots = [slot_of[e] for e in flat]
        st.hook_s += time.perf_counter() - t0
        return slots

    def observe(self, il: int, ids: np.ndarray | list[int]) -> None:
        """A micro-batch that ran the native path: counted, nothing loaded or evicted."""
        st = self.stats.layers[il]
        st.calls += 1
        st.native_calls += 1

    def _load(self, il: int, table: SlotTable, need: list[int], missing: list[int]) -> None:
        in_use = set(need)  # never evict what this call uses
        bpe = self.bytes_per_expert.get(il, 0)
        for e in missing:
            if table.free:
                slot = table.free.pop(0)
            else:
                cand = sorted(x for x in table.expert_in_list if x >= 0 and x not in in_use)
                victim = self.policy.victim(il, cand, self.clock)
                slot = table.slot_of_list[victim]
                self.policy.on_evict(il, victim)
            table.place(e, slot)
            self.policy.on_insert(il, e, self.clock)
            self.loader.load(il, e, slot)
            self.stats.layers[il].bytes_copied += bpe
