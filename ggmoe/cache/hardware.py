"""Hardware profiles: what a copy, a GPU expert and a CPU expert cost on a machine (seconds).

A profile is a small TOML file (``ggmoe/cache/profiles/*.toml`` ship ``pcie4``,
the default, ``h100``, ``h200`` and ``egpu``, each figure with its source in a comment).
The simulator charges its timeline with them; the ``auto`` miss policy can take
its cost model from one (``MissCosts``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ggmoe.base.errors import UsageError
from ggmoe.base.tomlfile import read_toml
from ggmoe.cache.miss import MissCosts

PROFILES_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "pcie4"
MAX_PROFILE_BYTES = 1 << 20
COPIES_PER_EXPERT = 3  # an expert's copy is one copy per tensor kind: up, gate, down


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    copy_bytes_per_s: float  # host-to-device copy bandwidth, pinned memory (bytes/s)
    copy_latency_s: float  # fixed cost of one copy (s)
    gpu_bytes_per_s: float  # expert weights a GPU matvec reads per second (bytes/s)
    gpu_launch_s: float  # fixed cost of one expert's kernels on the GPU (s)
    gpu_layer_s: float  # a layer's attention and router at batch 1 (s)
    cpu_bytes_per_s: float  # expert weights a CPU matvec reads per second (bytes/s)
    cpu_latency_s: float  # fixed cost of one expert on the CPU (s)
    hook_s: float  # the route callback's fixed cost per MoE layer (s)
    # bytes/s the GPU's SMs read from pinned host memory (the async decode's misses); None: the copy rate
    zero_copy_bytes_per_s: float | None = None
    # the disk under the host tier (a model larger than --host-ram): what expert reads from the file reach
    # (bytes/s) and the fixed cost of a read on an idle disk (s); None: no disk given (load_profile and
    # compose_profile give the default disk, ggmoe.cache.parts.DEFAULT_DISK)
    disk_bytes_per_s: float | None = None
    disk_latency_s: float | None = None
    # expert bytes a CPU matvec reads per second for one ggml type, where that type was measured ((type,
    # bytes/s) pairs, the profile's [cpu.types]); a type without one takes cpu_bytes_per_s
    cpu_type_bytes_per_s: tuple[tuple[str, float], ...] = ()

    def cpu_rate(self, ggml_type: str) -> float:
        """Bytes/s a CPU matvec reads of experts of ``ggml_type`` (gguf's name, e.g. ``Q4_K``)."""
        return dict(self.cpu_type_bytes_per_s).get(ggml_type, self.cpu_bytes_per_s)

    def for_expert_types(self, bytes_by_type: Mapping[str, int]) -> HardwareProfile:
        """The profile with the CPU's rate for experts of this mix of ggml types (bytes of one expert per type,
        e.g. Q4_K gate and up, Q5_0 down): each type's bytes at its own rate, the types the profile has no figure
        for at ``cpu_bytes_per_s``."""
        total = sum(bytes_by_type.values())
        if not self.cpu_type_bytes_per_s or total <= 0:
            return self
        seconds = sum(nb / self.cpu_rate(t) for t, nb in bytes_by_type.items())
        return dataclasses.replace(self, cpu_bytes_per_s=total / seconds)

    def copy_s(self, nbytes: int, n_copies: int = 1) -> float:
        """Seconds to copy ``nbytes`` of one expert issued as ``n_copies`` copies (one per tensor kind)."""
        return n_copies * self.copy_latency_s + nbytes / self.copy_bytes_per_s

    def zero_copy_s(self, nbytes: int) -> float:
        """Seconds for the GPU to read ``nbytes`` of expert weights from pinned host memory (no copy)."""
        return nbytes / (self.zero_copy_bytes_per_s or self.copy_bytes_per_s)

    def disk_read_s(self, nbytes: int) -> float:
        """Seconds for the disk to read ``nbytes`` of one expert when idle: its reads (one per tensor kind) are in
        flight together, so the latency counts once."""
        if self.disk_bytes_per_s is None:
            raise UsageError(f"hardware profile {self.name!r} has no disk")
        return (self.disk_latency_s or 0.0) + nbytes / self.disk_bytes_per_s

    def gpu_expert_s(self, nbytes: int) -> float:
        return self.gpu_launch_s + nbytes / self.gpu_bytes_per_s

    def cpu_expert_s(self, nbytes: int) -> float:
        return self.cpu_latency_s + nbytes / self.cpu_bytes_per_s

    def miss_costs(self, n_copies: int = COPIES_PER_EXPERT) -> MissCosts:
        """The profile as the ``auto`` miss policy's cost model: an expert is ``n_copies`` copies (one per
        tensor kind), each paying the per-copy latency, as the link charges them; a layer whose experts the CPU
        computes beside the link pays one graph split with a device sync (``hook_s``); the GPU computes a copied
        expert at its matvec rate, and reads one in place at its zero-copy rate."""
        return MissCosts(copy_bytes_per_s=self.copy_bytes_per_s, copy_latency_s=n_copies * self.copy_latency_s,
                         cpu_bytes_per_s=self.cpu_bytes_per_s, cpu_latency_s=self.cpu_latency_s,
                         host_split_s=self.hook_s, gpu_bytes_per_s=self.gpu_bytes_per_s,
                         gpu_latency_s=self.gpu_launch_s, zero_copy_bytes_per_s=self.zero_copy_bytes_per_s)


_FIELDS = {  # attribute -> (table, key, smallest allowed value)
    "copy_bytes_per_s": ("copy", "bytes_per_s", 1e3), "copy_latency_s": ("copy", "latency_s", 0.0),
    "gpu_bytes_per_s": ("gpu", "bytes_per_s", 1e3), "gpu_launch_s": ("gpu", "launch_s", 0.0),
    "gpu_layer_s": ("gpu", "layer_s", 0.0), "cpu_bytes_per_s": ("cpu", "bytes_per_s", 1e3),
    "cpu_latency_s": ("cpu", "latency_s", 0.0), "hook_s": ("hook", "fixed_s", 0.0),
}


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def compose_profile(spec: str, parts_file: Path | None = None) -> tuple[HardwareProfile, dict[str, str]]:
    """``GPU/LINK/HOST[/DISK]`` (``ggmoe.cache.parts``; no DISK: ``DEFAULT_DISK``) as a profile, and the source of
    every figure."""
    from ggmoe.cache import parts as P

    names = spec.split("/")
    if len(names) not in (3, 4) or not all(names):
        raise UsageError(f"hardware {spec!r}: compose it as GPU/LINK/HOST or GPU/LINK/HOST/DISK, e.g. "
                         "rtx4090/pcie4x16/ddr5-5600x2/nvme4")
    table = P.load_parts(parts_file or P.PARTS_FILE)
    gpu, slot, host = P.part(table, "gpu", names[0]), P.part(table, "link", names[1]), P.part(table, "host", names[2])
    disk = P.part(table, "disk", names[3] if len(names) == 4 else P.DEFAULT_DISK)
    link = P.effective_link(gpu, slot)
    scale = 1008.0e9 / gpu.memory_bytes_per_s
    profile = HardwareProfile(
        name=spec, description=f"{gpu.name} on {link.name} (slot {slot.name}), host {host.name}: composed from "
                               "public specifications (estimates)",
        copy_bytes_per_s=link.bytes_per_s, copy_latency_s=link.latency_s,
        gpu_bytes_per_s=P.GPU_SHARE * gpu.memory_bytes_per_s, gpu_launch_s=P.GPU_LAUNCH_S,
        gpu_layer_s=P.LAYER_S_AT_4090 * scale, cpu_bytes_per_s=P.CPU_SHARE * host.memory_bytes_per_s,
        cpu_latency_s=P.CPU_LATENCY_S, hook_s=P.HOOK_S, disk_bytes_per_s=disk.expert_bytes_per_s,
        disk_latency_s=disk.latency_s)
    sources = {"copy_bytes_per_s": link.source, "copy_latency_s": f"{link.name}: {link.latency_s * 1e6:g} us "
               "per copy (ggmoe/cache/parts.py)",
               "gpu_bytes_per_s": f"{gpu.source}; x {P.GPU_SHARE} for a memory-bound matvec",
               "gpu_launch_s": "the pcie4 profile's kernel launch", "gpu_layer_s": "the pcie4 profile's 60 us on "
               f"an RTX 4090 x 1008 GB/s / {gpu.name}'s {gpu.memory_bytes_per_s / 1e9:g} GB/s",
               "cpu_bytes_per_s": f"{host.source}; x {P.CPU_SHARE} for a quantized matvec",
               "cpu_latency_s": "none: llama.cpp computes a layer's CPU experts in one op; calibrated on an H100 it "
               "is a bandwidth alone (h100 profile)", "hook_s": "calibrated on an H100 (h100 profile)",
               **_disk_sources(disk)}
    return profile, sources


def _disk_sources(disk: object) -> dict[str, str]:
    """The sources of a disk part's two figures."""
    from ggmoe.cache import parts as P

    return {"disk_bytes_per_s": f"{disk.name}: {disk.source}; sequential read x {P.DISK_SHARE} for expert reads",
            "disk_latency_s": f"{disk.name}: one 4 KiB read at QD1 ({disk.latency_s * 1e6:g} us)"}


def default_disk() -> tuple[float, float]:
    """(bytes/s, latency s) of ``DEFAULT_DISK``: the disk of a profile file with no [disk] table."""
    from ggmoe.cache import parts as P

    disk = P.part(P.load_parts(), "disk", P.DEFAULT_DISK)
    return disk.expert_bytes_per_s, disk.latency_s


def gpu_vram(name: str) -> int:
    """Bytes of VRAM of a GPU of the parts file (UsageError naming the known ones otherwise)."""
    from ggmoe.cache import parts as P

    return P.part(P.load_parts(), "gpu", name).vram_bytes


def load_profile(spec: str | Path = DEFAULT_PROFILE) -> HardwareProfile:
    """A built-in profile by name, ``GPU/LINK/HOST`` composed from parts (``ggmoe.cache.parts``), or a profile
    TOML file; UsageError with one clear line otherwise."""
    if isinstance(spec, str) and "/" in spec and not spec.endswith(".toml") and not Path(spec).is_file():
        return compose_profile(spec)[0]
    path = Path(spec)
    if not path.suffix and str(spec) in profile_names():
        path = PROFILES_DIR / f"{spec}.toml"
    if not path.is_file():
        raise UsageError(f"unknown hardware profile {str(spec)!r}: give one of {', '.join(profile_names())}, "
                         "GPU/LINK/HOST[/DISK] (e.g. rtx4090/pcie4x16/ddr5-5600x2/nvme4) or a profile .toml file")
    data = read_toml(path, str(path), "profile", MAX_PROFILE_BYTES)
    values: dict[str, float] = {}
    for attr, (table, key, low) in _FIELDS.items():
        section = data.get(table)
        v = section.get(key) if isinstance(section, dict) else None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < low:
            raise UsageError(f"{path}: [{table}] {key} must be a finite number >= {low:g}, not {v!r:.40}")
        values[attr] = float(v)
    zc = data["copy"].get("zero_copy_bytes_per_s")  # optional: older profiles lack it
    if zc is not None:
        if isinstance(zc, bool) or not isinstance(zc, int | float) or not math.isfinite(zc) or zc < 1e3:
            raise UsageError(f"{path}: [copy] zero_copy_bytes_per_s must be a finite number >= 1000, not {zc!r:.40}")
        values["zero_copy_bytes_per_s"] = float(zc)
    values["disk_bytes_per_s"], values["disk_latency_s"] = _disk_table(path, data.get("disk"))
    name, desc = data.get("name", path.stem), data.get("description", "")
    if not isinstance(name, str) or not isinstance(desc, str):
        raise UsageError(f"{path}: name and description must be strings")
    return HardwareProfile(name=name, description=desc, cpu_type_bytes_per_s=_cpu_types(path, data["cpu"]),
                           **values)


def _cpu_types(path: Path, cpu: dict) -> tuple[tuple[str, float], ...]:
    """A profile file's optional [cpu.types]: bytes/s per ggml type name, each a known type and a finite rate."""
    from gguf import GGMLQuantizationType

    table = cpu.get("types", {})
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [cpu.types] must be a table")
    out = []
    for name, v in sorted(table.items()):
        if name not in GGMLQuantizationType.__members__:
            raise UsageError(f"{path}: [cpu.types] {name!r} is not a ggml type (e.g. Q4_K, Q8_0, MXFP4)")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 1e3:
            raise UsageError(f"{path}: [cpu.types] {name} must be a finite number >= 1000, not {v!r:.40}")
        out.append((name, float(v)))
    return tuple(out)


def _disk_table(path: Path, table: object) -> tuple[float, float]:
    """A profile file's optional [disk] (bytes_per_s, latency_s); the default disk's figures without one."""
    if table is None:
        return default_disk()
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [disk] must be a table")
    out = []
    for key, low in (("bytes_per_s", 1e3), ("latency_s", 0.0)):
        v = table.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < low:
            raise UsageError(f"{path}: [disk] {key} must be a finite number >= {low:g}, not {v!r:.40}")
        out.append(float(v))
    return out[0], out[1]


def _toml_float(v: float) -> str:
    return f"{v:.6g}" if ("e" in f"{v:.6g}" or "." in f"{v:.6g}") else f"{v:.6g}.0"


def render_profile(profile: HardwareProfile, sources: dict[str, str]) -> str:
    """``profile`` as a TOML file ``load_profile`` reads, each figure with its source in a comment above it."""
    lines = [f"name = {_toml_str(profile.name)}", f"description = {_toml_str(profile.description)}"]
    table = None
    for attr, (tbl, key, _) in _FIELDS.items():
        if tbl != table:
            lines += ["", f"[{tbl}]"]
            table = tbl
        lines.append(f"# {_comment(sources.get(attr, 'not stated'))}")
        lines.append(f"{key} = {_toml_float(getattr(profile, attr))}")
        if attr == "copy_latency_s" and profile.zero_copy_bytes_per_s is not None:
            lines.append(f"# {_comment(sources.get('zero_copy_bytes_per_s', 'not stated'))}")
            lines.append(f"zero_copy_bytes_per_s = {_toml_float(profile.zero_copy_bytes_per_s)}")
    if profile.cpu_type_bytes_per_s:
        lines += ["", "[cpu.types]", f"# {_comment(sources.get('cpu_type_bytes_per_s', 'not stated'))}"]
        lines += [f"{t} = {_toml_float(v)}" for t, v in profile.cpu_type_bytes_per_s]
    if profile.disk_bytes_per_s is not None:
        lines += ["", "[disk]", f"# {_comment(sources.get('disk_bytes_per_s', 'not stated'))}",
                  f"bytes_per_s = {_toml_float(profile.disk_bytes_per_s)}",
                  f"# {_comment(sources.get('disk_latency_s', 'not stated'))}",
                  f"latency_s = {_toml_float(profile.disk_latency_s or 0.0)}"]
    return "\n".join(lines) + "\n"


def _comment(s: str) -> str:
    """One comment line: control characters (newlines included) become spaces."""
    return "".join(c if c.isprintable() else " " for c in s)


def _toml_str(s: str) -> str:
    """A TOML basic string (quotes, backslashes and control characters escaped)."""
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    out = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'
