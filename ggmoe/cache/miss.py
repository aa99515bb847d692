"""What to do with an expert that is not on the device when its layer runs: wait for a copy, or the CPU.

- ``wait``: copy it now (demand priority) and wait: what llama.cpp's own expert cache does;
- ``cpu``: compute it on the CPU from the host tensor (the host path) and queue an admission copy at low
  priority so that a later token finds it; a copy still in flight is not waited for either;
- ``auto``: whichever the cost model says is sooner: the copy's remaining time (or a new copy's whole
  time) against the CPU's time for that expert.

The host path exists only for micro-batches of at most ``HOST_MAX_TOKENS`` tokens (the patch's
``LLAMA_GGMOE_HOST_MAX_TOKENS``); larger ones wait, whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggmoe.errors import UsageError

MISS_POLICIES = ("wait", "cpu", "auto")
HOST_MAX_TOKENS = 16  # tokens; mirrors LLAMA_GGMOE_HOST_MAX_TOKENS of patch 0004
SLOT_HOST = -1  # the route callback's answer "computed by the CPU" (LLAMA_GGMOE_SLOT_HOST)


def check_miss_policy(name: str) -> str:
    if name not in MISS_POLICIES:
        raise UsageError(f"unknown miss policy {name!r}; choose one of {', '.join(MISS_POLICIES)}")
    return name


@dataclass(frozen=True)
class MissCosts:
    """The machine's cost model for one expert of ``nbytes`` bytes (seconds); measured or from a profile."""

    copy_bytes_per_s: float  # host-to-device copy bandwidth (bytes/s)
    copy_latency_s: float  # fixed cost of one expert copy (s)
    cpu_bytes_per_s: float  # bytes of expert weights the CPU multiplies per second (memory-bound matvec)
    cpu_latency_s: float = 0.0  # fixed cost of one expert on the CPU (s)

    def copy_s(self, nbytes: int) -> float:
        return self.copy_latency_s + nbytes / self.copy_bytes_per_s

    def cpu_s(self, nbytes: int) -> float:
        return self.cpu_latency_s + nbytes / self.cpu_bytes_per_s


def prefer_host(policy: str, costs: MissCosts | None, nbytes: int, copy_left_s: float | None) -> bool:
    """Whether a missing expert goes to the CPU. ``copy_left_s``: remaining time of a copy in flight, or None."""
    if policy == "wait":
        return False
    if policy == "cpu" or costs is None:
        return True
    wait_s = copy_left_s if copy_left_s is not None else costs.copy_s(nbytes)
    return costs.cpu_s(nbytes) < wait_s
