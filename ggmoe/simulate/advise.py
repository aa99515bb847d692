"""``ggmoe plan MODEL --gpu NAME``: what to run on a machine, from the GGUF header and a composed profile.

Reads the model's header only (``inspect_model``: no weights; split GGUFs too), composes the machine's
profile (``GPU/LINK/HOST``, ``ggmoe.cache.parts``), and estimates on the simulator, on the same routing and
cost model, the ways to run the model at the same VRAM:

- ggmoe: slots per layer under ``ADVISED_POLICY``, the async decode with in-graph fills (each miss copied
  into a fill slot inside its layer and read there: one crossing of the link, no admission after) or the sync
  decode with the host path (``--miss-policy auto``); no predictor (those that pay here learn from the
  model's own traces: ``ggmoe plan --traces``);
- llama.cpp's own ``--moe-cache-mib`` (per-layer slots, LRU, misses copied and waited for, a device sync
  per layer), ``--n-cpu-moe`` (whole layers' experts in VRAM, the rest on the CPU), ``-ot exps=CPU``, and
  all experts in VRAM where they fit.

A model larger than the machine's RAM (``--ram``, or the host tier's own ``--host-ram``) runs on three tiers
(``ggmoe.cache.tiers``): GPU slots, a host tier of what the RAM holds after the OS's margin, and the GGUF file
on the profile's disk. ggmoe's ways then replay with the disk tier (``ggmoe.simulate.disk``); llama.cpp's
ways that read experts on the CPU read them through mmap, each page cache miss a synchronous fault
(``page_cache_reads``, ``fault_bytes_per_s``).

The routing replayed is the model's own when it is at hand (``ggmoe plan --traces``); here it is the real
routing sample shipped in ``ggmoe/data/routing-sample`` (DeepSeek-V2-Lite, deepseek-ai/ESFT, MIT) mapped to
the model's shape (``ggmoe.trace.remap``): one prompt of ``PREFILL_TOKENS`` tokens, then ``DECODE_TOKENS``
decoded. Every figure is an estimate, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.units import format_bytes
from ggmoe.cache.config import slots_for_budget
from ggmoe.cache.hardware import HardwareProfile, compose_profile, gpu_vram
from ggmoe.cache.parts import DEFAULT_DISK, PARTS_FILE, effective_link, load_parts, part
from ggmoe.cache.tiers import TierSizes, host_ram_for, tier_sizes
from ggmoe.inspect.facts import ModelFacts
from ggmoe.simulate.des import BaselineResult, SimConfig, baseline, simulate
from ggmoe.simulate.disk import fault_bytes_per_s, page_cache_reads
from ggmoe.trace.format import STAGE_DECODE, STAGE_PREFILL, Trace
from ggmoe.trace.imports import RoutingShape, import_routing
from ggmoe.trace.remap import map_trace

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "data" / "routing-sample"
SAMPLE_SHAPE = RoutingShape(n_layer=27, n_expert=64, n_expert_used=6)
SAMPLE_NOTE = "DeepSeek-V2-Lite routing sample, deepseek-ai/ESFT 579a771, MIT"
PREFILL_TOKENS = 512  # tokens of each prompt's prefill
DECODE_TOKENS = 96  # tokens decoded after each prompt
N_PROMPTS = 2  # prompts replayed: the first warms the cache, the last one's prefill is reported
RESERVE_BYTES = 3 << 29  # 1.5 GiB of VRAM not for weights: CUDA context, compute buffers, a 4k-token KV cache
DEFAULT_HOST = "ddr5-5600x2"


@dataclass(frozen=True)
class Way:
    """One way to run the model on the machine, estimated."""

    name: str  # e.g. "ggmoe, async decode"
    decode_tok_s: float | None  # estimate; None: it does not fit
    prefill_tok_s: float | None  # estimate, a PREFILL_TOKENS-token prompt
    detail: str  # what it keeps where
    run: str  # the command line, or why it cannot run


@dataclass(frozen=True)
class Advice:
    model: str
    profile: str  # GPU/LINK/HOST as composed
    link: str  # the link the GPU gets (the slower of the slot and its own interface)
    vram_bytes: int
    ram_bytes: int | None
    expert_budget_bytes: int  # VRAM for cached experts: vram - dense weights - RESERVE_BYTES
    slots_per_layer: int  # 0: no cache fits
    choice: Way
    ways: tuple[Way, ...]
    routing: str  # the routing the estimates replay
    notes: tuple[str, ...]
    tiers: TierSizes | None = None  # the three tiers when a RAM or host budget is given


def sample_trace(facts: ModelFacts) -> Trace:
    """The shipped routing sample mapped to the model: ``N_PROMPTS`` prompts, each ``PREFILL_TOKENS`` of prefill
    then ``DECODE_TOKENS`` decoded (the first warms the cache; the last prompt's prefill is the one reported)."""
    src = import_routing(SAMPLE_DIR, SAMPLE_SHAPE, "layer-files", SAMPLE_NOTE)
    tr = map_trace(src, tuple(facts.moe_layers), facts.n_expert, facts.n_expert_used, facts.n_layer)
    per = PREFILL_TOKENS + DECODE_TOKENS
    n = min(tr.n_tokens, N_PROMPTS * per)
    pos = np.arange(n) % per
    stage = np.where(pos < PREFILL_TOKENS, STAGE_PREFILL, STAGE_DECODE).astype(np.uint8)
    offsets = np.array([*range(0, n, per), n], dtype=np.int64)
    return replace(tr, token_ids=tr.token_ids[:n], positions=pos.astype(np.int32), stage=stage,
                   prompt_offsets=offsets, ids=tr.ids[:n], probs=tr.probs[:n])


def _tok_s(tpot_s: float | None, ttft_s: float | None) -> tuple[float | None, float | None]:
    """(decode, prefill) tokens per second from TPOT and the reported prompt's time to its first token."""
    decode = 1.0 / tpot_s if tpot_s else None
    prefill = PREFILL_TOKENS / (ttft_s - tpot_s) if ttft_s and tpot_s and ttft_s > tpot_s else None
    return decode, prefill


# The policy ggmoe's ways run: LRU's eviction with admissions filtered by use (docs/policies.md, "Admission of
# misses served without a slot": on the shared real routing it is the fastest row of both decodes that serve
# misses without a slot; the sync decode's demand copies are not filtered). llama.cpp's row stays LRU.
ADVISED_POLICY = "tinylfu"


def _ggmoe_ways(tr: Trace, facts: ModelFacts, bpe: dict[int, int], budget: int, profile: HardwareProfile,
                model: str, hw: str, tiers: TierSizes | None = None) -> list[Way]:
    slots = slots_for_budget(budget, bpe, facts.n_expert, facts.n_expert_used)
    n = next(iter(slots.values()))
    out = []
    # the async decode with auto: its host part takes a layer's misses where the CPU beats the graph's read over
    # the link (all or none, docs/engine.md), else it is the async decode alone
    for name, mode, miss in (("ggmoe, async decode", "async", "auto"), ("ggmoe, sync decode + host path", "sync",
                                                                         "auto"),
                             ("llama.cpp --moe-cache-mib (LRU, sync, misses copied)", "sync", "wait")):
        policy = "lru" if name.startswith("llama.cpp") else ADVISED_POLICY
        # the async decode as serve runs it: in-graph fills on (DecodeConfig.fills)
        host_slots = tiers.host_slots if tiers is not None and tiers.disk else None
        r = simulate(tr, SimConfig(slots, policy=policy, miss_policy=miss, decode_mode=mode, fills=mode == "async",
                                   host_slots=host_slots), bpe, profile)
        dec, pre = _tok_s(r.tpot_s, r.ttft_each_s[-1] if r.ttft_each_s else None)
        if name.startswith("llama.cpp"):
            run = f"llama-server -m {model} --moe-cache-mib {budget >> 20} (llama.cpp mainline)"
        else:
            run = (f"ggmoe serve {model} --vram {budget} --policy {policy} --decode-mode {mode} --miss-policy {miss} "
                   f"--hw {hw}" + (f" --host-ram {tiers.host_ram}" if host_slots is not None else ""))
        disk = (f"; {host_slots} in host RAM, {r.tiers['host']['disk_bytes_per_token'] / 2**20:.0f} MiB read from "
                "disk per token" if host_slots is not None else "")
        out.append(Way(name, dec, pre, f"{n} of {facts.n_expert} experts per layer cached; hit rate "
                                        f"{r.hit_rate:.0%}{disk}", run))
    return out


def _stock_ways(tr: Trace, facts: ModelFacts, bpe: dict[int, int], budget: int, profile: HardwareProfile,
                model: str, tiers: TierSizes | None = None) -> list[Way]:
    out = []
    b = baseline(tr, "n-cpu-moe", bpe, profile, budget)
    n_cpu = len(facts.moe_layers) - b.gpu_layers
    cpu_cols = range(b.gpu_layers, len(facts.moe_layers))  # the budget fills VRAM with the first MoE layers
    out.append(Way("llama.cpp --n-cpu-moe", *_tok_s(*_with_faults(b, tr, bpe, profile, tiers, cpu_cols)),
                   f"{b.gpu_layers} of {len(facts.moe_layers)} MoE layers' experts in VRAM" + _mmap(tiers),
                   f"llama-server -m {model} -ngl 99 --n-cpu-moe {n_cpu}"))
    b = baseline(tr, "stock-cpu", bpe, profile)
    out.append(Way("llama.cpp -ot exps=CPU",
                   *_tok_s(*_with_faults(b, tr, bpe, profile, tiers, range(len(facts.moe_layers)))),
                   "every expert on the CPU" + _mmap(tiers), f"llama-server -m {model} -ngl 99 -ot exps=CPU"))
    fits = budget >= facts.expert_bytes
    b = baseline(tr, "stock-vram", bpe, profile)
    out.append(Way("all experts in VRAM", *(_tok_s(b.tpot_s, b.ttft_s) if fits else (None, None)),
                   "every expert on the GPU" if fits else
                   f"does not fit: experts {facts.expert_bytes / 2**30:.1f} GiB, VRAM for them "
                   f"{budget / 2**30:.1f} GiB", f"llama-server -m {model} -ngl 99" if fits else "-"))
    return out


def _with_faults(b: BaselineResult, tr: Trace, bpe: dict[int, int], profile: HardwareProfile,
                 tiers: TierSizes | None, columns: range) -> tuple[float, float | None]:
    """(TPOT, TTFT) of a stock way, plus its page faults when the model does not fit RAM (mmap: each expert the
    CPU reads that the page cache lacks is faulted in from disk, synchronously)."""
    if tiers is None or not tiers.disk or not len(columns):
        return b.tpot_s, b.ttft_s
    reads = page_cache_reads(tr.ids, tiers.host_slots, columns).astype(float)
    per_expert = max(bpe.values()) / fault_bytes_per_s(profile)  # s per expert faulted in
    decode = tr.stage != STAGE_PREFILL
    tpot = b.tpot_s + float(reads[decode].mean()) * per_expert if decode.any() else b.tpot_s
    n_prompts = len(tr.prompt_offsets) - 1
    ttft = b.ttft_s + float(reads[~decode].sum()) * per_expert / n_prompts if b.ttft_s is not None else None
    return tpot, ttft


def _mmap(tiers: TierSizes | None) -> str:
    return "; host experts through mmap, page faults from disk" if tiers is not None and tiers.disk else ""


def advise(facts: ModelFacts, gpu: str, vram: int | None = None, ram: int | None = None, link: str | None = None,
           host: str = DEFAULT_HOST, parts_file: Path = PARTS_FILE, host_ram: int | None = None,
           disk: str = DEFAULT_DISK) -> Advice:
    """The ways to run ``facts``'s model on GPU/LINK/HOST/DISK at ``vram`` bytes (default: the GPU's), estimated;
    with ``ram`` (or ``host_ram``, the host tier itself) smaller than the experts, on three tiers."""
    table = load_parts(parts_file)
    g = part(table, "gpu", gpu)
    slot = part(table, "link", link or g.interface)
    spec = f"{gpu}/{slot.name}/{host}" + ("" if disk == DEFAULT_DISK else f"/{disk}")
    profile, _ = compose_profile(f"{gpu}/{slot.name}/{host}/{disk}", parts_file)
    vram = gpu_vram(gpu) if vram is None else vram
    return advise_profile(facts, profile, spec, effective_link(g, slot).name, vram, ram, gpu, host_ram)


def advise_profile(facts: ModelFacts, profile: HardwareProfile, spec: str, link: str, vram: int,
                   ram: int | None = None, gpu: str = "the GPU", host_ram: int | None = None) -> Advice:
    """``advise`` on a profile already made (``ggmoe serve --fit``: composed, with this machine's measurements
    in place of specifications); ``spec`` is what ``--hw`` would name, ``link`` the link the GPU gets."""
    if vram <= 0:
        raise UsageError(f"--vram {vram}: must be positive")
    budget = vram - facts.dense_bytes - RESERVE_BYTES
    if budget < 0:
        raise UsageError(f"{Path(facts.path).name} cannot run on {gpu} with {vram / 2**30:.1f} GiB of VRAM: its "
                         f"dense weights ({facts.dense_bytes / 2**30:.1f} GiB) and {RESERVE_BYTES / 2**30:.1f} GiB "
                         "for the context do not fit")
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    tr = sample_trace(facts)
    model = Path(facts.path).name
    notes = []
    fits = budget >= facts.n_expert_used * facts.expert_bytes_per_slot
    slots = min(budget // facts.expert_bytes_per_slot, facts.n_expert) if fits else 0
    tiers = _tiers(facts, int(slots), ram, host_ram, notes)
    ways = _stock_ways(tr, facts, bpe, budget, profile, model, tiers)
    if fits:
        ways = _ggmoe_ways(tr, facts, bpe, budget, profile, model, spec, tiers) + ways
    else:
        notes.append(f"no expert cache fits: {budget / 2**30:.2f} GiB of VRAM after the dense weights "
                     f"({facts.dense_bytes / 2**30:.1f} GiB) and {RESERVE_BYTES / 2**30:.1f} GiB for the context; "
                     f"a cache needs top-k = {facts.n_expert_used} slots per layer "
                     f"({facts.n_expert_used * facts.expert_bytes_per_slot / 2**30:.2f} GiB)")
    # the fastest decode; all in VRAM where it is as fast (nothing to configure)
    choice = max((w for w in ways if w.decode_tok_s is not None),
                 key=lambda w: (round(w.decode_tok_s, 6), w.name == "all experts in VRAM"))
    return Advice(model=str(facts.path), profile=spec, link=link, vram_bytes=vram, ram_bytes=ram,
                  expert_budget_bytes=budget, slots_per_layer=int(slots), choice=choice, ways=tuple(ways),
                  routing=tr.meta.source, notes=tuple(notes), tiers=tiers)


def _tiers(facts: ModelFacts, slots: int, ram: int | None, host_ram: int | None, notes: list[str]) -> TierSizes | None:
    """The three tiers for a RAM (its host tier after the OS's margin) or a host budget; None with neither. A
    note says when the experts do not all fit the host tier."""
    if ram is None and host_ram is None:
        return None
    budget = host_ram if host_ram is not None else host_ram_for(ram)
    try:
        tiers = tier_sizes(facts, slots, budget)
    except UsageError as e:
        if host_ram is not None:
            raise
        raise UsageError(f"--ram {format_bytes(ram)} leaves {format_bytes(budget)} for the host tier after the OS's "
                         f"margin: {e}") from None
    if tiers.disk:
        notes.append(f"the experts ({format_bytes(facts.expert_bytes)}) do not fit the host tier "
                     f"({format_bytes(tiers.host_bytes)}"
                     + (f" of {format_bytes(ram)} of RAM, less the OS's margin" if host_ram is None else "")
                     + f"): {tiers.disk_experts} of {facts.n_expert} experts per layer stay on disk, read on a miss "
                     "in both tiers")
    return tiers
