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

from .errors import UsageError
from .policy import Policy


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
    """One layer's slots: expert -> slot and slot -> expert (-1 where empty)."""

    def __init__(self, n_expert: int, n_slots: int) -> None:
        self.slot_of = np.full(n_expert, -1, dtype=np.int32)  # [n_expert] slot or -1
        self.expert_in = np.full(n_slots, -1, dtype=np.int32)  # [n_slots] expert or -1

    @property
    def n_slots(self) -> int:
        return int(self.expert_in.shape[0])

    def place(self, expert: int, slot: int) -> None:
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot

    def clear(self) -> None:
        self.slot_of[:] = -1
        self.expert_in[:] = -1


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
        t0 = time.perf_counter()
        st = self.stats.layers[il]
        table = self.tables[il]
        self.clock += 1
        st.calls += 1
        if not self.policy.reuse:
            for e in table.expert_in[table.expert_in >= 0]:
                self.policy.on_evict(il, int(e))
            table.clear()
        need = np.unique(ids)  # distinct experts, ascending
        if need.size > table.n_slots:
            raise UsageError(f"layer {il}: {need.size} distinct experts do not fit {table.n_slots} slots "
                             "(the caller should have used the native path)")
        resident = table.slot_of[need] >= 0
        missing = need[~resident]
        st.hits += int(resident.sum())
        st.misses += int(missing.size)
        if missing.size:
            self._load(il, table, need, missing)
            tw = time.perf_counter()
            self.loader.wait(il)
            st.wait_s += time.perf_counter() - tw
        self.policy.on_access(il, need, self.clock)
        slots = table.slot_of[ids]
        st.hook_s += time.perf_counter() - t0
        return slots

    def observe(self, il: int, ids: np.ndarray) -> None:
        """A micro-batch that ran the native path: counted, nothing loaded or evicted."""
        st = self.stats.layers[il]
        st.calls += 1
        st.native_calls += 1

    def _load(self, il: int, table: SlotTable, need: np.ndarray, missing: np.ndarray) -> None:
        free = list(np.nonzero(table.expert_in < 0)[0])
        in_use = np.zeros(self.n_expert, dtype=bool)
        in_use[need] = True  # never evict what this call uses
        for e in missing:
            e = int(e)
            if free:
                slot = int(free.pop(0))
            else:
                cand = table.expert_in[(table.expert_in >= 0)]
                cand = np.sort(cand[~in_use[cand]])
                victim = self.policy.victim(il, cand, self.clock)
                slot = int(table.slot_of[victim])
                self.policy.on_evict(il, victim)
            table.place(e, slot)
            self.policy.on_insert(il, e, self.clock)
            self.loader.load(il, e, slot)
            self.stats.layers[il].bytes_copied += self.bytes_per_expert.get(il, 0)
