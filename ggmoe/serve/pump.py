"""A lane's generation in its own thread, its items queued, so it never waits for its client."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

_END = object()


class Pump:
    """An iterator run in its own thread, its items queued: a lane's generation never waits for its client.
    ``close`` sets ``cancel`` (the generation stops at its next token) and waits for the thread."""

    def __init__(self, items: Iterator[Any], cancel: threading.Event) -> None:
        self._items = items
        self._cancel = cancel
        self._queue: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self._ended = False
        self._thread = threading.Thread(target=self._produce, name="ggmoe-lane-stream", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for item in self._items:
                self._queue.put((item, None))
            self._queue.put((_END, None))
        except BaseException as e:  # noqa: BLE001 - raised to the consumer by __next__
            self._queue.put((_END, e))

    def __iter__(self) -> Pump:
        return self

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        item, err = self._queue.get()
        if item is _END:
            self._ended = True
            if err is not None:
                raise err
            raise StopIteration
        return item

    def close(self) -> None:
        self._cancel.set()
        self._thread.join()
