"""In-graph fills: the async decode's misses copied into free slots by the graph itself (patch 0012).

Before a table-mode decode the cache names, per layer, the slots the graph may fill (``FillPlan``): free
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


@dataclass(frozen=True)
class FillPlan:
    """Layer ``il``'s fill slots for the next table-mode decode, in the order the graph takes them."""

    il: int
    slots: tuple[int, ...]  # [f] slot indices
    held: tuple[int, ...]  # [f] the expert each slot holds now (-1: empty); it is evicted if its slot is filled


@dataclass(frozen=True)
class Fill:
    """One expert the graph copied into a fill slot of layer ``il`` (read back after the decode)."""

    il: int
    expert: int
    slot: int
    held: int  # the expert the slot held before (-1: none): overwritten, so evicted


def assign(plan: FillPlan, selected: Iterable[int], readable: Iterable[int]) -> list[Fill]:
    """What the graph does with ``plan`` (patch 0012's assignment, for the simulator and the tests): the
    ``selected`` experts not ``readable`` from a slot, ascending, take the plan's slots in order, skipping a
    slot whose expert is selected; misses beyond the slots are read in place."""
    sel = set(selected)
    ready = set(readable)
    out: list[Fill] = []
    nxt, f = 0, len(plan.slots)
    for e in sorted(sel - ready):
        while nxt < f and plan.held[nxt] >= 0 and plan.held[nxt] in sel:
            nxt += 1
        if nxt >= f:
            break
        out.append(Fill(plan.il, e, plan.slots[nxt], plan.held[nxt]))
        nxt += 1
    return out
