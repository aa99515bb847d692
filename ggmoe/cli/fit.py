"""``ggmoe serve MODEL --fit``: the cache ``ggmoe plan MODEL --gpu`` would choose, planned on this machine.

The plan is ``ggmoe.simulate.advise`` (the code of ``plan --gpu``) on a profile of this machine: the GPU's
memory bandwidth from its specification (the parts file, found by the name the driver reports), and in place
of specifications what can be read or measured here:

- the GPU's free VRAM and its PCIe link as negotiated (``nvidia-smi``: ``memory.free``, the link's generation
  and width), else the card's VRAM and own interface from the parts file;
- the host's memory: a streaming read of a large buffer over every thread (what ``measure_costs`` times for
  the ``auto`` miss policy), used as the CPU's expert rate.

Of the ways ``plan --gpu`` estimates, ``serve`` runs ggmoe's (the async decode, the sync decode with the host
path, or every expert cached); when one of llama.cpp's own is estimated faster it says so and prints the
llama-server command. On a machine without a GPU (the CPU build) there is nothing to plan: every expert
stays in host memory, said in one line. Every figure printed is an estimate, and says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ggmoe.base.errors import UsageError

if TYPE_CHECKING:
    from ggmoe.cli.options import CacheFlags
    from ggmoe.inspect import ModelFacts
    from ggmoe.simulate.advise import Advice, Way

CACHE_FLAGS = ("cache_slots", "vram", "config", "decode_mode", "miss_policy", "policy", "predictor")
READ_BYTES = 256 << 20  # bytes of the host-memory read (larger than any CPU's last-level cache)
NVIDIA_SMI_QUERY = "name,memory.total,memory.free,pcie.link.gen.max,pcie.link.width.current"


@dataclass(frozen=True)
class Machine:
    """This machine as the plan sees it; ``sources`` says where each figure came from."""

    gpu: str  # the GPU's name as the driver reports it
    part: str  # its entry in the parts file (rtx4090, ...)
    vram_bytes: int  # VRAM to plan with (bytes): free now, or the card's
    link: str  # pcie{gen}x{width} as negotiated, or the card's own interface
    cpu_bytes_per_s: float  # expert bytes the CPU reads per second, measured here
    sources: tuple[tuple[str, str], ...]  # (figure, where it came from)


def gpu_part(name: str, known: list[str]) -> str | None:
    """The parts-file entry of a GPU named as the driver names it ("NVIDIA GeForce RTX 4090" -> rtx4090,
    "NVIDIA RTX A6000" -> a6000); None for a GPU the file does not have (a Ti, a Super or a D of a card it has
    is another card)."""
    key = re.sub(r"[^a-z0-9]", "", name.lower()).replace("nvidia", "").replace("geforce", "")
    for part in sorted(known, key=len, reverse=True):
        base = part[:-2] if part.endswith("ti16") else part  # 16 GB variants: told apart by VRAM, not name
        for k in (key, key.removeprefix("rtx")):
            if k.startswith(base) and not k[len(base):].startswith(("ti", "super", "d")):
                return part
    return None


def parse_nvidia_smi(text: str) -> tuple[str, int, int, int | None, int | None] | None:
    """(name, total VRAM bytes, free VRAM bytes, link generation, link width) of the first GPU in
    ``nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits`` (None for a link field it does
    not report); None if no line parses."""
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) == 5 and f[1].isdigit() and f[2].isdigit():
            gen, width = (int(x) if x.isdigit() else None for x in f[3:])
            return f[0], int(f[1]) << 20, int(f[2]) << 20, gen, width
    return None


def read_nvidia_smi(run: Callable[..., Any] = subprocess.run) -> tuple | None:
    """What the driver says of the first GPU (``parse_nvidia_smi``); None without nvidia-smi."""
    try:
        r = run(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(r.stdout) if r.returncode == 0 else None


def measure_host_read(n_threads: int, nbytes: int = READ_BYTES) -> float:
    """Bytes/s of a streaming read of ``nbytes`` of host memory split over ``n_threads`` threads (numpy's
    sums run without the GIL): the median of 5 after a warm-up."""
    words = np.ones(nbytes // 8, dtype=np.uint64)
    parts = np.array_split(words, max(1, n_threads))
    times = []
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        for _ in range(6):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - t0)
    return words.nbytes / max(sorted(times[1:])[2], 1e-9)


def this_machine(gpu_name: str, hw: str | None, n_threads: int, smi: tuple | None = None,
                 host_read: Callable[[int], float] = measure_host_read) -> Machine:
    """The GPU's part (by its name, or the GPU of ``--hw GPU/LINK/HOST``), its free VRAM and negotiated link
    (nvidia-smi's answer ``smi``; else the parts file's), the CPU's rate measured here."""
    from ggmoe.cache.parts import effective_link, load_parts, part, pcie_link

    table = load_parts()
    if hw is not None:
        names = hw.split("/")
        if len(names) != 3:
            raise UsageError(f"--fit --hw {hw!r}: name this machine's parts as GPU/LINK/HOST, e.g. "
                             "rtx4090/pcie4x16/ddr5-5600x2 (the CPU is measured: HOST is not used)")
        g = part(table, "gpu", names[0])
        link = effective_link(g, part(table, "link", names[1]))
        sources = [("GPU", f"--hw {g.name}"), ("link", f"--hw {link.name}")]
    else:
        name = gpu_part(gpu_name, sorted(table["gpu"]))
        if name is None:
            raise UsageError(f"--fit: the GPU {gpu_name!r} is not in the parts file (known: "
                             f"{', '.join(sorted(table['gpu']))}); name the closest with --hw GPU/LINK/HOST, e.g. "
                             "--hw rtx4090/pcie4x16/ddr5-5600x2")
        g = table["gpu"][name]
        sources = [("GPU", f"{g.name} in the parts file ({g.memory_bytes_per_s / 1e9:g} GB/s)")]
        gen, width = (smi[3], smi[4]) if smi is not None else (None, None)
        if gen in (3, 4, 5) and width in (4, 8, 16):
            link = pcie_link(f"pcie{gen}x{width}")
            sources.append(("link", f"nvidia-smi: PCIe {gen}.0 x{width}"))
        else:
            link = pcie_link(g.interface)
            sources.append(("link", f"the card's own {link.name} (not reported by nvidia-smi)"))
    if smi is not None:
        vram = smi[2]
        sources.append(("VRAM", f"nvidia-smi: {vram / 2**30:.1f} GiB free of {smi[1] / 2**30:.1f} GiB"))
    else:
        vram = g.vram_bytes
        sources.append(("VRAM", f"the parts file's {vram / 2**30:.0f} GiB (no nvidia-smi)"))
    cpu = host_read(n_threads)
    sources.append(("CPU", f"measured {cpu / 1e9:.1f} GB/s reading host memory with {n_threads} threads"))
    return Machine(gpu=gpu_name, part=g.name, vram_bytes=vram, link=link.name, cpu_bytes_per_s=cpu,
                   sources=tuple(sources))


