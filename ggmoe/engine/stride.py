"""Stride prefetching on the async decode: the mailbox's reader, a host thread beside ``llama_decode``.

Engine layer. ``begin_token`` (before a one-token table-mode decode) clears the mailbox and wakes the
thread; while the device computes (ctypes has released the GIL), the thread polls each MoE layer's count in
order and, as each layer starts, tells the cache what the layer reads (``ExpertCache.seen_start``: what was
readable then came from slots) and hands the prefetcher the layer's ids and input rows
(``Prefetcher.observe_layer``), which predicts ``stride`` layers ahead and puts copies into free slots on the
copy stream; each copy's table entries flip to its slot on the stream right after it. ``end_token``
(after the logits were read: every layer has written) waits until the thread has handled every layer, so the
controller between tokens never runs beside it. Nothing on the decode path waits for this thread, and no
Python runs inside the graph.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ggmoe.base.hook import RouteEvent
from ggmoe.cache.cache import ExpertCache
from ggmoe.control.prefetch import Prefetcher
from ggmoe.engine.mailbox import Mailbox

POLL_S = 20e-6  # s between looks at a count not yet written (a sleep: the decode's threads keep the cores)


class StrideReader:
    """The mailbox's reader thread (see the module's doc)."""

    def __init__(self, mailbox: Mailbox, prefetcher: Prefetcher, cache: ExpertCache, layers: Sequence[int],
                 poll_s: float = POLL_S) -> None:
        self.mailbox = mailbox
        self.prefetcher = prefetcher
        self.cache = cache
        self.layers = tuple(layers)
        self.poll_s = poll_s
        self.with_hidden = prefetcher.predictor.needs_hidden
        self.error: BaseException | None = None
        self.tokens = 0  # tokens read
        self.layer_reads = 0  # layers read while their decode ran (the rest after it returned)
        # layers read only after the layer they predict had started (the device ran ahead of this thread): their
        # predictions issue nothing, since a prefetch would land after the read it was for
        self.layers_behind = 0
        self.layers_targeted = 0  # layers read that predict a later layer (the share behind is of these)
        self._go = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._decode_done = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ggmoe-stride", daemon=True)
        self._thread.start()

    def begin_token(self) -> None:
        """Before a one-token table-mode decode (the previous one has been ended)."""
        self.mailbox.clear()
        self.mailbox.hold()
        self._decode_done = False
        self._idle.clear()
        self._go.set()

    def end_token(self) -> None:
        """After the decode's logits were read: wait until the thread has read every layer."""
        self._decode_done = True
        self._idle.wait()

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            try:
                self._read_token()
            except BaseException as e:  # noqa: BLE001 - raised by the decode that ends this token
                self.error = self.error or e
            finally:
                self.mailbox.release_all()  # lockstep: no layer may wait for a reader that stopped
                self._idle.set()

    def _read_token(self) -> None:
        self.tokens += 1
        mb, pf = self.mailbox, self.prefetcher
        for il in self.layers:
            n, hidden = mb.written(il)
            while not n and not self._decode_done:
                time.sleep(self.poll_s)
                n, hidden = mb.written(il)
            if not n:
                n, hidden = mb.written(il)  # the decode ended: every layer it computed has written
                if not n:
                    continue
            elif not self._decode_done:
                self.layer_reads += 1
            ids, rows = mb.read(il, n, hidden and self.with_hidden)
            try:
                self.cache.seen_start(il, ids.ravel().tolist())
                behind = self._target_started(il)
                self.layers_behind += behind
                pf.observe_layer(RouteEvent(il=il, ids=ids, probs=None, hidden=rows), prefetch=not behind)
            finally:
                mb.acknowledge(il)  # lockstep: the layer's matmuls may run

    def _target_started(self, il: int) -> bool:
        """Whether the layer that layer ``il`` predicts has already started (or the decode has ended)."""
        target = self.prefetcher.target(il)
        if target is None:
            return False
        self.layers_targeted += 1
        return self._decode_done or self.mailbox.written(target)[0] > 0

    def close(self) -> None:
        """Stop the thread (between tokens)."""
        self._stop = True
        self._go.set()
        self._thread.join(timeout=5)
