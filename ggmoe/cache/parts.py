"""Hardware profiles composed from parts: ``--hw GPU/LINK/HOST[/DISK]`` (e.g. ``rtx4090/pcie4x16/ddr5-5600x2/nvme4``).

The parts are public specifications (``profiles/parts/parts.toml``, each with its source): a GPU's memory
bandwidth, VRAM and own PCIe interface; a link (``pcie{3,4,5}x{4,8,16}`` from the PCI-SIG per-lane rates,
Thunderbolt tunnels from the parts file); a host's memory bandwidth; a disk's reads (the tier under the host
tier, ``DEFAULT_DISK`` when the spec names none). A specification becomes a cost
through one efficiency per resource, the same for every part (no per-machine factor):

================  =====  ==========================================================================
resource          share  source
================  =====  ==========================================================================
link (copies)     0.85   pinned host-to-device copies: 54.7 of PCIe 5.0 x16's 63.0 GB/s measured by
                         ``ggmoe calibrate`` on an H100 (0.87, docs/benchmarks.md); club-3090's
                         bench harness counts a gen4 x16 link's practical rate as raw x 0.85
                         (github.com/noonghunna/club-3090 issue 1127, checked)
GPU (expert read) 0.70   a memory-bound quantized matvec (the pcie4 profile's figure)
CPU (expert)      0.50   a quantized matvec streams about half the DRAM bandwidth on a desktop CPU
                         (the pcie4 profile's figure; read-only streaming of expert-sized blocks reaches
                         0.6 of dual-channel DDR5, github.com/kekzl/imp pull 2062); with no fixed cost per
                         expert (llama.cpp computes a layer's experts in one op; ``ggmoe calibrate`` on
                         an H100 finds a bandwidth alone, h100 profile), published -ot exps=CPU and --n-cpu-moe figures are
                         reproduced within 20 % (docs/simulator.md, ggmoe/simulate/fidelity.py)
disk (expert)     0.90   an expert is read as one large aligned read per tensor kind, several in flight:
                         sequential within each read. KitGuru's 128 KB sequential reads reached 3,402 of
                         a 970 EVO's rated 3,500 MB/s (0.97, kitguru.net/components/ssd-drives/simon-
                         crisp/samsung-970-evo-2tb-review/8); O_DIRECT reads of scattered extents keep
                         a margin below that (an estimate)
================  =====  ==========================================================================

The link a GPU gets is the slower of the slot and the card's own interface (an RTX 4060 Ti in a PCIe 5.0
x16 slot runs PCIe 4.0 x8). Times that are not bandwidths come from the shipped profiles: a copy's fixed
cost (10 us on PCIe, 15 us through Thunderbolt), an expert's kernel launch (5 us), none for a CPU expert,
the route op's device sync in the sync decode (57 us per MoE layer, measured on the H100), the attention and
router of a layer at batch 1 (the pcie4 profile's 60 us on an RTX 4090, scaled by memory bandwidth).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggmoe.base.errors import UsageError
from ggmoe.base.tomlfile import read_toml

PARTS_FILE = Path(__file__).with_name("profiles") / "parts" / "parts.toml"
COPY_SHARE = 0.85
GPU_SHARE = 0.70
CPU_SHARE = 0.50
DISK_SHARE = 0.90
DEFAULT_DISK = "nvme4"  # a PCIe 4.0 NVMe drive: the disk of a profile that names none
PCIE_LANE_BYTES_PER_S = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9}  # per lane and direction, after 128b/130b (PCI-SIG)
PCIE_LATENCY_S = 10.0e-6  # one copy's launch and DMA setup (the pcie4 profile)
GPU_LAUNCH_S = 5.0e-6  # an expert's kernels (the pcie4 profile)
HOOK_S = 57.0e-6  # the route op's graph split and device sync per MoE layer (measured, h100 profile)
# no fixed cost per CPU expert: llama.cpp computes a layer's experts in one op (calibrated on an H100, the h100 profile,
# it is a bandwidth alone)
CPU_LATENCY_S = 0.0
LAYER_S_AT_4090 = 60.0e-6  # a layer's attention and router at batch 1 on an RTX 4090 (the pcie4 profile)
_PCIE = re.compile(r"pcie([345])x(4|8|16)$")
_FIELDS = {  # kind -> (field, type, required)
    "gpu": (("memory_bytes_per_s", float, True), ("vram_bytes", int, True), ("interface", str, True),
            ("source", str, True)),
    "link": (("bytes_per_s", float, True), ("latency_s", float, True), ("source", str, True)),
    "host": (("memory_bytes_per_s", float, True), ("source", str, True)),
    "disk": (("read_bytes_per_s", float, True), ("random_4k_bytes_per_s", float, True), ("latency_s", float, True),
             ("source", str, True)),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes_per_s: float  # the specification's memory bandwidth (bytes/s)
    vram_bytes: int  # bytes
    interface: str  # the card's own PCIe link, e.g. "pcie4x8"
    source: str


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float  # host-to-device, what copies reach (bytes/s)
    latency_s: float  # fixed cost of one copy (s)
    source: str


@dataclass(frozen=True)
class Disk:
    name: str
    read_bytes_per_s: float  # the rated sequential read (bytes/s)
    random_4k_bytes_per_s: float  # rated 4 KiB random reads at QD32, IOPS x 4096 (bytes/s)
    latency_s: float  # one 4 KiB read at QD1 (s)
    source: str

    @property
    def expert_bytes_per_s(self) -> float:
        """What reading experts from the file reaches (bytes/s): the sequential rate x DISK_SHARE."""
        return DISK_SHARE * self.read_bytes_per_s


@dataclass(frozen=True)
class Host:
    name: str
    memory_bytes_per_s: float  # the specification's DRAM bandwidth (bytes/s)
    source: str


def _check(kind: str, name: str, entry: object, label: str) -> dict[str, Any]:
    """One part's fields, each present, of its type, finite and positive; UsageError naming the field."""
    if not isinstance(entry, dict):
        raise UsageError(f"{label}: [{kind}.{name}] must be a table")
    out = {}
    for field, typ, _ in _FIELDS[kind]:
        v = entry.get(field)
        where = f"{label}: [{kind}.{name}] {field}"
        if v is None:
            raise UsageError(f"{where} is missing")
        if typ is str:
            if not isinstance(v, str) or not v.strip():
                raise UsageError(f"{where} must be a non-empty string")
        elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise UsageError(f"{where} must be a finite number > 0, not {v!r:.40}")
        out[field] = typ(v)
    return out


