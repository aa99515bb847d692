"""The simulator's disk tier: a host tier per layer over a disk link, under the GPU's slots and the PCIe link.

A model larger than ``--host-ram`` keeps its experts in the GGUF file (``ggmoe.cache.tiers``). The host tier
holds ``host_slots`` experts per layer under the cache's own policies (LRU by default); every access to it is
a GPU-tier miss on its way up: a link copy (demand, admission, prefetch), an in-place read of the async
decode, or an expert the CPU computes. Its policy ranks by every use of a layer's experts, GPU hits too
(``HostTierTimes.touch``), as the page cache sees every read. An expert that is not in the host tier is read from disk into a host
slot first, and only then may the link copy it (``DiskLinkCopyBackend``: the copy's job becomes ready when
the read lands). The disk serves reads in order; several in flight hide each read's latency behind the
transfer before it, so a read pays ``disk_latency_s`` only on an idle disk (``DiskQueue``).

Disk prefetch reaches further ahead than the link's: the planner's experts for each layer's next call and the
stride prefetcher's predictions are read into the host tier in the background (``HostTierTimes.prefetch``), all of
them, not only those the GPU has a slot for. They are judged by bytes, as link prefetches are: a prefetched
expert used before it leaves the host tier counts its bytes as used, one evicted unused as wasted; the number
read per prediction falls while the wasted bytes outrun the used, rises otherwise, and a prediction finding the
disk's queue longer than its own reads would take adds none (they would delay the demand reads behind them).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggmoe.cache.clock import ManualClock
from ggmoe.cache.copy import CopyHandle, Priority
from ggmoe.cache.hardware import HardwareProfile
from ggmoe.cache.policies import make_policy
from ggmoe.cache.split import LayerSplit
from ggmoe.simulate.timeline import LinkCopyBackend, _Handle, _Job

PROBE_AFTER = 16  # predictions with disk prefetch off before it tries one read again


@dataclass
class TierCounts:
    """The host and disk tiers' counters over one replay (mutable: the replay adds to them)."""

    host_hits: int = 0  # accesses that found the expert in the host tier, landed
    host_late: int = 0  # accesses that found its disk read (a prefetch's) still in flight
    host_misses: int = 0  # accesses that started a disk read (on the critical path when a layer waits)
    disk_reads: int = 0  # experts read from disk, demand and prefetch
    disk_bytes: int = 0
    streamed_reads: int = 0  # experts streamed through for micro-batches too wide for the slots (no host slot)
    prefetch_reads: int = 0  # experts read from disk by a prediction
    prefetch_bytes: int = 0
    prefetch_used_bytes: int = 0  # bytes of prefetched experts accessed before they left the host tier
    prefetch_wasted_bytes: int = 0  # bytes of prefetched experts evicted unused
    disk_busy_s: float = 0.0  # s the disk transferred

    def to_dict(self, n_decode: int) -> dict[str, Any]:
        """Plain JSON form with the shares and per-token figures (``n_decode``: decoded tokens; the bytes per token
        count the prompts' reads too)."""
        access = self.host_hits + self.host_late + self.host_misses
        return {**vars(self), "host_accesses": access,
                "host_hit_rate": self.host_hits / access if access else 0.0,
                "disk_bytes_per_token": self.disk_bytes / n_decode if n_decode else 0.0,
                "predicted_read_share": self.prefetch_reads / self.disk_reads if self.disk_reads else 0.0}


class DiskQueue:
    """One disk: reads in submission order at the profile's expert rate (no profile: every read lands at once)."""

    def __init__(self, clock: ManualClock, profile: HardwareProfile | None, counts: TierCounts) -> None:
        self.clock = clock
        self.profile = profile
        self.counts = counts
        self.free_at = 0.0  # s: the disk has transferred everything queued by then

    def read(self, nbytes: int) -> float:
        """Queue one expert's reads (``nbytes``); the time they land (s)."""
        now = self.clock.t
        p = self.profile
        if p is None:
            return now
        xfer = nbytes / p.disk_bytes_per_s
        if self.free_at <= now:  # an idle disk: the first read's latency is not hidden
            self.free_at = now + (p.disk_latency_s or 0.0) + xfer
        else:
            self.free_at += xfer
        self.counts.disk_busy_s += xfer
        return self.free_at

    def backlog_s(self) -> float:
        """Seconds of reads queued ahead of one submitted now."""
        return max(0.0, self.free_at - self.clock.t)


