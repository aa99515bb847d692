"""Time for the cache, injected: the engine reads a monotonic clock, the simulator and tests a manual one."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin."""


class MonotonicClock:
    """Wall time (``time.perf_counter``): the live engine. ``now`` is the C function itself, read on every
    routed layer: no Python frame between the cache and the clock."""

    now = staticmethod(time.perf_counter)


class ManualClock:
    """Time that moves only when told to: the simulator's virtual timeline and tests."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start  # seconds

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go back")
        self.t += seconds