def load_parts(path: Path = PARTS_FILE) -> dict[str, dict[str, Any]]:
    """kind -> name -> part, every entry checked (a parts file of one's own: the same format)."""
    data = read_toml(path, str(path), "parts file")
    parts: dict[str, dict[str, Any]] = {"gpu": {}, "link": {}, "host": {}, "disk": {}}
    cls = {"gpu": Gpu, "link": Link, "host": Host, "disk": Disk}
    for kind, table in data.items():
        if kind not in parts or not isinstance(table, dict):
            raise UsageError(f"{path}: unknown table [{kind}]; parts are [gpu.NAME], [link.NAME], [host.NAME], "
                             "[disk.NAME]")
        for name, entry in table.items():
            parts[kind][name] = cls[kind](name=name, **_check(kind, name, entry, str(path)))
    for g in parts["gpu"].values():
        pcie_link(g.interface, f"{path}: [gpu.{g.name}] interface")
    return parts


def pcie_link(name: str, what: str = "link") -> Link:
    """``pcie{3,4,5}x{4,8,16}``: lanes x the PCI-SIG per-lane rate x COPY_SHARE."""
    m = _PCIE.match(name)
    if m is None:
        raise UsageError(f"{what} {name!r}: expected pcie3, pcie4 or pcie5 with x4, x8 or x16 (e.g. pcie4x16)")
    gen, lanes = int(m.group(1)), int(m.group(2))
    return Link(name, COPY_SHARE * lanes * PCIE_LANE_BYTES_PER_S[gen], PCIE_LATENCY_S,
                f"PCIe {gen}.0 x{lanes}: {lanes} x {PCIE_LANE_BYTES_PER_S[gen] / 1e9:.3f} GB/s per lane and "
                f"direction (PCI-SIG, after 128b/130b encoding) x {COPY_SHARE}")


def part(parts: dict, kind: str, name: str) -> Any:
    """The part ``name`` of ``kind``; UsageError naming the known ones otherwise."""
    if kind == "link" and _PCIE.match(name):
        return pcie_link(name)
    if name not in parts[kind]:
        known = sorted(parts[kind]) + (["pcie{3,4,5}x{4,8,16}"] if kind == "link" else [])
        raise UsageError(f"unknown {kind.upper() if kind == 'gpu' else kind} {name!r}; known: {', '.join(known)}")
    return parts[kind][name]


def effective_link(gpu: Gpu, link: Link) -> Link:
    """The slower of the slot's link and the card's own interface."""
    own = pcie_link(gpu.interface)
    return own if own.bytes_per_s < link.bytes_per_s else link