class HostTierTimes:
    """``host_slots`` experts per layer in pinned host memory, each with the time its disk read lands."""

    def __init__(self, host_slots: int, n_expert: int, layers: list[int], bytes_per_expert: Mapping[int, int],
                 disk: DiskQueue, policy: str = "lru", n_prefetch: int = 0) -> None:
        self.host_slots = host_slots
        self.bpe = dict(bytes_per_expert)
        self.disk = disk
        self.counts = disk.counts
        self.policy = make_policy(policy, n_expert, layers)
        self.landed: dict[int, dict[int, float]] = {il: {} for il in layers}  # il -> expert -> s its read lands
        self.unused: dict[int, set[int]] = {il: set() for il in layers}  # prefetched, not accessed yet
        self.n_prefetch = n_prefetch  # the most experts read per prediction
        self.limit = n_prefetch  # the throttle's current number
        self._judged = (0, 0)  # (used, wasted) bytes at the last prediction
        self._off = 0  # predictions in a row with the limit at 0
        self._tick = 0  # the policy's clock: one per access

    def fetch(self, il: int, expert: int) -> float:
        """An access on the way up: the time ``expert`` of ``il`` sits in a host slot (now, its read's landing,
        or a new disk read's)."""
        self._tick += 1
        t = self.landed[il].get(expert)
        c = self.counts
        if t is None:
            c.host_misses += 1
            return self._read(il, expert, predicted=False)
        if t <= self.disk.clock.t:
            c.host_hits += 1
        else:
            c.host_late += 1
        if expert in self.unused[il]:
            self.unused[il].discard(expert)
            c.prefetch_used_bytes += self.bpe[il]
        self.policy.on_access(il, [expert], self._tick)
        return t

    def touch(self, il: int, experts: Iterable[int]) -> None:
        """A layer's routing, GPU hits included: the policy ranks the host tier by every use of its experts, as
        the page cache sees every read, not by the GPU's misses alone (those are what the GPU's slots do not
        keep, so a policy fed only them evicts the experts the GPU uses most, and re-reads them from disk)."""
        landed = self.landed[il]
        used = sorted({e for e in experts if e in landed})
        if used:
            self._tick += 1
            self.policy.on_access(il, used, self._tick)

    def resident(self, il: int, expert: int) -> bool:
        return expert in self.landed[il]

    def prefetch(self, il: int, experts: Iterable[int], skip: Iterable[int] = ()) -> int:
        """Read the predicted ``experts`` of ``il`` not in the host tier (nor in ``skip``: on the GPU already), as
        many as the throttle allows; how many were read."""
        if il not in self.landed or self.n_prefetch <= 0:
            return 0
        self._judge()
        landed, skipped = self.landed[il], set(skip)
        want = [e for e in experts if e not in landed and e not in skipped][: self.limit]
        if not want or self.disk.backlog_s() > len(want) * self._read_s(il):
            return 0
        for e in want:
            self._tick += 1
            self._read(il, e, predicted=True)
        return len(want)

    def _read_s(self, il: int) -> float:
        p = self.disk.profile
        return p.disk_read_s(self.bpe[il]) if p is not None else 0.0

    def _judge(self) -> None:
        """The throttle, by bytes since the last prediction: fewer reads while the wasted outrun the used."""
        c = self.counts
        used, wasted = c.prefetch_used_bytes - self._judged[0], c.prefetch_wasted_bytes - self._judged[1]
        self._judged = (c.prefetch_used_bytes, c.prefetch_wasted_bytes)
        if wasted > used:
            self.limit = max(0, self.limit - 1)
        elif used > wasted:
            self.limit = min(self.n_prefetch, self.limit + 1)
        if self.limit == 0:
            self._off += 1
            if self._off >= PROBE_AFTER:  # try one read again: the routing may have settled
                self.limit, self._off = 1, 0

    def _read(self, il: int, expert: int, predicted: bool) -> float:
        """A disk read of ``expert`` into a host slot of ``il``, evicting the policy's victim when full."""
        landed = self.landed[il]
        if len(landed) >= self.host_slots:
            now = self.disk.clock.t
            cand = sorted(e for e, t in landed.items() if t <= now) or sorted(landed)  # not one still landing
            self._evict(il, self.policy.victim(il, cand, self._tick))
        nbytes = self.bpe[il]
        c = self.counts
        c.disk_reads += 1
        c.disk_bytes += nbytes
        if predicted:
            c.prefetch_reads += 1
            c.prefetch_bytes += nbytes
            self.unused[il].add(expert)
        t = landed[expert] = self.disk.read(nbytes)
        self.policy.on_insert(il, expert, self._tick)
        self.policy.on_access(il, [expert], self._tick)  # a read is its first use: LRU must not evict it next
        return t

    def _evict(self, il: int, expert: int) -> None:
        del self.landed[il][expert]
        self.policy.on_evict(il, expert)
        if expert in self.unused[il]:
            self.unused[il].discard(expert)
            self.counts.prefetch_wasted_bytes += self.bpe[il]

    def stream_s(self, il: int, n_expert: int) -> float:
        """Seconds from now until the disk has read every expert of ``il`` not in the host tier (a micro-batch too
        wide for the slots uploads the layer's whole tensors). Each read lands in a host slot on its way, so the
        host tier keeps the last ``host_slots`` of them, as it would any read."""
        landed, last = self.landed[il], self.disk.clock.t
        for e in range(n_expert):
            if e not in landed:
                self._tick += 1
                self.counts.streamed_reads += 1
                last = self._read(il, e, predicted=False)
        return max(0.0, last - self.disk.clock.t)

    def wait_s(self, il: int, experts: Iterable[int]) -> float:
        """Seconds from now until every one of ``experts`` of ``il`` sits in the host tier (each one accessed)."""
        now = self.disk.clock.t
        last = max((self.fetch(il, e) for e in experts), default=now)
        return max(0.0, last - now)


