"""What the cache decided, handed to whoever executes it: flips of the expert tables and the copies issued.

The cache does not call back up into the engine. Every change of what is readable where (an expert's copy
landed in its slot, a victim's slot about to be overwritten, a split expert's bottom in a buffer) is written
as a ``Flip`` record into the cache's log, and ``ExpertCache.take_step`` hands the log since the last step to
the executor as one frozen ``StepChanges``: the async decode's controller returns one per decoded token, the
pipeline drains one before each decode and after each routed layer, and the engine's expert tables apply its
flips before the next graph reads them (``ggmoe.engine.tables``). The record also lists the copies the cache
issued on its copy backend since the last step, so that a test checks a step's decisions without a model.

Ordering (what keeps it exact): the flips are in the order the cache made them, so a victim's flip to host
memory precedes the flip of the expert copied into its slot; no graph runs between the copy's submission and
the application of its changes (the controller runs after the decode's logits were read; the route callback holds its
graph), and the tables reach the device only in ``flush``, after the changes were applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ggmoe.cache.copy import CopyHandle, Priority


class Flip(NamedTuple):
    """One expert-table entry of layer ``il`` to point elsewhere (a tuple: made on the hottest path)."""

    il: int
    expert: int
    slot: int  # where the expert is read now: a slot (a bottom buffer when ``bottom``), or -1: host memory
    bottom: bool = False  # a split expert's bottom segment (MoEpic), not its slot's top or whole matrix


@dataclass(frozen=True)
class StepChanges:
    """The cache's decisions since the last step, in order: the table flips to apply, the copies issued."""

    flips: tuple[Flip, ...] = ()  # in the order made; applying them in order gives the cache's final mapping
    copies: tuple[CopyHandle, ...] = ()  # submitted on the copy backend, in submission order

    def __bool__(self) -> bool:
        return bool(self.flips or self.copies)

    def by_priority(self, priority: Priority) -> tuple[CopyHandle, ...]:
        """The copies of one priority: DEMAND (a layer waits for it), ADMISSION (a miss, for later tokens),
        PREFETCH (a prediction)."""
        return tuple(h for h in self.copies if h.priority is priority)

    @property
    def evictions(self) -> tuple[tuple[int, int], ...]:
        """(il, expert) of every expert whose slot stopped being readable (evicted, or overwritten), once each,
        in order."""
        seen: dict[tuple[int, int], None] = {}
        for f in self.flips:
            if f.slot < 0 and not f.bottom:
                seen.setdefault((f.il, f.expert))
        return tuple(seen)


EMPTY_STEP = StepChanges()


class StepLog:
    """The cache's running log of flips and copies (appended to from the cache's calls, on whatever thread a
    prefetch runs on: list appends are atomic), cut into one ``StepChanges`` per ``take``."""

    def __init__(self) -> None:
        self.flips: list[Flip] = []
        self.copies: list[CopyHandle] = []

    def take(self) -> StepChanges:
        if not self.flips and not self.copies:
            return EMPTY_STEP
        flips, self.flips = self.flips, []
        copies, self.copies = self.copies, []
        return StepChanges(tuple(flips), tuple(copies))
