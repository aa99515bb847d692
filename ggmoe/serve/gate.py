"""One generation at a time per model, a bounded queue of waiting requests, 429 beyond it.

The model runs batch size 1: requests take the model in arrival order (anyio's
semaphore wakes waiters first in, first out); at most ``max_queue`` may wait for it, and one more is refused
with 429 and a ``Retry-After`` estimated from recent request durations.
"""

from __future__ import annotations

import math
import time

import anyio

from ggmoe.serve.errors import APIError


class Gate:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue  # requests that may wait while one runs
        self.waiting = 0  # requests queued now
        self.running = 0  # 0 or 1
        # A semaphore, not a lock: a streamed response frees the model from the SSE task, not the
        # request's task, and anyio's Lock refuses a release by a task that does not own it.
        self._model = anyio.Semaphore(1)
        self._mean_s = 1.0  # moving mean of a request's seconds holding the model
        self._t0 = 0.0

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by one (at least 1)."""
        return max(1, math.ceil(self._mean_s * (self.waiting + 1) / max(self.max_queue, 1)))

    async def enter(self) -> None:
        """Wait for the model; raise a 429 ``APIError`` when the queue is full."""
        if self._model.value == 0 and self.waiting >= self.max_queue:
            raise APIError(429, f"the server is busy: {self.waiting} requests are already waiting for the model; "
                                "retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after())})
        self.waiting += 1
        try:
            await self._model.acquire()
        finally:
            self.waiting -= 1
        self.running = 1
        self._t0 = time.monotonic()

    def leave(self) -> None:
        """Give the model to the next request (call exactly once per successful ``enter``)."""
        self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - self._t0)
        self.running = 0
        self._model.release()