class DiskLinkCopyBackend(LinkCopyBackend):
    """The link over the host tier: a copy's job becomes ready when its expert sits in a host slot. Jobs wait in
    ``_pending`` by that time, so every submission goes in its place instead of at the end; the link's shortcuts
    that assume each job ready when submitted (held demand copies, ``demand_now``, whole-job drains) are off."""

    __slots__ = ("host",)

    def __init__(self, clock: ManualClock, bytes_per_expert: dict[int, int], profile: HardwareProfile | None,
                 n_chunks: int, split: dict[int, LayerSplit] | None, host: HostTierTimes) -> None:
        super().__init__(clock, bytes_per_expert, profile, n_chunks, split)
        self.host = host

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        ready = self.host.fetch(il, expert)
        p = priority if type(priority) is Priority else Priority(priority)
        h = _Handle(next(self._ids), il, expert, slot, p)
        if self.profile is None:
            self._landed[h.id] = self.clock.now()
            h._landed_flag = True
            return h
        cs = self._chunk_of.get(il)
        if cs is None:
            cs = self._chunk_s(h)
            if il not in self.split:
                self._chunk_of[il] = cs
        job = _Job((p, rank, h.id), h, max(self.clock.t, ready), self.n_chunks, cs)
        self._queue[h.id] = job
        pending = self._pending
        i = len(pending)
        while i and pending[i - 1].submitted > job.submitted:  # behind the jobs ready no later than it
            i -= 1
        pending.insert(i, job)
        return h

    def demand_now(self, il: int, n: int) -> bool:
        return False  # each demand copy waits for its own disk read: jobs, not the idle link's shortcut

    def _drain(self, pending: set[int]) -> None:
        """``_step(None)`` until every job of ``pending`` landed: jobs may become ready later than the link's
        next start (their disk reads), so they are not run whole in one sweep."""
        while pending:
            hid = self._step(None)
            if hid is None:
                return
            pending.discard(hid)

    def remaining_s(self, handle: CopyHandle) -> float | None:
        out = super().remaining_s(handle)
        job = self._queue.get(handle.id)
        if out is not None and job is not None and not job.started:  # its disk read lands first
            out = max(out, job.submitted - self.clock.now() + job.chunks_left * job.chunk_s)
        return out


# Stock llama.cpp with mmap on a model larger than RAM: the OS's page cache stands in for the host tier, and a
# page fault reads the kernel's readahead window synchronously (one read at QD1: nothing else in flight).
FAULT_READ_BYTES = 128 << 10  # Linux's default read_ahead_kb (the block layer's queue/read_ahead_kb sysfs file)


def fault_bytes_per_s(profile: HardwareProfile) -> float:
    """What page faults read per second: one readahead window at a time, each paying the disk's latency."""
    return FAULT_READ_BYTES / (FAULT_READ_BYTES / profile.disk_bytes_per_s + (profile.disk_latency_s or 0.0))


def page_cache_reads(ids: np.ndarray, host_slots: int, columns: Iterable[int]) -> np.ndarray:
    """Per token, the experts an LRU page cache of ``host_slots`` experts per layer reads from disk, over the
    trace's ``ids`` [n_tokens, n_layers, k] in the given layer ``columns`` (the layers whose experts the CPU reads
    through mmap); an estimate of stock llama.cpp's faults (the OS evicts by recency, whole experts here)."""
    cols = list(columns)
    lru: list[collections.OrderedDict[int, None]] = [collections.OrderedDict() for _ in cols]
    out = np.zeros(ids.shape[0], dtype=np.int64)
    for t in range(ids.shape[0]):
        n = 0
        for cache, j in zip(lru, cols, strict=True):
            for e in set(ids[t, j].tolist()):
                if e in cache:
                    cache.move_to_end(e)
                    continue
                n += 1
                cache[e] = None
                if len(cache) > host_slots:
                    cache.popitem(last=False)
        out[t] = n
    return out