def plan_here(facts: ModelFacts, m: Machine) -> Advice:
    """``advise_profile`` on this machine's profile: the parts' figures, the CPU's measured rate."""
    from ggmoe.cache.hardware import compose_profile
    from ggmoe.simulate.advise import DEFAULT_HOST, advise_profile

    spec = f"{m.part}/{m.link}/{DEFAULT_HOST}"
    profile, _ = compose_profile(spec)
    profile = replace(profile, name=f"this machine ({m.gpu})", cpu_bytes_per_s=m.cpu_bytes_per_s,
                      description="ggmoe serve --fit: parts for the GPU and its link, the CPU measured here")
    return advise_profile(facts, profile, spec, m.link, m.vram_bytes, None, m.gpu)


RUNNABLE = ("ggmoe, async decode", "ggmoe, sync decode + host path", "all experts in VRAM")


def cache_flags(advice: Advice, facts: ModelFacts) -> tuple[dict[str, str | int], Way | None]:
    """The cache flags of the fastest way ``serve`` can run, and the way (None: no cache: every expert in
    host memory, as with no cache flag)."""
    ours = [w for w in advice.ways if w.name in RUNNABLE and w.decode_tok_s is not None]
    if not ours:
        return {}, None
    way = max(ours, key=lambda w: w.decode_tok_s)
    if way.name == "all experts in VRAM":
        return {"cache_slots": facts.n_expert, "decode_mode": "async", "miss_policy": "wait", "policy": "lru"}, way
    from ggmoe.simulate.advise import ADVISED_POLICY

    mode, miss = ("async", "wait") if way.name == "ggmoe, async decode" else ("sync", "auto")
    return {"vram": str(advice.expert_budget_bytes), "decode_mode": mode, "miss_policy": miss,
            "policy": ADVISED_POLICY}, way


def fit(facts: ModelFacts | None, cache: CacheFlags, threads: int | None, echo: Callable[[str], None],
        gpu_name: str | None, smi: tuple | None,
        host_read: Callable[[int], float] = measure_host_read) -> CacheFlags:
    """``serve --fit``: ``cache`` (the serve command's cache flags) with the plan's in place; ``echo`` says
    what was planned, every figure an estimate."""
    given = [f"--{k.replace('_', '-')}" for k in CACHE_FLAGS if getattr(cache, k) is not None]
    if given:
        raise UsageError(f"--fit chooses the cache: leave out {', '.join(given)} (or leave out --fit)")
    if gpu_name is None:
        echo("ggmoe serve --fit: no GPU on this machine (CPU build): every expert stays in host memory, "
             "there is no expert cache to plan")
        return replace(cache, hw=None)
    m = this_machine(gpu_name, cache.hw, threads or os.cpu_count() or 1, smi, host_read)
    facts = cast("ModelFacts", facts)  # None only where it returned above (cache flags refused, or no GPU)
    a = plan_here(facts, m)
    flags, way = cache_flags(a, facts)
    echo(f"ggmoe serve --fit: {m.gpu} ({m.part}, link {m.link}), {m.vram_bytes / 2**30:.1f} GiB VRAM: "
         f"{a.expert_budget_bytes / 2**30:.1f} GiB for experts; " + "; ".join(f"{k} {v}" for k, v in m.sources))
    for w in a.ways:
        dec = f"{w.decode_tok_s:.1f} tok/s decode (estimate)" if w.decode_tok_s else "does not fit"
        echo(f"  {w.name}: {dec}; {w.detail}")
    for n in a.notes:
        echo(f"  note: {n}")
    if way is None:
        echo("  serving without a cache (every expert in host memory): no ggmoe cache fits")
    else:
        echo(f"  serving: {way.name}, est. {way.decode_tok_s:.1f} tok/s decode ("
             + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()) + ")")
    best = a.choice
    if way is None or (best.name not in RUNNABLE and best.decode_tok_s > way.decode_tok_s):
        echo(f"  note: {best.name} is estimated faster ({best.decode_tok_s:.1f} tok/s): {best.run}")
    return replace(cache, **flags, hw=None)
