"""The expert cache's admissions: which misses served without a slot (read in place by the async decode, or
computed on the CPU) are copied in at low priority for later tokens, and which queued ones go stale.

``Admission`` is one of ``ExpertCache``'s parts (``ggmoe.cache.cache``): its methods use the cache's slot
tables, policy, copy backend and statistics, and its ``_load``, ``_release`` and ``_victims``.
"""

from __future__ import annotations

from itertools import compress

from ggmoe.cache.copy import Priority
from ggmoe.cache.slots import SlotTable


class Admission:
    """Admitting a layer call's misses after it ran, and dropping admissions an earlier token left queued."""

    def admit_after(self, il: int, table: SlotTable, need: list[int], missing: list[int], reserve: int = 0
                     ) -> None:
        """After a call that read its misses in place (async decode, split layers): admit them at low priority
        into free slots or victims, leaving ``reserve`` free slots (for the async decode's prefetches); with a
        policy that keeps nothing (on-demand), drop the landed experts instead."""
        slot_of, copy = table.slot_of_list, table.copy
        if self.policy_releases:
            if table.holds_any():
                self._release(il, table, [x for x in table.resident() if copy[slot_of[x]] is None])
            return
        if table.n_loading:
            self._drop_stale_admissions(il, table, set(missing))
        admit = [e for e in missing if slot_of[e] < 0]  # not resident, not already on its way
        planned = self.planned.get(il)
        if admit and planned:  # the next token's likeliest first, and none of the planned experts evicted
            rank = {e: i for i, e in enumerate(planned)}
            admit.sort(key=lambda e: rank.get(e, len(planned)))
            need = need + planned
        if admit and self._admits is not None:
            admit = self.admissible(il, table, need, admit, reserve)
        if admit:
            self.stats.layers[il].admission_copies += len(self._load(il, table, need, admit, Priority.ADMISSION,
                                                                     reserve))

    def admissible(self, il: int, table: SlotTable, need: list[int], admit: list[int], reserve: int = 0
                   ) -> list[int]:
        """What the policy admits of ``admit`` (misses this call served without a slot), given the layer's free
        slots less ``reserve`` and the experts that may be evicted (none that ``need`` uses)."""
        if self._admits is None or not admit:
            return admit
        n_free = table.expert_in_list.count(-1) - reserve
        return self._admits(il, admit, self._victims(table, set(need)), n_free)

    def _drop_stale_admissions(self, il: int, table: SlotTable, missed: set[int]) -> None:
        """Between tokens: admissions of an earlier token still queued (not started) are cancelled, their slots
        free again, except those of experts this token ``missed`` again, which keep their place in the queue.
        On a link slower than the misses come, a queue of old admissions would only grow, each landing too late
        to be used; the newest token's misses are the likeliest to come back."""
        token, submit_token, copy = self.token, self._submit_token, table.copy
        cancel, submitted, admission = self.copies.cancel, self._submitted, Priority.ADMISSION
        dropped = []  # _cancel_where's loop, its test inlined: a replay asks it of millions of copies
        for i in compress(range(len(copy)), copy):
            h = copy[i]
            if (h.priority is admission and h.expert not in missed and submit_token.get(h.id, token) < token
                    and cancel(h)):
                submitted.pop(h.id, None)
                submit_token.pop(h.id, None)
                dropped.append(i)
        if dropped:
            self.stats.layers[il].admissions_dropped += len(dropped)
            on_evict, expert_in = self._on_evict, table.expert_in_list
            for slot in dropped:
                if on_evict is not None:
                    on_evict(il, expert_in[slot])
                table.drop(slot)
