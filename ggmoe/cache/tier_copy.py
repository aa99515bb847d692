"""Copies to the GPU tier that first bring the expert into the host tier (a read from disk when it is not).

``TieredCopyBackend`` wraps the cache's copy backend. A copy of an expert that the host tier holds goes to the
wrapped backend at once, its host slot pinned until it lands. Otherwise the host tier reads the expert from
the file first (a prefetch's copy starts a predicted read), and the copy is handed on when the read has
landed: in ``done`` (polled every token) or ``wait`` (a demand). Every call into the wrapped backend and the
host tier happens on the caller's thread. An expert that gets no host slot is copied from the file in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ggmoe.cache.copy import CopyBackend, CopyHandle, Priority
from ggmoe.cache.host_tier import HostTier


class TieredCopyBackend:
    """A ``CopyBackend`` whose copies read from the host tier, filled from disk on the way."""

    def __init__(self, inner: CopyBackend, tier: HostTier) -> None:
        self.inner = inner
        self.tier = tier
        self._ids = itertools.count()
        self._reading: dict[int, tuple[CopyHandle, float]] = {}  # handle id -> (its handle, rank): read in flight
        self._copying: dict[int, CopyHandle] = {}  # handle id -> the wrapped backend's handle
        self._cancelled: set[int] = set()
        self.lands_later = bool(getattr(inner, "lands_later", False))
        if hasattr(inner, "promote"):
            self.promote = self._promote

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        h = CopyHandle(next(self._ids), il, expert, slot, priority)
        marker = self.tier.ensure(il, expert, predicted=priority == Priority.PREFETCH)
        if marker is None:
            self._start(h, rank)
        else:
            self._reading[h.id] = (h, rank)
        return h

    def _start(self, h: CopyHandle, rank: float) -> None:
        """Hand the copy to the wrapped backend, reading from the host slot (pinned) or the file in place."""
        self.tier.pin(h.il, h.expert)
        self._copying[h.id] = self.inner.submit(h.il, h.expert, h.slot, h.priority, rank)

    def _advance(self, h: CopyHandle, block: bool) -> bool:
        """Move a copy whose read was in flight on when the read has landed; True once it is with the wrapped
        backend (or cancelled)."""
        if h.id in self._cancelled:
            return True
        if h.id in self._reading:
            lay = self.tier.layers[h.il]
            pending = lay.pending.get(h.expert)
            if pending is not None:
                if block:
                    self.tier.wait_read(h.il, h.expert)
                elif self.tier.reader.done(pending[1]):
                    self.tier.wait_read(h.il, h.expert)
                else:
                    return False
            self._start(*self._reading.pop(h.id))
        return True

    def done(self, handle: CopyHandle) -> bool:
        if not self._advance(handle, block=False):
            return False
        if handle.id in self._cancelled:
            self._cancelled.discard(handle.id)
            return True
        inner = self._copying.get(handle.id)
        if inner is None:
            return True
        if not self.inner.done(inner):
            return False
        self._finish(handle)
        return True

    def _finish(self, handle: CopyHandle) -> None:
        if self._copying.pop(handle.id, None) is not None:
            self.tier.unpin(handle.il, handle.expert)

    def wait(self, handles: Iterable[CopyHandle]) -> None:
        hs = list(handles)
        for h in hs:
            self._advance(h, block=True)
        inner = [self._copying[h.id] for h in hs if h.id in self._copying]
        self.inner.wait(inner)
        for h in hs:
            self._finish(h)
            self._cancelled.discard(h.id)

    def cancel(self, handle: CopyHandle) -> bool:
        if handle.id in self._reading:  # the read goes on into the host tier; the copy never starts
            self._reading.pop(handle.id)
            self._cancelled.add(handle.id)
            return True
        inner = self._copying.get(handle.id)
        if inner is not None and self.inner.cancel(inner):
            self._finish(handle)
            self._cancelled.add(handle.id)
            return True
        return False

    def _promote(self, handle: CopyHandle) -> None:
        inner = self._copying.get(handle.id)
        if inner is not None:
            self.inner.promote(inner)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()
        self.tier.close()
