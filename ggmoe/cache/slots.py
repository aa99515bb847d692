"""One layer's slots: which expert sits where, and whether its copy has landed.

Plain lists, not numpy: the route callback touches a handful of entries per
call, where Python indexing costs far less than numpy's per-call overhead.
"""

from __future__ import annotations

from bisect import insort
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

from ggmoe.cache.copy import CopyHandle
from ggmoe.cache.step import Flip

if TYPE_CHECKING:
    from ggmoe.cache.step import StepLog


class SlotState(IntEnum):
    EMPTY = 0  # holds no expert
    LOADING = 1  # a copy is in flight: never read it
    READY = 2  # the copy landed: the expert may be read


# the states as module constants: a global read is cheaper than an enum class attribute, on the hottest path
_EMPTY, _LOADING, _READY = SlotState.EMPTY, SlotState.LOADING, SlotState.READY


class SlotTable:
    """expert -> slot and slot -> expert (-1 where empty), per-slot state and the copy in flight."""

    def __init__(self, n_expert: int, n_slots: int) -> None:
        self.slot_of_list = [-1] * n_expert  # [n_expert] slot or -1
        self.expert_in_list = [-1] * n_slots  # [n_slots] expert or -1
        self.state = [SlotState.EMPTY] * n_slots  # [n_slots]
        self.copy: list[CopyHandle | None] = [None] * n_slots  # [n_slots] copy in flight into the slot
        self.free = list(range(n_slots))  # empty slots, lowest first
        self.n_loading = 0  # slots whose copy is in flight (0: the route callback skips the check)
        self.prefetched = [False] * n_slots  # [n_slots] holds a prefetched expert not used yet
        # where every change of what is readable where is written (``Flip`` records, for the async decode's
        # expert tables: ``ExpertCache.follow_tables``); None: nobody follows this layer
        self.log: StepLog | None = None
        self.il = -1  # the layer, named in the flips

    @property
    def n_slots(self) -> int:
        return len(self.expert_in_list)

    @property
    def slot_of(self) -> np.ndarray:
        return np.asarray(self.slot_of_list, dtype=np.int32)

    @property
    def expert_in(self) -> np.ndarray:
        return np.asarray(self.expert_in_list, dtype=np.int32)

    def place(self, expert: int, slot: int, handle: CopyHandle | None) -> None:
        """``expert`` goes into ``slot``: loading while ``handle`` is in flight, else ready."""
        old = self.expert_in_list[slot]
        if old >= 0:
            self.slot_of_list[old] = -1
            if self.log is not None:
                self.log.flips.append(Flip(self.il, old, -1))
        self.expert_in_list[slot] = expert
        self.slot_of_list[expert] = slot
        if self.copy[slot] is not None:
            self.n_loading -= 1
        self.copy[slot] = handle
        self.prefetched[slot] = False
        self.state[slot] = _LOADING if handle is not None else _READY
        if handle is not None:
            self.n_loading += 1
        elif self.log is not None:
            self.log.flips.append(Flip(self.il, expert, slot))

    def landed(self, slot: int) -> None:
        if self.copy[slot] is not None:
            self.n_loading -= 1
        self.copy[slot] = None
        was = self.state[slot]
        self.state[slot] = _READY
        if self.log is not None and was is _LOADING and self.expert_in_list[slot] >= 0:
            self.log.flips.append(Flip(self.il, self.expert_in_list[slot], slot))

    def drop(self, slot: int) -> int:
        """Empty ``slot``; returns the expert it held (-1 if none)."""
        old = self.expert_in_list[slot]
        if old >= 0:
            self.slot_of_list[old] = -1
            if self.log is not None:
                self.log.flips.append(Flip(self.il, old, -1))
        self.expert_in_list[slot] = -1
        if self.copy[slot] is not None:
            self.n_loading -= 1
        self.copy[slot] = None
        self.prefetched[slot] = False
        self.state[slot] = _EMPTY
        insort(self.free, slot)  # kept ascending: the lowest free slot is taken first
        return old

    def resident(self) -> list[int]:
        return [e for e in self.expert_in_list if e >= 0]

    def holds_any(self) -> bool:
        """Whether some slot holds an expert (a scan in C: cheaper than ``resident`` where the answer is mostly
        no, as under a policy that keeps nothing while the CPU computes every miss)."""
        return max(self.expert_in_list, default=-1) >= 0

    def clear(self) -> None:
        for slot in range(self.n_slots):
            if self.expert_in_list[slot] >= 0:
                self.drop(slot)


