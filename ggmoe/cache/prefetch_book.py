"""The expert cache's prefetch bookkeeping: prefetch copies into free slots or victims, and what each one came
to (used by its layer, evicted unused, cancelled at the gate as stale, or late).

``PrefetchBook`` is one of ``ExpertCache``'s parts (``ggmoe.cache.cache``): its methods use the cache's slot
tables, policy, copy backend, lock and statistics, and its ``_victims``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress

from ggmoe.cache.copy import CopyHandle, Priority
from ggmoe.cache.slots import SlotTable


class PrefetchBook:
    """Prefetch copies and their outcomes, counted per layer in the cache's statistics."""

    def prefetch(self, il: int, experts: list[int], keep: set[int] | None = None,
                 ranks: list[float] | None = None, if_calls: int | None = None, free_only: bool = False) -> int:
        """``_prefetch`` under the cache's lock; with ``if_calls``, only if layer ``il`` has not been called
        since (a prediction computed late, on a worker, must not touch a layer that already runs). With
        ``free_only`` (the async decode's stride prefetch, while a graph runs) only into free slots: no entry
        points at them, so no kernel can be reading them; nothing is evicted."""
        with self.lock:
            if if_calls is not None and self.stats.layers[il].calls != if_calls:
                self.stats.layers[il].prefetch_late += 1
                self.prefetch_events += 1
                return 0
            layer = self.layers[il]
            if free_only:
                return layer.prefetch_free(experts, keep, ranks)
            return layer.prefetch(experts, keep, ranks)

    def prefetch_whole(self, il: int, experts: list[int], keep: set[int] | None = None,
                        ranks: list[float] | None = None, free_only: bool = False) -> int:
        """Queue prefetch copies of the ``experts`` of layer ``il`` that are not resident; returns how many.

        Victims are resident experts not in ``keep``, not still loading, and not themselves unused prefetches.
        Called between layer calls (never for the layer that runs now), so no slot being read is overwritten.
        ``ranks`` (one per expert, lower first) order the prefetches within their priority.
        """
        table = self.tables[il]
        slot_of = table.slot_of_list
        want = [e for e in experts if slot_of[e] < 0]
        if not want:
            return 0
        st = self.stats.layers[il]
        rank_of = dict(zip(experts, ranks, strict=True)) if ranks is not None else {}
        protect = set(experts) | (keep or set())
        n = 0
        cand: list[int] | None = None  # victims, computed once: each pick only removes itself from them
        for e in want:
            if table.free:
                slot = table.free.pop(0)
            elif free_only:
                break
            else:
                if cand is None:
                    cand = [x for x in self._victims(table, protect) if not table.prefetched[table.slot_of_list[x]]]
                    targets = self.fill_targets.get(il)
                    if targets is not None:  # a running graph may be filling these slots
                        cand = [x for x in cand if x not in targets.held]
                if not cand:
                    break
                victim = self.policy.victim(il, cand, self.clock)
                cand.remove(victim)
                slot = table.slot_of_list[victim]
                self.policy.on_evict(il, victim)
                st.evictions += 1
            self._note_eviction(il, table, slot)
            # a prefetch into a running graph (the async decode's stride prefetch) goes as a demand: its layer
            # runs within milliseconds, before admissions meant for later tokens. A victim's flip to host memory
            # is written by place and applied with the step before any graph reads the table
            h = self.copies.submit(il, e, slot, Priority.DEMAND if free_only else Priority.PREFETCH,
                                   rank_of.get(e, 0.0))
            if table.log is not None:
                table.log.copies.append(h)
            self._submitted[h.id] = self.time.now()
            self._submit_token[h.id] = self.token
            table.place(e, slot, h)
            table.prefetched[slot] = True
            self.n_prefetched[il] += 1
            self.policy.on_insert(il, e, self.clock)
            st.bytes_copied += self.slot_bytes[il]
            n += 1
        st.prefetch_issued += n
        self.prefetch_events += n
        return n

    def _note_eviction(self, il: int, table: SlotTable, slot: int) -> None:
        """A slot about to be reused: a prefetched expert in it that was never used was wasted."""
        if table.prefetched[slot]:
            st = self.stats.layers[il]
            st.prefetch_wasted += 1
            self.prefetch_events += 1
            st.prefetch_wasted_bytes += self.slot_bytes[il]
            table.prefetched[slot] = False
            self.n_prefetched[il] -= 1

    def count_prefetch_hits(self, il: int, table: SlotTable, need: list[int]) -> None:
        st = self.stats.layers[il]
        for e in need:
            s = table.slot_of_list[e]
            if s >= 0 and table.prefetched[s]:
                table.prefetched[s] = False
                self.n_prefetched[il] -= 1
                st.prefetch_hits += 1
                self.prefetch_events += 1

    def cancel_stale(self, il: int, handles: list[CopyHandle | None], need: list[int]) -> list[int]:
        """Early preemption at the gate: the positions in ``handles`` (a layer's copies in flight, by slot or
        bottom buffer) of prefetches still queued that this call does not need, now cancelled (never written)."""
        used = set(need)
        out = self._cancel_where(handles, Priority.PREFETCH, lambda h: h.expert not in used)
        self.stats.layers[il].prefetch_dropped += len(out)
        return out

    def _cancel_where(self, handles: list[CopyHandle | None], priority: Priority,
                      stale: Callable[[CopyHandle], bool]) -> list[int]:
        """Cancel the copies of ``priority`` in ``handles`` that ``stale`` picks and that have not started; their
        positions."""
        out = []
        cancel, submitted, submit_token = self.copies.cancel, self._submitted, self._submit_token
        for i in compress(range(len(handles)), handles):  # the positions holding a copy, found in C
            h = handles[i]
            if h.priority is priority and stale(h) and cancel(h):
                submitted.pop(h.id, None)
                submit_token.pop(h.id, None)
                out.append(i)
        return out

    def drop_stale_prefetches(self, il: int, table: SlotTable, need: list[int]) -> None:
        """Prefetches for this layer still queued and not needed are cancelled; their slots are free again."""
        for slot in self.cancel_stale(il, table.copy, need):
            if table.prefetched[slot]:
                self.n_prefetched[il] -= 1
            table.drop(slot)

    def score_prediction(self, il: int, predicted: list[int]) -> None:
        """Remember the top-k predicted for layer ``il``'s next call, to score it when that call comes."""
        with self.lock:
            self.predicted[il] = predicted
