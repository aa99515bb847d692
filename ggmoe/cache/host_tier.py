"""The host tier: pinned host slots under the GPU's, filled from the model file (the disk tier).

Python decides which experts sit in host memory; a ``DiskReader`` (the engine's O_DIRECT reads, the
simulator's costed disk) moves the bytes. Every cached MoE layer has the same number of host slots
(``ggmoe.cache.tiers``). An expert is *readable* from the host tier once its read has landed; until then,
and after it is evicted, its bytes are read from the file in place (the engine's mmap of the GGUF), which
is always correct, only slow.

Invariants:
- a slot holds at most one expert, and an expert sits in at most one slot;
- a slot is overwritten only after its expert's ``HostMove(.., slot=-1)`` was taken by the engine (so no
  reader is pointed at it any more) and only when no copy reads it (``pin`` counts those copies);
- an expert is read from disk at most once while it sits in the host tier (``reads`` counts every read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ggmoe.cache.copy import Marker
from ggmoe.cache.policies import POLICIES


class DiskReader(Protocol):
    """Reads one whole expert (every tensor kind) of a layer from the model file into a host slot."""

    def submit(self, il: int, expert: int, slot: int) -> Marker:
        """Start the read; returns at once with a marker."""

    def done(self, marker: Marker) -> bool:
        """Whether the read has landed (raises the read's error, a ``DiskTierError``, if it failed)."""

    def wait(self, marker: Marker) -> None:
        """Block until the read has landed (raises its error if it failed)."""

    def close(self) -> None:
        """Wait for reads in flight and release the file."""


@dataclass(frozen=True)
class HostMove:
    """An expert entering (``slot >= 0``, its read landed) or leaving (``slot == -1``) the host tier."""

    il: int
    expert: int
    slot: int  # host slot, or -1: read from the file again


@dataclass
class HostTierStats:
    """One layer's host tier counters (experts; bytes where named)."""

    hits: int = 0  # experts asked for that sat in the host tier (or whose read was in flight)
    reads: int = 0  # experts read from disk into a host slot
    predicted_reads: int = 0  # of those, reads started by a prediction (a prefetch)
    predicted_used: int = 0  # predicted reads asked for by a demand or an admission later
    in_place: int = 0  # experts read from the file in place (no host slot free, or the graph's own read)
    bytes_read: int = 0  # bytes read from disk into host slots

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Layer:
    slot_of: list[int]  # [n_expert] host slot of a readable expert, else -1
    expert_in: list[int]  # [n_slots] expert held (readable or being read), else -1
    pending: dict[int, tuple[int, Marker, bool]] = field(default_factory=dict)  # expert -> (slot, marker, predicted)
    predicted: set[int] = field(default_factory=set)  # readable experts read by a prediction, not yet asked for


class HostTier:
    """The host tier of every cached MoE layer: slots, an eviction policy, the reads in flight, counters."""

    def __init__(self, layers: Sequence[int], n_expert: int, n_slots: int, expert_bytes: dict[int, int],
                 reader: DiskReader, policy: str = "lru", max_predicted: int = 8) -> None:
        """``expert_bytes``: bytes of one expert (all kinds) per layer; ``max_predicted``: predicted reads in flight
        per layer at most (a prefetch never queues the disk deeper than that)."""
        self.n_expert, self.n_slots = n_expert, n_slots
        self.expert_bytes = expert_bytes
        self.reader = reader
        self.max_predicted = max_predicted
        self.policy = POLICIES.get(policy)(n_expert, list(layers))
        self.layers = {il: _Layer([-1] * n_expert, [-1] * n_slots) for il in layers}
        self.stats = {il: HostTierStats() for il in layers}
        self.pins: Counter[tuple[int, int]] = Counter()  # (il, expert) -> copies reading its host slot
        self.moves: list[HostMove] = []  # what the engine must point its readers at, in order
        self.clock = 0  # one tick per token (the policy's clock)
        self._used: dict[int, set[int]] = {il: set() for il in layers}  # experts asked for this token
        self._predicting = False  # a prediction found no free slot: next_token keeps some free
        # whether a prediction may evict (an expert not asked for this token): only where nothing reads a host
        # slot beside the cache's calls but pinned copies (the sync decode); the async decode's graph reads host
        # slots through its tables while predictions run on the mailbox's thread
        self.predictions_evict = False

    def readable(self, il: int, expert: int) -> int:
        """The host slot ``expert`` is read from, or -1 (read from the file in place)."""
        return self.layers[il].slot_of[expert]

    def ensure(self, il: int, expert: int, predicted: bool = False) -> Marker | None:
        """Have ``expert`` read into the host tier: None when it is readable now or cannot get a slot (then it is
        read in place), else the marker of its read in flight (``wait_read`` blocks on it)."""
        lay, st = self.layers[il], self.stats[il]
        if not predicted:
            self._used[il].add(expert)
            self.policy.on_access(il, [expert], self.clock)
        if lay.slot_of[expert] >= 0 or expert in lay.pending:
            if not predicted:
                st.hits += 1
                if expert in lay.predicted or (expert in lay.pending and lay.pending[expert][2]):
                    st.predicted_used += 1
                    lay.predicted.discard(expert)
                    if expert in lay.pending:
                        slot, marker, _ = lay.pending[expert]
                        lay.pending[expert] = (slot, marker, False)
            return lay.pending[expert][1] if expert in lay.pending else None
        if predicted and sum(p for _, _, p in lay.pending.values()) >= self.max_predicted:
            return None
        slot = self._take_slot(il, predicted)
        if slot is None:
            if not predicted:
                st.in_place += 1
            return None
        lay.expert_in[slot] = expert
        marker = self.reader.submit(il, expert, slot)
        lay.pending[expert] = (slot, marker, predicted)
        st.reads += 1
        st.predicted_reads += int(predicted)
        st.bytes_read += self.expert_bytes[il]
        return marker

    def _take_slot(self, il: int, predicted: bool) -> int | None:
        """A free slot, else the policy's victim among readable unpinned experts, whose ``HostMove(.., -1)`` is
        queued. None: no slot. A prediction takes free slots only unless ``predictions_evict`` (it may run beside
        a graph that still reads a victim's slot), and never evicts an expert asked for this token."""
        lay = self.layers[il]
        for s, e in enumerate(lay.expert_in):
            if e < 0:
                return s
        if predicted and not self.predictions_evict:
            self._predicting = True
            return None
        return self._evict(il, self._used[il] if predicted else set())

    def _evict(self, il: int, keep: set[int]) -> int | None:
        """Evict the policy's victim among readable unpinned experts not in ``keep``: its freed slot, or None."""
        lay = self.layers[il]
        candidates = [e for e in lay.expert_in if e >= 0 and e not in lay.pending and not self.pins[(il, e)]
                      and e not in keep]
        if not candidates:
            return None
        victim = self.policy.victims(il, candidates, 1, self.clock)[0]
        slot = lay.slot_of[victim]
        lay.slot_of[victim] = -1
        lay.expert_in[slot] = -1
        lay.predicted.discard(victim)
        self.policy.on_evict(il, victim)
        self.moves.append(HostMove(il, victim, -1))
        return slot

    def land(self, il: int | None = None) -> int:
        """Make the landed reads readable (``HostMove`` queued for each); returns how many landed."""
        n = 0
        for layer in (self.layers if il is None else (il,)):
            lay = self.layers[layer]
            for expert, (_, marker, _) in list(lay.pending.items()):
                if self.reader.done(marker):
                    self._landed(layer, expert)
                    n += 1
        return n

    def wait_read(self, il: int, expert: int) -> None:
        """Block until ``expert``'s read in flight has landed, then make it readable."""
        lay = self.layers[il]
        if expert in lay.pending:
            self.reader.wait(lay.pending[expert][1])
            self._landed(il, expert)

    def _landed(self, il: int, expert: int) -> None:
        lay = self.layers[il]
        slot, _, predicted = lay.pending.pop(expert)
        lay.slot_of[expert] = slot
        if predicted:  # as recent as a use: else the policy's oldest, the next demand's victim before it is asked
            lay.predicted.add(expert)
            self.policy.on_access(il, [expert], self.clock)
        self.policy.on_insert(il, expert, self.clock)
        self.moves.append(HostMove(il, expert, slot))

    def touch(self, il: int, experts: Iterable[int]) -> None:
        """Experts the layer used (GPU hits included): the policy ages by every use, so the host tier keeps
        what the model uses most, not what the GPU tier happened to miss last."""
        es = [int(e) for e in experts]
        self.policy.on_access(il, es, self.clock)
        self._used[il].update(es)

    def pin(self, il: int, expert: int) -> None:
        """A copy reads ``expert``'s host slot from now until ``unpin``: the slot is not reused meanwhile."""
        self.pins[(il, expert)] += 1

    def unpin(self, il: int, expert: int) -> None:
        key = (il, expert)
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]

    def prefetch(self, il: int, experts: Sequence[int]) -> int:
        """Start predicted reads of ``experts`` (likeliest first) not in the host tier; returns how many started.

        Judged by bytes: of ``len(experts)`` it reads the share its layer's predicted reads were used so far
        (Laplace's estimate, (used + 1) / (read + 2)), at least one, at most ``max_predicted`` in flight."""
        lay, st = self.layers[il], self.stats[il]
        share = (st.predicted_used + 1) / (st.predicted_reads + 2)
        budget = max(1, round(len(experts) * share))
        started = 0
        for e in experts[:budget]:
            if lay.slot_of[e] < 0 and e not in lay.pending and self.ensure(il, e, predicted=True) is not None:
                started += 1
        return started

    def note_in_place(self, il: int, experts: Iterable[int]) -> None:
        """Count experts the graph read from the file itself (not readable from the host tier then)."""
        lay, st = self.layers[il], self.stats[il]
        for e in experts:
            if lay.slot_of[e] < 0:
                st.in_place += 1

    def next_token(self) -> None:
        """Between tokens (no graph reads a host slot): once predictions found no free slot, free up to
        ``max_predicted`` slots per layer for the next token's, evicting experts not asked for this token;
        then advance the policy's clock."""
        if self._predicting:
            reserve = min(self.max_predicted, self.n_slots // 4)
            for il, lay in self.layers.items():
                while lay.expert_in.count(-1) < reserve and self._evict(il, self._used[il]) is not None:
                    pass
        self.clock += 1
        for used in self._used.values():
            used.clear()

    def take_moves(self) -> list[HostMove]:
        """The moves since the last call, in order (the engine points its readers accordingly)."""
        moves, self.moves = self.moves, []
        return moves

    def totals(self) -> dict[str, int]:
        """Every layer's counters summed."""
        out: Counter[str] = Counter()
        for st in self.stats.values():
            out.update(st.to_dict())
        return dict(out)

    def close(self) -> None:
        for il, lay in self.layers.items():
            for expert in list(lay.pending):
                try:
                    self.wait_read(il, expert)
                except Exception:  # noqa: BLE001 - closing: a failed read leaves nothing to land
                    lay.pending.pop(expert, None)
        self.reader.close()
