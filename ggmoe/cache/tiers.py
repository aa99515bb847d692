"""How a model's experts spread over three tiers: GPU slots, a pinned host tier and the GGUF file on disk.

The host tier has the same number of slots in every cached MoE layer, bought by a host budget
(``--host-ram``): ``host_slots = host_ram // (bytes of one expert, all its kinds, summed over the cached
layers)``, the same rule as ``--vram`` for the GPU's slots (``ggmoe.cache.slots_for_budget``). When the
budget holds every expert there is no disk tier: all experts sit in pinned host memory. Otherwise the
experts stay in the file, a miss in both the GPU tier and the host tier reads the expert from disk into a
host slot, and the link copies it onward. The engine, ``ggmoe inspect``, ``ggmoe plan`` and the simulator
all size the tiers here, so they agree on every figure.

With no budget given (``None``), the host tier takes what the machine can pin while leaving the OS a
margin: the available memory less max(HOST_MARGIN_BYTES, HOST_MARGIN_SHARE of the total).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggmoe.base.errors import UsageError
from ggmoe.base.units import format_bytes

if TYPE_CHECKING:
    from ggmoe.inspect.facts import ModelFacts

HOST_MARGIN_BYTES = 4 << 30  # the OS, the page cache of the disk reads' metadata and the process itself
HOST_MARGIN_SHARE = 0.10  # of the machine's total memory, when that is more than HOST_MARGIN_BYTES
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class TierConfig:
    """The host tier asked for: its budget, and whether the engine sizes the tiers itself."""

    # the host tier's budget in bytes (--host-ram): when it holds fewer than every expert, the experts stay in the
    # model file (the disk tier) and the host tier reads them from there; None: what the machine can pin, less a
    # margin (a model that fits keeps every expert in host memory, as without a tier)
    host_ram: int | None = None
    # no cache size was given and the experts exceed the host budget: the engine splits that budget between the
    # GPU tier and the host tier for the machine it runs on (``ggmoe.engine.loader.resolve_tiers``)
    auto_tiers: bool = False


@dataclass(frozen=True)
class TierSizes:
    """The three tiers of one model's routed experts under a GPU slot count and a host budget."""

    gpu_slots: int  # GPU slots per cached MoE layer
    host_slots: int  # host tier slots per cached MoE layer (n_expert when there is no disk tier)
    n_expert: int  # routed experts per MoE layer
    expert_bytes: int  # bytes of one expert of the largest cached layer, all its kinds (a disk read)
    slot_bytes: int  # bytes of one slot in every cached layer (what one more slot per layer costs)
    layers: int  # cached MoE layers
    host_ram: int  # the host budget the sizes come from (bytes; the auto value when none was given)

    @property
    def disk(self) -> bool:
        """Whether some experts live on disk only: the host tier holds fewer than every expert."""
        return self.host_slots < self.n_expert

    @property
    def disk_experts(self) -> int:
        """Experts per layer that cannot sit in the host tier at once (0 without a disk tier)."""
        return self.n_expert - self.host_slots

    @property
    def gpu_bytes(self) -> int:
        """Bytes of the GPU tier's slots, every layer."""
        return self.gpu_slots * self.slot_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tier's slots (pinned), every layer."""
        return self.host_slots * self.slot_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the experts that only the file holds at any one time, every layer."""
        return self.disk_experts * self.slot_bytes

    @property
    def model_bytes(self) -> int:
        """Bytes of every cached expert of every layer."""
        return self.n_expert * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form (the byte totals included)."""
        return {"gpu_slots": self.gpu_slots, "host_slots": self.host_slots, "n_expert": self.n_expert,
                "disk_experts": self.disk_experts, "layers": self.layers, "expert_bytes": self.expert_bytes,
                "slot_bytes": self.slot_bytes, "host_ram": self.host_ram, "disk": self.disk,
                "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "disk_bytes": self.disk_bytes}

    def render_lines(self) -> list[str]:
        """The three tiers, one line each, as ``inspect`` and ``plan`` print them."""
        n = self.n_expert
        disk = (f"{self.disk_experts}/{n} experts/layer only in the file ({format_bytes(self.disk_bytes)}); "
                "a miss in both tiers reads the expert from disk" if self.disk else
                "none: every expert fits the host tier")
        return [f"  gpu   {self.gpu_slots:>4}/{n} slots/layer  {format_bytes(self.gpu_bytes)}",
                f"  host  {self.host_slots:>4}/{n} slots/layer  {format_bytes(self.host_bytes)} pinned "
                f"(--host-ram {format_bytes(self.host_ram)})",
                f"  disk  {disk}"]


def tier_sizes(facts: ModelFacts, gpu_slots: int, host_ram: int | None) -> TierSizes:
    """The tiers of ``facts`` with ``gpu_slots`` per layer and ``host_ram`` bytes of host tier (None: auto).

    UsageError when the GPU slots are outside 0..n_expert, or when a disk tier's host budget gives fewer
    than n_expert_used slots per layer: a token's experts each pass through a host slot on their way up.
    """
    n = facts.n_expert
    if isinstance(gpu_slots, bool) or not isinstance(gpu_slots, int) or not 0 <= gpu_slots <= n:
        raise UsageError(f"GPU slots per layer must be an integer in 0..{n}, not {gpu_slots!r}")
    budget = auto_host_ram() if host_ram is None else host_ram
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise UsageError(f"--host-ram must be a number of bytes >= 0, not {budget!r}")
    slot = facts.expert_bytes_per_slot
    host = min(budget // slot, n) if slot else n
    if host < n and host < facts.n_expert_used:
        raise UsageError(f"--host-ram {format_bytes(budget)} gives {host} host slots per layer; a model on disk "
                         f"needs at least n_expert_used = {facts.n_expert_used} "
                         f"({format_bytes(facts.n_expert_used * slot)})")
    largest = max((layer.bytes_per_expert for layer in facts.layers), default=0)
    return TierSizes(gpu_slots=gpu_slots, host_slots=int(host), n_expert=n, expert_bytes=largest,
                     slot_bytes=slot, layers=len(facts.layers), host_ram=budget)


def auto_host_ram(meminfo: str | None = None) -> int:
    """What the machine can pin while leaving the OS a margin (bytes): MemAvailable less the margin.

    ``meminfo`` is /proc/meminfo's text (read when None); without it, sysconf's physical pages stand in
    for both the total and the available memory.
    """
    total, available = _memory(meminfo)
    return host_ram_for(total, available)


def host_ram_for(ram: int, available: int | None = None) -> int:
    """The host tier a machine with ``ram`` bytes of memory (``available`` of them free; None: all) gives the
    experts: the available memory less max(HOST_MARGIN_BYTES, HOST_MARGIN_SHARE of ``ram``). ``plan --ram``
    sizes the host tier of a machine it has not seen with it."""
    margin = max(HOST_MARGIN_BYTES, int(HOST_MARGIN_SHARE * ram))
    return max(0, (ram if available is None else available) - margin)


def _memory(meminfo: str | None) -> tuple[int, int]:
    """(total, available) bytes of memory."""
    if meminfo is None and MEMINFO.exists():
        meminfo = MEMINFO.read_text()
    fields: dict[str, int] = {}
    for line in (meminfo or "").splitlines():
        key, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            fields[key.strip()] = int(words[0]) * 1024  # /proc/meminfo counts kB (KiB)
    if "MemTotal" in fields:
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return total, total
