"""Where the host path's CPU part runs: in the main graph after the device part, or on a worker beside it.

Patch 0015 (``llama_ggmoe_set_host_threads``) can compute each layer's host part (the experts the route
callback sends to the CPU) on a worker thread with its own threadpool, started right after the route op and
joined where the two parts are added. The device part (the cached experts) runs meanwhile: on a GPU, its
kernels; on the CPU build, the main graph's threads. The logits are the same either way.

``--host-threads`` (``DecodeConfig.host_threads``) or ``GGMOE_HOST_THREADS`` sets the worker's threads (0: the host
part stays in the main graph). Unset, a GPU build
gets a worker with the context's threads and the CPU build none: there the "device" is the same cores, so
a worker only takes cores from the main graph (docs/engine.md, "The host part beside the device part").
``GGMOE_HOST_ORDER`` forces an interleaving, for tests: 1 the device part first, 2 the host part first.

The hand-off (patch 0018, ``llama_ggmoe_set_host_spin``): the worker waits for its next job, and the join for the
job, spinning for ``HOST_SPIN_US`` before they sleep, where the spinning threads have cores of their own
(``host_spin_us``); otherwise they sleep at once, since a spinning thread beside a team on every core takes a core
the team waits for. ``GGMOE_HOST_SPIN_US`` sets it (0: sleep at once).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ggmoe.base.errors import UsageError
from ggmoe.engine import patch as _patched

HOST_THREADS_ENV = "GGMOE_HOST_THREADS"
HOST_ORDER_ENV = "GGMOE_HOST_ORDER"
HOST_SPIN_ENV = "GGMOE_HOST_SPIN_US"
# µs a waiting side of the hand-off spins before it sleeps: a layer's host part comes a layer's device work after
# the last one (tens of µs on the CPU build, hundreds on a GPU); asleep, the two wake-ups cost about 50 µs a layer
# on the development VM (docs/benchmarks.md, "The host part's hand-off")
HOST_SPIN_US = 250
HOST_SPIN_MAX_US = 100_000  # the patch's bound
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


def host_spin_us(n_threads: int, threads: int, on_gpu: bool, cores: int | None = None) -> int:
    """µs the hand-off spins before sleeping, for a worker of ``threads`` beside a context computing with
    ``n_threads`` on ``cores`` (default: this machine's): ``GGMOE_HOST_SPIN_US`` when set, else ``HOST_SPIN_US``
    where the spinning threads have cores of their own, else 0 (sleep at once). Beside the worker the main graph
    runs the device part on its ``n_threads`` on the CPU build, and one thread on a GPU build (its CPU ops in a
    layer are one task each, the start and the join); the GPU build's default worker takes every core, so its
    hand-off sleeps unless ``--host-threads`` leaves the main thread a core."""
    raw = os.environ.get(HOST_SPIN_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise UsageError(f"{HOST_SPIN_ENV}={raw!r}: give whole microseconds (0: sleep at once)") from None
        if not 0 <= value <= HOST_SPIN_MAX_US:
            raise UsageError(f"{HOST_SPIN_ENV}={raw!r}: from 0 to {HOST_SPIN_MAX_US} microseconds")
        return value
    cores = cores if cores is not None else os.cpu_count() or 1
    return HOST_SPIN_US if threads > 0 and _beside_hand_off(n_threads, threads, on_gpu) <= cores else 0


def _beside_hand_off(n_threads: int, threads: int, on_gpu: bool) -> int:
    """Threads that compute while the hand-off waits: the main graph's (one on a GPU build) and the worker's."""
    return (1 if on_gpu else n_threads) + threads


def host_spin_note(n_threads: int, threads: int, on_gpu: bool, asked: int | None, spin_us: int,
                   cores: int | None = None) -> str | None:
    """One line where the user's ``--host-threads`` (``asked``) leaves the hand-off asleep at every layer because the
    threads outnumber the cores (``host_spin_us`` gave 0 without ``GGMOE_HOST_SPIN_US``); None otherwise."""
    if asked is None or not threads or spin_us or os.environ.get(HOST_SPIN_ENV, "").strip():
        return None
    cores = cores if cores is not None else os.cpu_count() or 1
    beside = "the main thread" if on_gpu else f"the context's {n_threads} threads"
    return (f"--host-threads {threads} beside {beside} on {cores} cores: the worker's hand-off sleeps at every layer "
            f"(it spins only where the threads fit the cores; here they need "
            f"{_beside_hand_off(n_threads, threads, on_gpu)}), which can cost more than the worker gains")


def set_host_threads(ctx_ptr: int, threads: int, order: int, spin_us: int = 0) -> None:
    """Start (threads > 0) or stop the context's host-part worker, whose hand-off spins ``spin_us`` before it
    sleeps."""
    P = _patched.symbols()
    rc = P.llama_ggmoe_set_host_spin(ctx_ptr, spin_us)
    if rc == _patched.LLAMA_GGMOE_OK:
        rc = P.llama_ggmoe_set_host_threads(ctx_ptr, threads, order)
    if rc != _patched.LLAMA_GGMOE_OK:
        raise UsageError(f"the host path's worker with {threads} threads was refused "
                         f"({_patched.ERROR_NAMES.get(rc, rc)})")


def host_part_stats(ctx_ptr: int) -> HostPartStats:
    """The context's worker counters."""
    out = (ctypes.c_int64 * 4)()
    _patched.symbols().llama_ggmoe_get_host_stats(ctx_ptr, out)
    return HostPartStats(*(int(v) for v in out))
