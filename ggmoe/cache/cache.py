"""The expert cache: per-layer slot tables, hit/miss decisions, copies, statistics.

One implementation, used by the live engine (through the route callback of the
patched llama.cpp) and by the simulator (replaying traces). What a copy costs
is not its business: it submits copies to a ``CopyBackend`` and waits for the
handles a layer needs before the layer may run; time comes from an injected
``Clock``. The engine's backend issues real copies on a wall clock; the
simulator's lands them on a virtual timeline.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ggmoe.cache.clock import Clock, MonotonicClock
from ggmoe.cache.copy import CopyBackend, CopyHandle, NullCopyBackend, Priority
from ggmoe.cache.policies.base import Policy
from ggmoe.cache.slots import SlotTable
from ggmoe.cache.stats import CacheStats, LayerStats
from ggmoe.errors import UsageError


class ExpertCache:
    """Slot tables for every MoE layer, driven by a policy; ``route`` maps ids to slots."""

    def __init__(self, n_expert: int, n_expert_used: int, n_slots: dict[int, int], policy: Policy,
                 copies: CopyBackend | None = None, bytes_per_expert: dict[int, int] | None = None,
                 clock: Clock | None = None) -> None:
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
        self.copies = copies or NullCopyBackend()
        self.time = clock or MonotonicClock()
        self.bytes_per_expert = bytes_per_expert or {}
        self.tables = {il: SlotTable(n_expert, n) for il, n in n_slots.items()}
        self.stats = CacheStats({il: LayerStats() for il in n_slots})
        self.clock = 0  # access counter: one per routed layer call
        # whether the policy drops experts after a call (on-demand); checked once, not per call
        self._releases = type(policy).release is not Policy.release

    def fits(self, il: int, n_tokens: int) -> bool:
        """Whether a micro-batch of ``n_tokens`` runs on the cache (else the native path)."""
        return min(n_tokens * self.n_expert_used, self.n_expert) <= self.n_slots[il]

    def route(self, il: int, ids: np.ndarray) -> np.ndarray:
        """ids [n_tokens, n_expert_used] -> slots [n_tokens, n_expert_used] int32, experts resident."""
        slots = self.route_flat(il, ids.ravel().tolist())
        return np.asarray(slots, dtype=np.int32).reshape(ids.shape)

    def route_flat(self, il: int, flat: list[int], next_use: Mapping[int, float] | None = None) -> list[int]:
        """``route`` on a flat list of ids (the engine's hot path: no numpy per call).

        ``next_use`` (expert -> access number of its next use) reaches the policy when the caller knows it.
        """
        t0 = self.time.now()
        st = self.stats.layers[il]
        table = self.tables[il]
        self.clock += 1
        st.calls += 1
        need = sorted(set(flat))  # distinct experts, ascending
        if len(need) > table.n_slots:
            raise UsageError(f"layer {il}: {len(need)} distinct experts do not fit {table.n_slots} slots "
                             "(the caller should have used the native path)")
        if next_use is not None:
            self.policy.set_future(il, next_use)
        slot_of = table.slot_of_list
        missing = [e for e in need if slot_of[e] < 0]
        st.hits += len(need) - len(missing)
        st.misses += len(missing)
        pending = self._in_flight(table, need) if table.n_loading else []
        if missing:
            pending += self._load(il, table, need, missing)
        if pending:
            tw = self.time.now()
            self.copies.wait(pending)
            st.wait_s += self.time.now() - tw
            for h in pending:
                table.landed(h.slot)
        self.policy.on_access(il, need, self.clock)
        slots = [slot_of[e] for e in flat]
        if self._releases:
            for e in self.policy.release(il, table.resident()):
                self.policy.on_evict(il, e)
                table.drop(slot_of[e])
        st.hook_s += self.time.now() - t0
        return slots

    @staticmethod
    def _in_flight(table: SlotTable, need: list[int]) -> list[CopyHandle]:
        """Copies still landing into slots this call reads (a slot is read only after its copy landed)."""
        out = []
        for e in need:
            s = table.slot_of_list[e]
            if s >= 0 and table.copy[s] is not None:
                out.append(table.copy[s])
        return out

    def observe(self, il: int, ids: np.ndarray | list[int]) -> None:
        """A micro-batch that ran the native path: counted, nothing loaded or evicted."""
        st = self.stats.layers[il]
        st.calls += 1
        st.native_calls += 1

    def _load(self, il: int, table: SlotTable, need: list[int], missing: list[int]) -> list[CopyHandle]:
        """Demand copies of ``missing`` into free slots or the policy's victims; their handles."""
        in_use = set(need)  # never evict what this call uses
        bpe = self.bytes_per_expert.get(il, 0)
        handles = []
        for e in missing:
            if table.free:
                slot = table.free.pop(0)
            else:
                cand = sorted(x for x in table.expert_in_list if x >= 0 and x not in in_use)
                victim = self.policy.victim(il, cand, self.clock)
                slot = table.slot_of_list[victim]
                self.policy.on_evict(il, victim)
            h = self.copies.submit(il, e, slot, Priority.DEMAND)
            table.place(e, slot, h)
            handles.append(h)
            self.policy.on_insert(il, e, self.clock)
            self.stats.layers[il].bytes_copied += bpe
        return handles
