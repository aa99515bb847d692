"""In-graph fills: the async decode's misses copied into free slots by the graph itself (patch 0012).

Before a table-mode decode the cache names, per layer, the slots the graph may fill (``FillTargets``): free
slots first, then the policy's victims. The layer's first expert matmul assigns the selected experts that
no slot holds, in ascending id, to those slots in order, skipping a slot whose expert the micro-batch
itself selects (that expert is a hit); each is copied over the link into its slot and read there, so a
miss crosses the link once instead of twice (read in place, then admitted). After the decode the engine
reads back what went where (``Fill`` records) and the cache takes them as landed: no admission copy
follows. The simulator, which has no graph, computes the same assignment with ``assign``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SCORE_SCALE = 1024  # a policy's admission score (a use count, halved over time) in the graph's integer words


@dataclass(frozen=True)
class FillTargets:
    """Layer ``il``'s fill slots for the next table-mode decode, in the order the graph takes them, and the
    policy's admission filter: a miss takes a slot only when its score is above the slot's bar."""

    il: int
    slots: tuple[int, ...]  # [f] slot indices
    held: tuple[int, ...]  # [f] the expert each slot holds now (-1: empty); it is evicted if its slot is filled
    bar: tuple[int, ...] = ()  # [f] the score a miss must exceed to take the slot (-1, or () for all: any miss)
    score: tuple[int, ...] | None = None  # [n_expert] each expert's admission score (None: 0 for every expert)

    def admits(self, k: int, expert: int) -> bool:
        """Whether a miss of ``expert`` may take slot ``k`` of the targets."""
        if not self.bar:
            return True
        return (self.score[expert] if self.score is not None else 0) > self.bar[k]


@dataclass(frozen=True)
class Fill:
    """One expert the graph copied into a fill slot of layer ``il`` (read back after the decode)."""

    il: int
    expert: int
    slot: int
    held: int  # the expert the slot held before (-1: none): overwritten, so evicted


def assign(targets: FillTargets, selected: Iterable[int], readable: Iterable[int]) -> list[Fill]:
    """What the graph does with ``targets`` (patch 0012's assignment, for the simulator and the tests): each
    ``selected`` expert not ``readable`` from a slot, ascending, takes the first of the targets' slots not taken
    yet whose expert is not selected and that admits it; misses that find none are read in place."""
    sel = set(selected)
    taken = [h >= 0 and h in sel for h in targets.held]  # a slot whose expert is read now is a hit, never filled
    out: list[Fill] = []
    for e in sorted(sel.difference(readable)):
        for k, used in enumerate(taken):
            if not used and targets.admits(k, e):
                taken[k] = True
                out.append(Fill(targets.il, e, targets.slots[k], targets.held[k]))
                break
    return out
