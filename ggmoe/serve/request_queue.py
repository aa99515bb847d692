"""The model's lanes (llama-server's slots: ``ggmoe.serve.lanes``), a bounded queue of waiting requests, 429 beyond it.

``n_lanes`` generations run at once (one with ``--parallel 1``): requests take a lane in arrival order
(anyio's semaphore wakes waiters first in, first out); at most ``max_queue`` may wait for one, and one more
is refused with 429 and a ``Retry-After`` estimated from recent request durations. What needs the whole
model (``enter_all``: embeddings and the prompt's logprobs with several lanes, the ``/slots`` actions) waits until it
holds every lane; requests of both kinds take lanes strictly in arrival order, so a whole-model holder is
never overtaken and two never deadlock holding half each.
"""

from __future__ import annotations

import itertools
import math
import time

import anyio

from ggmoe.serve.errors import APIError


class RequestQueue:
    """The lanes and the bounded wait for them (429 beyond ``max_queue``)."""

    def __init__(self, max_queue: int, n_lanes: int = 1) -> None:
        self.max_queue = max_queue  # requests that may wait while every lane is busy
        self.n_lanes = n_lanes
        self.waiting = 0  # requests queued now
        self.running = 0  # lanes held now (0 .. n_lanes)
        # A semaphore, not a lock: a streamed response frees its lane from the SSE task, not the
        # request's task, and anyio's Lock refuses a release by a task that does not own it.
        self._lanes = anyio.Semaphore(n_lanes)
        self._order = anyio.Semaphore(1)  # held while waiting for lanes: requests take them in arrival order
        self._mean_s = 1.0  # moving mean of a request's seconds holding a lane
        self._t0: dict[int, float] = {}  # when each ticket's hold began
        self._tickets = itertools.count()

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by one (at least 1)."""
        return max(1, math.ceil(self._mean_s * (self.waiting + 1) / max(self.max_queue, 1) / self.n_lanes))

    def _check_queue(self) -> None:
        if self._lanes.value == 0 and self.waiting >= self.max_queue:
            raise APIError(429, f"the server is busy: {self.waiting} requests are already waiting for the model; "
                                "retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after())})

    async def enter(self) -> int:
        """Wait for a lane; raise a 429 ``APIError`` when the queue is full. A ticket for ``leave``."""
        self._check_queue()
        self.waiting += 1
        try:
            async with self._order:  # first come, first served, whole-model holders included
                await self._lanes.acquire()
        finally:
            self.waiting -= 1
        return self._held(1)

    async def enter_all(self) -> int:
        """Wait until this request holds every lane (the whole model); 429 when the queue is full."""
        self._check_queue()
        self.waiting += 1
        got = 0
        try:
            async with self._order:
                for got in range(1, self.n_lanes + 1):  # noqa: B007 - got counts what to give back on a cancel
                    await self._lanes.acquire()
        except BaseException:
            for _ in range(got - 1):
                self._lanes.release()
            raise
        finally:
            self.waiting -= 1
        return self._held(self.n_lanes)

    def _held(self, n: int) -> int:
        self.running += n
        ticket = next(self._tickets)
        self._t0[ticket] = time.monotonic()
        return ticket

    def leave(self, ticket: int, n: int = 1) -> None:
        """Give the lane(s) back (exactly once per successful ``enter`` / ``enter_all``, with its ``n``)."""
        t0 = self._t0.pop(ticket, time.monotonic())
        self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - t0)
        self.running -= n
        for _ in range(n):
            self._lanes.release()