class BottomTable:
    """A split layer's bottom buffers (MoEpic): expert -> buffer and back, the copy in flight into each, and
    the access clock of each buffer's last use (the least recently used is reused first)."""

    def __init__(self, n_expert: int, n_buffers: int) -> None:
        self.buffer_of = [-1] * n_expert  # [n_expert] buffer or -1
        self.expert_in = [-1] * n_buffers  # [n_buffers] expert or -1
        self.copy: list[CopyHandle | None] = [None] * n_buffers  # [n_buffers] copy in flight into the buffer
        self.last_use = [0] * n_buffers  # [n_buffers] access clock of the last use or placement
        self.unused = [False] * n_buffers  # [n_buffers] holds a bottom placed and not read yet
        self.n_loading = 0  # buffers whose copy is in flight
        self.log: StepLog | None = None  # where bottom flips go (``Flip(..., bottom=True)``); None: nobody follows
        self.il = -1

    @property
    def n_buffers(self) -> int:
        return len(self.expert_in)

    def ready(self, expert: int) -> bool:
        """Whether ``expert``'s bottom has landed in a buffer (it may be read there)."""
        b = self.buffer_of[expert]
        return b >= 0 and self.copy[b] is None

    def victim(self, protect: set[int]) -> int | None:
        """A buffer to reuse: an empty one, else the least recently used whose copy has landed and whose
        expert is not in ``protect``; None when every buffer is loading or protected."""
        best = None
        for b, e in enumerate(self.expert_in):
            if e < 0:
                return b
            if self.copy[b] is None and e not in protect and (best is None or self.last_use[b] < self.last_use[best]):
                best = b
        return best

    def place(self, expert: int, buffer: int, handle: CopyHandle, clock: int) -> None:
        """``expert``'s bottom is copied into ``buffer`` (the old one's flip to host memory first)."""
        old = self.expert_in[buffer]
        if old >= 0:
            self.buffer_of[old] = -1
            if self.log is not None:
                self.log.flips.append(Flip(self.il, old, -1, True))
        if self.copy[buffer] is not None:
            self.n_loading -= 1
        self.expert_in[buffer] = expert
        self.buffer_of[expert] = buffer
        self.copy[buffer] = handle
        self.n_loading += 1
        self.last_use[buffer] = clock
        self.unused[buffer] = True

    def empty(self) -> int | None:
        """A buffer no expert is in (nothing points at it: a copy may go there while a graph runs), or None."""
        for b, e in enumerate(self.expert_in):
            if e < 0:
                return b
        return None

    def release(self, buffer: int) -> bool:
        """Empty a landed buffer (between tokens): its expert's bottom is read from host memory again (a flip
        to host memory). Returns whether the bottom was never read (a wasted prefetch)."""
        assert self.copy[buffer] is None, "a buffer with a copy in flight is cancelled (drop), not released"
        e = self.expert_in[buffer]
        if e >= 0:
            self.buffer_of[e] = -1
            self.expert_in[buffer] = -1
            if self.log is not None:
                self.log.flips.append(Flip(self.il, e, -1, True))
        wasted, self.unused[buffer] = self.unused[buffer], False
        return wasted

    def drop(self, buffer: int) -> None:
        """A copy into ``buffer`` was cancelled before any of it ran: the buffer is empty (its old expert was
        unmapped when the copy was placed; the new one was never mapped)."""
        if self.copy[buffer] is not None:
            self.copy[buffer] = None
            self.n_loading -= 1
        e = self.expert_in[buffer]
        if e >= 0:
            self.buffer_of[e] = -1
            self.expert_in[buffer] = -1
        self.unused[buffer] = False

    def landed(self, buffer: int) -> None:
        if self.copy[buffer] is None:
            return
        self.copy[buffer] = None
        self.n_loading -= 1
        e = self.expert_in[buffer]
        if e >= 0 and self.log is not None:
            self.log.flips.append(Flip(self.il, e, buffer, True))
