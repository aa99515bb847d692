"""Where the host path's CPU part runs: in the main graph after the device part, or on a worker beside it.

Patch 0015 (``llama_ggmoe_set_host_threads``) can compute each layer's host part (the experts the route
callback sends to the CPU) on a worker thread with its own threadpool, started right after the route op and
joined where the two parts are added. The device part (the cached experts) runs meanwhile: on a GPU, its
kernels; on the CPU build, the main graph's threads. The logits are the same either way.

``--host-threads`` (``DecodeConfig.host_threads``) or ``GGMOE_HOST_THREADS`` sets the worker's threads (0: the host
part stays in the main graph). Unset, a GPU build
gets a worker with the context's threads and the CPU build none: there the "device" is the same cores, so
running the two parts side by side only adds a hand-off per layer (docs/benchmarks.md, "The host path").
``GGMOE_HOST_ORDER`` forces an interleaving, for tests: 1 the device part first, 2 the host part first.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ggmoe.base.errors import UsageError
from ggmoe.engine import patch as _patched

HOST_THREADS_ENV = "GGMOE_HOST_THREADS"
HOST_ORDER_ENV = "GGMOE_HOST_ORDER"
ORDERS = {"0": 0, "free": 0, "1": 1, "device-first": 1, "2": 2, "host-first": 2}


@dataclass(frozen=True)
class HostPartStats:
    """The worker's counters since it started (all 0 without one)."""

    jobs: int  # layer host parts the worker computed
    skipped: int  # micro-batches of a layer that sent no expert to the CPU (nothing handed over)
    after_device: int  # jobs that started after their layer's device part had finished
    before_device: int  # jobs that finished before their layer's device part started


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r}: give a whole number of threads (0: the host part in the main graph)") from None
    if value < 0:
        raise UsageError(f"{name}={raw!r}: the number of threads cannot be negative")
    return value


def host_threads(n_threads: int, on_gpu: bool, asked: int | None = None) -> tuple[int, int]:
    """(worker threads, order) for a context computing with ``n_threads``: ``asked`` (``--host-threads``) when
    given, else the environment's, else the build's default."""
    threads = asked if asked is not None else _env_int(HOST_THREADS_ENV, n_threads if on_gpu else 0)
    raw = os.environ.get(HOST_ORDER_ENV, "").strip().lower() or "0"
    if raw not in ORDERS:
        raise UsageError(f"{HOST_ORDER_ENV}={raw!r}: one of free, device-first, host-first (or 0, 1, 2)")
    return threads, ORDERS[raw]


def set_host_threads(ctx_ptr: int, threads: int, order: int) -> None:
    """Start (threads > 0) or stop the context's host-part worker."""
    rc = _patched.symbols().llama_ggmoe_set_host_threads(ctx_ptr, threads, order)
    if rc != _patched.LLAMA_GGMOE_OK:
        raise UsageError(f"the host path's worker with {threads} threads was refused "
                         f"({_patched.ERROR_NAMES.get(rc, rc)})")


def host_part_stats(ctx_ptr: int) -> HostPartStats:
    """The context's worker counters."""
    out = (ctypes.c_int64 * 4)()
    _patched.symbols().llama_ggmoe_get_host_stats(ctx_ptr, out)
    return HostPartStats(*(int(v) for v in out))
