"""The discrete-event simulator: traces through the engine's cache, copy queue and prefetcher on a cost model.

Three resources share one virtual clock (seconds):

- the GPU stream: per MoE layer call, attention and router (``gpu_layer_s`` per 64 tokens of the
  micro-batch), the route hook (``hook_s``), a wait for copies the layer needs, the predictor when one runs
  in the callback, then each distinct resident expert read once (``gpu_expert_s(bytes)``);
- the copy engine (``timeline.LinkCopyBackend``): one link, chunks, demand before admission before
  prefetch, so copies overlap the GPU and a layer waits only for what it needs;
- the CPU workers of the host path: the experts the miss policy sends to the CPU, one after another
  (``cpu_expert_s(bytes)`` each), after the router (they need its answer) and in parallel with the GPU's
  experts: the layer's expert part takes the longer of the two.

The hybrid decode (``SimConfig.hybrid``, simulate's ``--decode-mode hybrid``): the sync decode with miss policy
``auto``, the CPU computing beside the link. Each layer's new misses are split between the two by their costs
and queues (``ggmoe.cache.miss.split_misses``, the cache's ``cpu_beside_link``); the CPU starts on its share when
the route op has the router's answer, while the link copies the rest and the GPU then computes the hits and the
copied misses. The layer's expert part ends when both have: ``max(wait + GPU experts, split + CPU experts)``,
where a layer whose experts the CPU computes pays one graph split with a device sync on the CPU's side
(``hook_s``, as ``stock-cpu``'s CPU layers do: the activations to the host and the results back), and the split
weighs it (``MissCosts.host_split_s``).

A micro-batch too wide for the slots runs natively, as the engine does: llama.cpp's op offload uploads the
layer's whole expert tensors for it (``n_expert`` experts over the link) and the GPU computes.

The async decode (``SimConfig.decode_mode="async"``): micro-batches of at most ``TABLE_MAX_TOKENS`` tokens
pay no route hook; each layer's experts that were readable when the token started come from VRAM, the others
are read by the GPU over the link at the zero-copy rate (``zero_copy_bytes_per_s``), sharing it with the
copies in flight (``LinkCopyBackend.occupy``: each at half its rate while both run); after the token the engine's own ``TokenController`` admits the misses, whose copies
land on the link's timeline and become readable at the first token boundary after they land (epochs).
Larger micro-batches (prefill) take the sync path, as in the engine.

In-graph fills (``SimConfig.fills``, simulate's ``--decode-mode async-fill``; the engine's ``DecodeConfig.fills``):
before each one-token decode the cache offers its fill slots (``ExpertCache.offer_fills``); per layer, the misses
that ``ggmoe.cache.fill.assign`` puts in them (against what was readable when the layer started) cross the
link inside the layer at the zero-copy rate, as a read in place does, and are then computed from VRAM; the
cache takes them (``take_fills``) and the controller settles them with no admission copy. Misses beyond the
fill slots are read in place and admitted as without fills.

The async decode's host part (miss policy ``cpu`` or ``auto`` with decode mode async; the engine's patch 0016):
between tokens the cache names per layer the experts the CPU computes whenever no slot holds them
(``ggmoe.cache.miss.async_cpu_masks``, as the engine's pipeline sets ``ExpertCache.cpu_of``; without routing
counts, the highest ids). Such a miss is neither filled nor read over the link: the CPU computes it beside the
device part, after a graph split that a layer with a host part pays every token (``hook_s``), and the layer ends
when both parts have: ``max(GPU experts + link reads, hook_s + CPU experts)``.

With a planner (``SimConfig.planner``: a cross-token predictor, ``ggmoe.control.planner``), the engine's own
``NextTokenPlanner`` plans each layer's next call as in the engine: in the async replay the controller shows it
every layer between tokens (the MoE input rows from the trace, as the engine's mailbox hands them), in the sync
replay it is a route observer.

A model larger than its host budget (``SimConfig.host_slots``, from ``--host-ram`` through
``ggmoe.cache.tiers``) adds a disk link under the host link (``ggmoe.simulate.disk``): every GPU-tier miss
(a copy, an in-place read) reads the expert from disk into a host slot first when the host tier
does not hold it, and the predictions the cache is handed read their experts into the host tier ahead.

The cache, the policies, the miss policy, the planner and the prefetcher are the engine's own objects; only the copy
backend and the clock are simulated. Without a hardware profile every cost is zero and copies land at once:
the counts then equal the engine's on a CPU build exactly. What is not modelled: the output head and
sampling, KV-cache growth, kernel overlap inside a layer, PCIe contention with the GPU's own traffic. TPOT
and TTFT are therefore **estimates**, labelled so wherever they are printed.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import RouteEvent
from ggmoe.cache import ExpertCache
from ggmoe.cache.assemble import CacheSpec, assemble_cache
from ggmoe.cache.clock import ManualClock
from ggmoe.cache.decode_mode import TABLE_MAX_TOKENS
from ggmoe.cache.fill import Fill, FillTargets, assign
from ggmoe.cache.hardware import COPIES_PER_EXPERT, HardwareProfile
from ggmoe.cache.miss import (
    SLOT_HOST,
    MissCosts,
    async_cpu_masks,
    auto_without_host_path,
    effective_miss_policy,
    without_host_path_when_full,
)
from ggmoe.cache.policies import make_policy
from ggmoe.cache.policies.base import Policy, releases
from ggmoe.cache.split import LayerSplit
from ggmoe.control import TokenController
from ggmoe.control.planner import NextTokenPlanner, check_planner, default_protect
from ggmoe.control.prefetch import Prefetcher, default_n_prefetch
from ggmoe.predict import ModelShape, make_predictor
from ggmoe.predict.base import Predictor, check_trace_inputs, is_predictor_file
from ggmoe.simulate.disk import DiskLinkCopyBackend, DiskQueue, HostTierTimes, TierCounts
from ggmoe.simulate.replay import micro_batches, next_uses_flat
from ggmoe.simulate.timeline import FlagLinkCopyBackend, LinkCopyBackend
from ggmoe.trace.format import STAGE_PREFILL, Trace

TOKENS_PER_LAYER_STEP = 64  # tokens of a micro-batch the GPU's attention handles in one batch-1 layer time


@dataclass(frozen=True)
class SimConfig:
    """One configuration to simulate."""

    n_slots: Mapping[int, int]  # slots per MoE layer
    policy: str = "lru"
    policy_options: Mapping[str, Any] | None = None  # e.g. static's counts
    predictor: str | None = None  # a registered predictor, "oracle", or a PRED.npz; None: no prefetching
    stride: int = 2  # MoE layers ahead
    n_prefetch: int | None = None  # experts prefetched per target layer (default: 2 x n_expert_used)
    threshold: float | None = None
    miss_policy: str = "wait"
    predictor_s: float | None = None  # s per predictor call on the GPU's critical path; None: measured here
    predictor_state: Mapping[str, np.ndarray] | None = None  # a learnt state (--stats-in), as the engine loads it
    # sync: the route op per layer (hook cost, demand copies); async: decode micro-batches read experts through
    # the table (misses at the zero-copy rate, no hook), the controller admits between tokens
    decode_mode: str = "sync"
    # MoEpic's split (ggmoe.cache.split.model_split): layers whose slots hold top segments; their bottoms are
    # read over the link at the zero-copy rate, or prefetched into n_prefetch bottom buffers with a predictor
    split: Mapping[int, LayerSplit] | None = None
    # the planner between tokens: a cross-token predictor (reuse, eam, expert-map, a PRED.npz of mode token), or
    # None; n_protect experts planned per layer (None: 2 x n_expert_used, ggmoe.control.planner.default_protect)
    planner: str | None = None
    n_protect: int | None = None
    # the async decode's in-graph fills (``DecodeConfig.fills``, patch 0012): before each decode the cache offers
    # fill slots, the graph copies each miss into one (``ggmoe.cache.fill.assign``) and reads it there, so a miss
    # crosses the link once and is not admitted after; False: misses read in place, then admitted
    fills: bool = False
    # the host tier's slots per MoE layer when the experts do not all fit --host-ram (ggmoe.cache.tiers): a miss in
    # both tiers reads the expert from disk first (ggmoe.simulate.disk); None: every expert in host memory
    host_slots: int | None = None
    # the hybrid decode (sync only, miss policy auto): the CPU computes its share of a layer's misses while the
    # link copies the rest, the share from the balanced split (ggmoe.cache.miss.split_misses)
    hybrid: bool = False

    @property
    def mode(self) -> str:
        """The decode mode as simulate's rows and the GPU matrix name it: sync, async, async-fill or hybrid."""
        if self.hybrid and self.decode_mode == "sync":
            return "hybrid"
        return "async-fill" if self.fills and self.decode_mode == "async" else self.decode_mode

    @property
    def label(self) -> str:
        sizes = sorted(set(self.n_slots.values()))
        size = str(sizes[0]) if len(sizes) == 1 else f"{min(sizes)}-{max(sizes)}"
        pred = f"{self.predictor}/s{self.stride}" if self.predictor else "-"
        if self.planner:
            pred += f", planner {self.planner}"
        mode = f", {self.mode}" if self.decode_mode == "async" or self.hybrid else ""
        if self.split:
            thetas = sorted({s.n_top / s.n_ff for s in self.split.values()})
            mode += f", split θ {thetas[0]:.2g}" + (f"-{thetas[-1]:.2g}" if len(thetas) > 1 else "")
        if self.host_slots is not None:
            mode += f", {self.host_slots} host slots"
        return f"{self.policy} {size} slots, predictor {pred}, miss {self.miss_policy}{mode}"


@dataclass(frozen=True)
class SimResult:
    label: str
    policy: str
    predictor: str | None
    miss_policy: str
    slots_per_layer: dict[int, int]
    cache_bytes: int  # bytes of slots over all layers
    hit_rate: float
    pred_accuracy: float  # top-k of the predictions that the layer selected
    prefetch_issued: int
    prefetch_hits: int
    late_prefetches: int  # prefetched experts a layer had to wait for
    goodpred: float  # accuracy x share of used prefetches that had landed in time
    exposed_copy_s: float  # s the GPU waited for copies
    host_computed: int  # experts computed on the CPU
    native_calls: int
    decode_tokens: int
    prefill_tokens: int
    tpot_s: float | None  # estimate: s per decoded token; None without a profile
    ttft_s: float | None  # estimate: mean s from a prompt to its first token; None without a profile
    link_busy_s: float  # s the simulated link copied (and, async, held by zero-copy reads)
    stats: dict = field(default_factory=dict)  # CacheStats.to_dict()
    decode_mode: str = "sync"  # sync, async, async-fill (the async decode with in-graph fills) or hybrid
    ttft_each_s: tuple[float, ...] = ()  # estimate: each prompt's time to its first token, in order
    planner: str | None = None  # the cross-token predictor that planned between tokens, or None
    plan_accuracy: float = 0.0  # its plans' top n_expert_used that the layer's next call selected
    tiers: dict = field(default_factory=dict)  # the disk tier's: per-tier hits, misses and bytes (empty: none)


def sim_predictor(config: SimConfig, trace: Trace, train: Trace | None, model_path: str | None,
                    fit: bool = True, planner: bool = False):
    """The predictor built as the engine's ``make_prefetcher`` builds it, from the traces' model shape;
    ``fit=False`` checks that it can be built (UsageError otherwise) without learning from ``train``.
    ``planner``: the planner's (``config.planner``: a PRED.npz must be of mode token), else the prefetcher's."""
    shape = ModelShape.from_trace(trace.meta, trace.layers)
    spec = config.planner if planner else config.predictor
    if planner:
        check_planner(spec)
    options: dict[str, object] = {"model": model_path} if spec == "skip-gate" else {}
    if planner and is_predictor_file(spec):
        options["mode"] = "token"
    pred = make_predictor(spec, shape, 1 if planner else config.stride, **options)
    check_trace_inputs(pred, trace.meta)
    if pred.needs_hidden and trace.hidden is None:
        raise UsageError(f"predictor {spec!r} reads hidden states: the traces have none "
                         "(record them without --no-hidden)")
    if config.predictor_state and not planner:
        pred.load_state(dict(config.predictor_state))
    if pred.needs_fit and not (pred.has_state and train is None):
        if train is None:
            raise UsageError(f"predictor {spec!r} learns from traces: give training traces "
                             "(--predictor-train) or routing statistics saved by a run with it (--stats-in)")
        if train.meta.model_fingerprint != trace.meta.model_fingerprint:
            raise UsageError("the training traces come from another model")
        if fit:
            pred.fit(train)
    return pred


class _Costs:
    """The profile's figures for one trace (zero without a profile), per layer computed once."""

    def __init__(self, profile: HardwareProfile | None, bytes_per_expert: Mapping[int, int], n_expert: int) -> None:
        self.p = profile
        self.bpe = bytes_per_expert
        self.n_expert = n_expert
        p = profile
        self._gpu = {il: p.gpu_expert_s(b) for il, b in bytes_per_expert.items()} if p else {}
        self._cpu = {il: p.cpu_expert_s(b) for il, b in bytes_per_expert.items()} if p else {}
        self._hook = p.hook_s if p else 0.0

    def hook(self) -> float:
        return self._hook

    def layer(self, n_tokens: int) -> float:
        """Attention and router of a micro-batch of ``n_tokens`` (before the route op)."""
        return math.ceil(n_tokens / TOKENS_PER_LAYER_STEP) * self.p.gpu_layer_s if self.p else 0.0

    def experts(self, il: int, n_experts: int) -> float:
        """``n_experts`` distinct experts computed on the GPU."""
        return n_experts * self._gpu[il] if n_experts and self.p else 0.0

    def cpu(self, il: int, n_experts: int) -> float:
        return n_experts * self._cpu[il] if n_experts and self.p else 0.0

    def zero_copy(self, nbytes: int) -> float:
        """``nbytes`` of expert weights read by the GPU from pinned host memory (misses and bottoms)."""
        return self.p.zero_copy_s(nbytes) if self.p and nbytes else 0.0

    def native_upload(self, il: int) -> float:
        """llama.cpp's op offload: the layer's whole expert tensors over the link."""
        return self.p.copy_s(self.n_expert * self.bpe[il], COPIES_PER_EXPERT) if self.p else 0.0


def _miss_policy(config: SimConfig, split: bool, costs: MissCosts | None, bytes_per_expert: Mapping[int, int],
                 n_expert_used: int, n_expert: int, keeps: bool) -> str:
    """The miss policy the engine would run: ``auto`` without a host path that cannot serve the cache, ``auto``
    and ``cpu`` as ``wait`` on a warm cache of every expert (``keeps``: the policy keeps what it loads), then
    ``auto`` as ``wait`` where the cost model never prefers the CPU (in the hybrid decode: where the split never
    sends a token's misses to the CPU)."""
    asked, _ = auto_without_host_path(config.miss_policy, split)
    asked, _ = without_host_path_when_full(asked, config.n_slots, n_expert, keeps)
    # the CPU beside the link: the hybrid decode, and the async decode's host part (its own branch of the graph)
    beside = n_expert_used if config.hybrid or config.decode_mode == "async" else None
    return effective_miss_policy(asked, costs, bytes_per_expert, beside)[0]


def simulate(trace: Trace, config: SimConfig, bytes_per_expert: Mapping[int, int],
             profile: HardwareProfile | None = None, train: Trace | None = None, n_chunks: int = 3,
             model_path: str | None = None) -> SimResult:
    """Replay ``trace`` through a fresh cache on the cost model; see the module docstring."""
    layers = [int(il) for il in trace.layers]
    missing = [il for il in layers if il not in config.n_slots]
    if missing:
        raise UsageError(f"no slot count for MoE layers {missing}")
    if config.decode_mode not in ("sync", "async"):
        raise UsageError(f"decode mode {config.decode_mode!r}: the simulator runs sync or async")
    if config.fills and config.decode_mode != "async":
        raise UsageError("in-graph fills are the async decode's: simulate them with decode mode async")
    if config.hybrid and (config.decode_mode != "sync" or config.miss_policy != "auto"):
        raise UsageError("the hybrid decode is the sync decode with miss policy auto")
    with _without_cycle_collector():  # the build's next uses are a million dicts too
        sim = _build(trace, config, bytes_per_expert, profile, train, n_chunks, model_path, layers)
        decode_s, prefill_s, ttft = _replay(sim, trace)
    if sim.step.prefetcher is not None:
        sim.step.prefetcher.close()
    return _result(config, trace, sim.step.cache, sim.step.link, profile, bytes_per_expert, decode_s, prefill_s, ttft)


@contextmanager
def _without_cycle_collector() -> Iterator[None]:
    """The cyclic garbage collector off for a replay. A replay allocates millions of short-lived objects without
    cycles (copy handles, the link's jobs), which reference counting frees; each of the collector's passes
    over the long-lived ones (the trace's lists, Belady's next uses) finds nothing, and they cost up to 40 %
    of a long replay (measured: the Belady async row on one domain of the real routing, 8.2 s against 4.9)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class _Sim:
    """One replay's parts, wired as the engine wires them (``_build``)."""

    step: _Step  # clock, cache, link, costs, prefetcher and planner: what every micro-batch shares
    controller: TokenController | None  # the async decode's (None: sync)
    mailbox: _Mailbox | None  # the async stride prefetch's (None: none)
    rows_now: _Row  # the trace row a one-token micro-batch replays
    layers: list[int]
    pos: dict[int, int]  # layer -> its column in the trace
    ids: np.ndarray  # I32 [n_tokens, n_moe_layers, n_expert_used]
    batches: list[slice]  # the micro-batches, in order
    is_async: list[bool]  # per micro-batch: read through the expert tables (the async decode)
    future: list[dict[int, float]] | None  # Belady's next uses per cache call; None without
    policy: Policy
    starts: frozenset[int] = frozenset()  # the rows where a prompt starts (fill targets: a whole prompt's decode)


def _build(trace: Trace, config: SimConfig, bytes_per_expert: Mapping[int, int], profile: HardwareProfile | None,
           train: Trace | None, n_chunks: int, model_path: str | None, layers: list[int]) -> _Sim:
    """Clock, link, policy, cache, predictor, prefetcher, planner and controller for one replay."""
    m = trace.meta
    clock = ManualClock()
    split = dict(config.split or {})
    # the async decode's controller asks every copy in flight whether it landed, per layer and token: a link
    # whose answer is an attribute read (FlagLinkCopyBackend, settled before each call into the cache)
    # (not with a predictor: the async stride prefetch's mailbox calls into the cache inside a token)
    backend = (FlagLinkCopyBackend if config.decode_mode == "async" and not split and not config.predictor
               else LinkCopyBackend)
    host = _host_tier(config, trace, clock, profile, bytes_per_expert, layers)
    link = (backend(clock, dict(bytes_per_expert), profile, n_chunks, split) if host is None
            else DiskLinkCopyBackend(clock, dict(bytes_per_expert), profile, n_chunks, split, host))
    policy = make_policy(config.policy, m.n_expert, layers, config.policy_options)
    miss_costs = profile.miss_costs(n_chunks) if profile is not None else None
    miss_policy = _miss_policy(config, bool(split), miss_costs, bytes_per_expert, m.n_expert_used,  # as the engine
                               m.n_expert, not releases(policy))
    if host is not None and miss_policy != "wait":  # as the engine: most experts are not in host memory
        if config.miss_policy == "cpu":
            raise UsageError("--miss-policy cpu computes misses from host memory, and with a disk tier "
                             "(--host-ram below the experts' size) most experts are not there: use --miss-policy wait")
        miss_policy = "wait"  # auto runs as wait under a disk tier
    if config.decode_mode == "async" and miss_policy != "wait" and split:
        raise UsageError("the async decode's host part computes misses from host memory, and split experts read "
                         "their bottoms there through the expert table: use --miss-policy wait")
    pred = sim_predictor(config, trace, train, model_path) if config.predictor else None
    n_pre = config.n_prefetch if config.n_prefetch is not None else default_n_prefetch(m.n_expert_used, m.n_expert)
    cache = assemble_cache(CacheSpec(m.n_expert, m.n_expert_used, dict(config.n_slots), policy, copies=link,
                                      bytes_per_expert=dict(bytes_per_expert), clock=clock, miss_policy=miss_policy,
                                      costs=miss_costs, split=split,
                                      n_bottom=n_pre if pred is not None and split else 0))
    cache.preload()  # as the engine: a cache with a slot for every expert starts warm, in either decode mode
    prefetcher = Prefetcher(cache, pred, layers, n_pre, config.threshold) if pred is not None else None
    planner = _planner(config, trace, train, model_path, cache) if config.planner else None
    if config.decode_mode == "async" and prefetcher is not None:
        _stride_prefetch(cache, prefetcher)
    if config.fills:  # as the engine's pipeline sets it where the graph fills
        cache.fill_slots = m.n_expert_used
    cache.cpu_beside_link = config.hybrid
    if config.decode_mode == "async" and miss_policy != "wait":  # the host part's experts, as the pipeline sets them
        cache.cpu_of = async_cpu_masks(miss_policy, miss_costs, bytes_per_expert, config.n_slots, m.n_expert,
                                       m.n_expert_used, keeps=not cache.policy_releases)
    if host is not None and (pred is not None or config.planner):
        _disk_prefetch(cache, host)
    ids = trace.ids.astype(np.int32)
    pos = {il: j for j, il in enumerate(layers)}
    rows_now = _Row(trace, pos)  # the trace row a one-token micro-batch replays: the planner's input rows
    controller = TokenController(cache, planner=planner) if config.decode_mode == "async" else None
    batches = list(micro_batches(trace))
    is_async = [controller is not None and r.stop - r.start <= TABLE_MAX_TOKENS for r in batches]
    future = _future(trace, cache, layers, batches, is_async, ids, pos) if policy.needs_future else None
    step = _Step(clock, cache, link, _Costs(profile, bytes_per_expert, m.n_expert), prefetcher, pred, config,
                 profile is not None, planner)
    mailbox = _Mailbox(prefetcher, trace, pos) if controller is not None and prefetcher is not None else None
    return _Sim(step, controller, mailbox, rows_now, layers, pos, ids, batches, is_async, future, policy,
                frozenset(int(x) for x in trace.prompt_offsets[:-1]))


def _host_tier(config: SimConfig, trace: Trace, clock: ManualClock, profile: HardwareProfile | None,
               bytes_per_expert: Mapping[int, int], layers: list[int]) -> HostTierTimes | None:
    """The host tier over the disk when the experts do not all fit it (``config.host_slots``), else None."""
    m = trace.meta
    if config.host_slots is None or config.host_slots >= m.n_expert:
        return None
    if config.host_slots < m.n_expert_used:
        raise UsageError(f"{config.host_slots} host slots per layer: a model on disk needs at least n_expert_used = "
                         f"{m.n_expert_used}")
    if profile is not None and profile.disk_bytes_per_s is None:
        raise UsageError(f"hardware profile {profile.name!r} has no disk: give one with a [disk] table")
    n_pre = config.n_prefetch if config.n_prefetch is not None else default_n_prefetch(m.n_expert_used, m.n_expert)
    n_plan = config.n_protect if config.n_protect is not None else default_protect(m.n_expert, m.n_expert_used)
    disk = DiskQueue(clock, profile, TierCounts())
    return HostTierTimes(config.host_slots, m.n_expert, layers, bytes_per_expert, disk,
                    n_prefetch=max(n_pre if config.predictor else 0, n_plan if config.planner else 0))


def _disk_prefetch(cache: ExpertCache, host: HostTierTimes) -> None:
    """The disk's prefetch from the routing: every prediction the cache is handed (the stride prefetcher's
    ``prefetch``, the planner's ``plan_next``) first reads its experts that are neither on the GPU nor in the
    host tier into the host tier, in the background; the cache then does what it always does with it."""
    prefetch, plan_next = cache.prefetch, cache.plan_next

    def on_gpu(il: int, experts: list[int]) -> list[int]:
        slot_of = cache.tables[il].slot_of_list
        return [e for e in experts if slot_of[e] >= 0]

    def prefetch_via_disk(il: int, experts: list[int], *args: Any, **kwargs: Any) -> int:
        host.prefetch(il, experts, on_gpu(il, experts))
        return prefetch(il, experts, *args, **kwargs)

    def plan_via_disk(il: int, experts: list[int]) -> None:
        host.prefetch(il, experts, on_gpu(il, experts))
        plan_next(il, experts)

    cache.prefetch, cache.plan_next = prefetch_via_disk, plan_via_disk


def _replay(sim: _Sim, trace: Trace) -> tuple[float, float, list[float]]:
    """Every micro-batch in order: (decode seconds, prefill seconds, each prompt's time to its first token)."""
    clock, ids, future, st = sim.step.clock, sim.ids, sim.future, sim.step
    decode_s = prefill_s = 0.0
    ttft: list[float] = []
    first_pending: float | None = None  # a prompt's prefill time, until its first decode step
    fi = 0
    for bi, rows in enumerate(sim.batches):
        sim.rows_now.row = rows.start
        _begin_step(sim, trace, rows)
        t0 = clock.now()
        if sim.is_async[bi]:
            if future is not None:  # the controller's calls, one per layer in order, as _future counted them
                for il in sim.layers:
                    sim.policy.set_future(il, future[fi])
                    fi += 1
            if sim.mailbox is not None:
                sim.mailbox.row = rows.start
            hidden = sim.rows_now.rows() if sim.controller.wants_hidden(rows.stop - rows.start) else None
            targets = _offer_fills(st.cache, trace, rows, sim.starts) if st.config.fills else None
            _async_step(clock, st.cache, st.link, sim.controller, st.costs, sim.layers, ids[rows], sim.pos,
                        sim.mailbox, hidden, targets)
        else:
            fi = _sync_step(st, trace, rows, ids[rows], sim.layers, future, fi)
        dt = clock.now() - t0
        if trace.stage[rows.start] == STAGE_PREFILL:
            prefill_s += dt
            first_pending = (first_pending or 0.0) + dt
        else:
            decode_s += dt
            if first_pending is not None:
                ttft.append(first_pending + dt)
                first_pending = None
    return decode_s, prefill_s, ttft


def _begin_step(sim: _Sim, trace: Trace, rows: slice) -> None:
    """A micro-batch starts: the predictor and the planner see its tokens (an oracle also the truth)."""
    st = sim.step
    if st.prefetcher is not None:
        if getattr(st.pred, "needs_truth", False) and rows.stop - rows.start == 1:
            st.pred.reveal(sim.ids[rows.start])
        st.prefetcher.begin_step([int(t) for t in trace.token_ids[rows]])
    if st.planner is not None:
        st.planner.begin_step([int(t) for t in trace.token_ids[rows]])


@dataclass(frozen=True)
class _Step:
    """What every sync micro-batch of one simulation shares."""

    clock: ManualClock
    cache: ExpertCache
    link: LinkCopyBackend
    costs: _Costs
    prefetcher: Prefetcher | None
    pred: Predictor | None  # the prefetcher's or the planner's predictor (None: neither)
    config: SimConfig
    timed: bool  # a profile is given: the predictor's time counts
    planner: NextTokenPlanner | None = None  # a route observer in the sync decode, as in the engine
    fits: dict[int, list[bool]] = field(default_factory=dict)  # micro-batch tokens -> cache.fits per layer


def _sync_step(st: _Step, trace: Trace, rows: slice, sel_all: np.ndarray, layers: list[int],
               future: list[dict[int, float]] | None, fi: int) -> int:
    """One micro-batch on the sync path (the route op per MoE layer); returns the next index into ``future``."""
    clock, cache, costs = st.clock, st.cache, st.costs
    n_tok = rows.stop - rows.start
    flats = sel_all.transpose(1, 0, 2).reshape(len(layers), -1).tolist()  # per layer, the ids token after token
    before = costs.layer(n_tok) + costs.hook()  # attention and router, then the route op
    fits = st.fits.get(n_tok)
    if fits is None:  # the cache's answer for this micro-batch size, per layer (the slots never change)
        fits = st.fits[n_tok] = [cache.fits(il, n_tok) for il in layers]
    split = cache.split
    track = type(st.link) is FlagLinkCopyBackend  # the plain link answers lazily: nothing to settle
    observers = [o for o in (st.prefetcher, st.planner) if o is not None]  # the route observers that predict
    host = getattr(st.link, "host", None)  # the disk tier's host tier (None: every expert in host memory)
    for j, il in enumerate(layers):
        clock.advance(before)
        flat = flats[j]
        need = len(set(flat))
        if track:
            st.link.settle()  # what landed by now, before the cache asks (FlagLinkCopyBackend)
        if not fits[j]:
            cache.observe(il, sel_all[:, j])
            stream = host.stream_s(il, costs.n_expert) if host is not None else 0.0
            clock.advance(max(stream, costs.native_upload(il)) + costs.experts(il, need))
            continue
        in_split = il in split
        if in_split:  # a split layer reads misses and bottoms in place
            lst = cache.stats.layers[il]
            read0, miss0 = lst.host_read_bytes, lst.misses
        t_route = clock.now()  # the hybrid decode's CPU starts on its share here, as the link on its copies
        if future is None:
            slots = cache.route_flat(il, flat)
        else:
            slots = cache.route_flat(il, flat, next_use=future[fi])
            fi += 1
        n_host = len({e for e, s in zip(flat, slots, strict=True) if s == SLOT_HOST}) if SLOT_HOST in slots else 0
        if host is not None:
            host.touch(il, flat)
        for obs in observers:
            _observe(st, obs, trace, rows, sel_all, j, il)
        if in_split:  # what it read in place holds the link; whole misses are bound by it
            read_s = st.link.occupy(costs.zero_copy(lst.host_read_bytes - read0))
            clock.advance(max(costs.experts(il, need - n_host - (lst.misses - miss0)) + read_s, costs.cpu(il, n_host)))
        elif n_host:  # a whole-expert layer reads nothing in place on the sync path
            clock.advance(_host_layer_s(st, il, flat, slots, need, n_host, clock.now() - t_route))
        else:  # the GPU computes them all (max(t + 0.0, 0.0) is t: the same time)
            clock.advance(costs.experts(il, need))
    return fi


def _host_layer_s(st: _Step, il: int, flat: list[int], slots: list[int], need: int, n_host: int,
                  since_route_s: float) -> float:
    """The rest of a sync layer whose ``n_host`` experts the CPU computes: the longer of the GPU's experts and the
    CPU's (after the disk reads of experts the host tier lacks). In the hybrid decode the CPU started when the
    route op did, ``since_route_s`` ago (the link's copies and the predictor ran meanwhile), and the GPU waits
    for its results through one graph split with a device sync (``hook_s``: the activations to the host, the
    results back)."""
    costs = st.costs
    host = getattr(st.link, "host", None)
    wait = host.wait_s(il, {e for e, s in zip(flat, slots, strict=True) if s == SLOT_HOST}) if host else 0.0
    cpu_s = wait + costs.cpu(il, n_host)
    if not st.config.hybrid:
        return max(costs.experts(il, need - n_host), cpu_s)
    return max(costs.experts(il, need - n_host), costs.hook() + cpu_s - since_route_s)


def _observe(st: _Step, obs: Prefetcher | NextTokenPlanner, trace: Trace, rows: slice, sel_all: np.ndarray, j: int, il: int) -> None:
    """A route observer that predicts (prefetcher or planner) sees the layer's routing, in the callback's time."""
    tp = time.perf_counter()
    p = obs.predictor
    probs = trace.probs[rows, j].astype(np.float32) if p.needs_probs else None
    hidden = trace.hidden[rows, j].astype(np.float32) if p.needs_hidden else None
    obs.on_route(RouteEvent(il=il, ids=sel_all[:, j], probs=probs, hidden=hidden))
    pred_s = time.perf_counter() - tp if st.config.predictor_s is None else st.config.predictor_s
    st.clock.advance(pred_s if st.timed else 0.0)


def _stride_prefetch(cache: ExpertCache, prefetcher: Prefetcher) -> None:
    """The engine's async stride prefetch (``CachePipeline._stride_prefetch``): predictions as each layer
    starts, prefetches into free slots only, the same free slots kept between tokens."""
    if prefetcher.predictor.needs_probs:
        raise UsageError(f"predictor {prefetcher.predictor.name!r} reads router probabilities, which the async "
                         "decode's mailbox does not carry: simulate it with --decode-mode sync")
    prefetcher.via_mailbox = prefetcher.free_only = True
    cache.keep_free = cache.keep_free_cap(prefetcher.n_prefetch)


def _async_step(clock: ManualClock, cache: ExpertCache, link: LinkCopyBackend, controller: TokenController,
                costs: _Costs, layers: list[int], sel: np.ndarray, pos: dict[int, int],
                mailbox: _Mailbox | None = None, hidden: Mapping[int, np.ndarray] | None = None,
                targets: Mapping[int, FillTargets] | None = None) -> None:
    """One micro-batch of the async decode: per layer, attention and router (no route op), the resident
    experts from VRAM and the others read over the link at the zero-copy rate (sharing it); then the
    controller between tokens, the engine's own (admissions land on the link's timeline). With ``mailbox``
    (a predictor), each layer's start is seen by the cache and the prefetcher as the engine's mailbox reader
    sees it (free slots only; the predictor's time is the reader's, off the decode's critical path). ``hidden``:
    the token's MoE input rows, for a planner that reads them (``TokenController.wants_hidden``). ``targets``
    (in-graph fills, ``_offer_fills``): a layer's misses that ``assign`` puts in its fill slots cross the link
    at the same rate inside the layer, then are computed from VRAM; the controller settles them (no admission)."""
    routing = np.full((max(layers) + 1, sel.shape[0], sel.shape[2]), -1, dtype=np.int32)
    routing[layers] = sel[:, [pos[il] for il in layers], :].transpose(1, 0, 2)
    flats = routing.reshape(routing.shape[0], -1).tolist()  # per layer, the ids token after token
    layer_s = costs.layer(sel.shape[0])
    split = cache.split
    host = getattr(link, "host", None)  # the disk tier's host tier (None: every expert in host memory)
    cpu_of = cache.cpu_of  # the host part's experts per layer (patch 0016; empty: none)
    filled: list[Fill] = []
    # as the engine's pipeline decides before a token launches: read the mailbox only where a prefetch could go
    read = (mailbox is not None and sel.shape[0] == 1 and cache.has_free_slot()
            and mailbox.prefetcher.wants_token())
    for il in layers:
        clock.advance(layer_s)
        need = set(flats[il])
        if host is not None:
            host.touch(il, need)
        if read:
            layer_ids = sel[:, pos[il], :]
            cache.seen_start(il, layer_ids.ravel().tolist())
            mailbox.prefetcher.observe_layer(RouteEvent(il=il, ids=layer_ids, probs=None,
                                                        hidden=mailbox.hidden(il)))
        table = cache.tables[il]
        slot_of, copy = table.slot_of_list, table.copy
        readable = [e for e in need if slot_of[e] >= 0 and copy[slot_of[e]] is None]
        cpu = cpu_of.get(il) if cpu_of else None
        on_cpu = [e for e in need.difference(readable) if cpu[e]] if cpu is not None else []
        if il in split:
            nbytes = _read_in_place(cache, il, need)
        else:  # a whole expert for each one not ready in a slot (filled or read in place: one crossing)
            nbytes = (len(need) - len(readable) - len(on_cpu)) * cache.bytes_per_expert.get(il, 0)
            if host is not None and nbytes:  # from a host slot: a miss there reads the disk first
                clock.advance(host.wait_s(il, need.difference(readable)))
        t = targets.get(il) if targets else None
        n_filled = 0
        if t is not None:  # the graph's assignment: its misses copied into fill slots, read there
            got = assign(t, need.difference(on_cpu), readable)  # a host-part expert's entry is 0: never filled
            filled += got
            n_filled = len(got)
        read_s = link.occupy(costs.zero_copy(nbytes))  # shared with the copies in flight
        # what is read over the link is bound by the link; a filled expert is then computed from its slot
        gpu_s = costs.experts(il, len(readable) + n_filled) + read_s
        # a layer with a host part pays its graph split every token (activations to the host, results back),
        # then the CPU's experts, beside the device part; the two meet at the layer's sum
        clock.advance(max(gpu_s, costs.hook() + costs.cpu(il, len(on_cpu))) if cpu is not None else gpu_s)
    link.settle()  # what landed by now, before the controller asks (FlagLinkCopyBackend)
    if filled:
        cache.take_fills(filled)  # as the engine hands the read-back words to the cache
    controller.on_routing(layers, routing, hidden=hidden)


def _offer_fills(cache: ExpertCache, trace: Trace, rows: slice, starts: frozenset[int]) -> dict[int, FillTargets]:
    """The engine's fill targets before a decode (``CachePipeline.begin_step``): fill slots only for a decode of
    one token (a decoded token, or a prompt of one token; never a micro-batch of a longer prompt). il -> its
    targets."""
    one = rows.stop - rows.start == 1 and (trace.stage[rows.start] != STAGE_PREFILL or rows.start in starts)
    return {p.il: p for p in cache.offer_fills(1 if one else 0)}


def _planner(config: SimConfig, trace: Trace, train: Trace | None, model_path: str | None,
             cache: ExpertCache) -> NextTokenPlanner:
    """The engine's planner on the replay: its predictor built as ``make_planner`` builds it."""
    pred = sim_predictor(config, trace, train, model_path, planner=True)
    if config.decode_mode == "async" and pred.needs_probs:
        raise UsageError(f"planner {config.planner!r} reads router probabilities, which the async decode does not "
                         "hand the host: simulate it with --decode-mode sync")
    m = trace.meta
    n = config.n_protect if config.n_protect is not None else default_protect(m.n_expert, m.n_expert_used)
    planner = NextTokenPlanner(cache, pred, [int(il) for il in trace.layers], n)
    planner.via_controller = config.decode_mode == "async"
    return planner


@dataclass
class _Row:
    """The trace row of the one-token micro-batch being replayed: its MoE input rows, as the mailbox has them."""

    trace: Trace
    pos: dict[int, int]
    row: int = 0

    def rows(self) -> dict[int, np.ndarray]:
        """il -> the row's MoE input [n_embd] float32 at each layer (none without hidden states in the trace)."""
        h = self.trace.hidden
        return {il: h[self.row, j].astype(np.float32) for il, j in self.pos.items()} if h is not None else {}


@dataclass
class _Mailbox:
    """What the engine's mailbox hands its reader for the token being replayed: the MoE input rows."""

    prefetcher: Prefetcher
    trace: Trace
    pos: dict[int, int]
    row: int = 0  # the trace row of the token being replayed

    def hidden(self, il: int) -> np.ndarray | None:
        if not self.prefetcher.predictor.needs_hidden:
            return None
        return self.trace.hidden[self.row: self.row + 1, self.pos[il]].astype(np.float32)


def _read_in_place(cache: ExpertCache, il: int, need: set[int]) -> int:
    """Bytes the device reads from host memory for the experts ``need`` of layer ``il`` as the tables stand
    (the async decode): a whole expert not ready in a slot; a split layer's bottom unless it landed in a
    bottom buffer."""
    table = cache.tables[il]
    sp = cache.split.get(il)
    bt = cache.bottoms.get(il)
    out = 0
    for e in need:
        s = table.slot_of_list[e]
        if s < 0 or table.copy[s] is not None:
            out += sp.expert_bytes if sp is not None else cache.bytes_per_expert.get(il, 0)
        elif sp is not None and not (bt is not None and bt.ready(e)):
            out += sp.bottom_bytes
    return out


def _future(trace: Trace, cache: ExpertCache, layers: list[int], batches: Sequence[slice], is_async: list[bool],
            ids: np.ndarray, pos: dict[int, int]) -> list[dict[int, float]]:
    """Next uses (``replay.next_uses``) over the cache's calls in the order the replay makes them: every layer
    of an async micro-batch (the controller's ``after_token``), the routed layers of a sync one. Runs of
    one-token micro-batches that route every layer (the decode) are taken as arrays, a run at a time."""
    cols = [pos[il] for il in layers]
    all_fit = all(cache.fits(il, 1) for il in layers)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (call_il, lens, experts), in call order
    run = -1  # first row of the current run of one-token micro-batches (-1: none)
    for rows, a in zip(batches, is_async, strict=True):
        if rows.stop - rows.start == 1 and (a or all_fit):
            run = rows.start if run < 0 else run  # batches are consecutive rows: the run goes on
            continue
        if run >= 0:
            parts.append(_decode_calls(ids[run:rows.start, cols], layers))
            run = -1
        parts.append(_batch_calls(ids[rows], layers, cols, a, cache))
    if run >= 0:
        parts.append(_decode_calls(ids[run:batches[-1].stop, cols], layers))
    if not parts:
        return []
    call_il, lens, experts = (np.concatenate(x) for x in zip(*parts, strict=True))
    return next_uses_flat(call_il, lens, experts, trace.meta.n_expert)


def _decode_calls(sel: np.ndarray, layers: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(call_il, lens, experts) of one-token micro-batches ``sel`` [n_tokens, n_layers, n_expert_used], every
    layer routed: each call's distinct experts, ascending."""
    block = np.sort(sel.reshape(-1, sel.shape[2]).astype(np.int64), axis=1)  # [n_calls, n_expert_used]
    keep = np.ones(block.shape, dtype=bool)
    keep[:, 1:] = block[:, 1:] != block[:, :-1]  # an expert named twice in a token counts once
    return np.tile(np.asarray(layers, dtype=np.int64), sel.shape[0]), keep.sum(axis=1), block[keep]


def _batch_calls(sel: np.ndarray, layers: list[int], cols: list[int], is_async: bool, cache: ExpertCache
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(call_il, lens, experts) of one micro-batch ``sel`` [n_tokens, n_layers, n_expert_used]: every layer if
    async, else those that run on the cache; each call's distinct experts over its tokens, ascending."""
    routed = [(il, np.unique(sel[:, j])) for il, j in zip(layers, cols, strict=True)
              if is_async or cache.fits(il, sel.shape[0])]
    if not routed:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (np.asarray([il for il, _ in routed], dtype=np.int64),
            np.asarray([len(u) for _, u in routed], dtype=np.int64),
            np.concatenate([u for _, u in routed]).astype(np.int64))


def _result(config: SimConfig, trace: Trace, cache: ExpertCache, link: LinkCopyBackend,
            profile: HardwareProfile | None, bpe: Mapping[int, int], decode_s: float, prefill_s: float,
            ttft: list[float]) -> SimResult:
    t = cache.stats.total()
    n_decode = int(np.sum(trace.stage != STAGE_PREFILL))
    n_prefill = trace.n_tokens - n_decode
    in_time = 1.0 - link.late_prefetches / t.prefetch_hits if t.prefetch_hits else 0.0
    return SimResult(
        label=config.label, policy=config.policy, predictor=config.predictor, miss_policy=config.miss_policy,
        slots_per_layer=dict(config.n_slots), cache_bytes=sum(n * cache.slot_bytes[il] for il, n in config.n_slots.items()),
        hit_rate=t.hit_rate, pred_accuracy=t.pred_accuracy, prefetch_issued=t.prefetch_issued,
        prefetch_hits=t.prefetch_hits, late_prefetches=link.late_prefetches,
        goodpred=t.pred_accuracy * max(in_time, 0.0), exposed_copy_s=t.wait_s, host_computed=t.host_computed,
        native_calls=t.native_calls, decode_tokens=n_decode, prefill_tokens=n_prefill,
        tpot_s=decode_s / n_decode if profile is not None and n_decode else None,
        ttft_s=float(np.mean(ttft)) if profile is not None and ttft else None,
        link_busy_s=link.busy_s, stats=cache.stats.to_dict(), decode_mode=config.mode,
        ttft_each_s=tuple(ttft) if profile is not None else (), planner=config.planner,
        plan_accuracy=t.plan_accuracy, tiers=_tiers(config, link, t, n_decode))


def _tiers(config: SimConfig, link: LinkCopyBackend, t: Any, n_decode: int) -> dict:
    """Each tier's hits, misses and bytes with a disk tier (empty without one)."""
    host = getattr(link, "host", None)
    if host is None:
        return {}
    return {"gpu": {"slots": dict(config.n_slots), "hits": t.hits, "misses": t.misses},
            "host": {"slots": config.host_slots, **host.counts.to_dict(n_decode)},
            "disk": {"reads": host.counts.disk_reads, "bytes": host.counts.disk_bytes,
                     "busy_s": host.counts.disk_busy_s}}


BASELINES = ("stock-vram", "stock-cpu", "n-cpu-moe")
OP_OFFLOAD_MIN_TOKENS = 32  # llama.cpp computes host weights on the GPU (uploading them) from this batch size


@dataclass(frozen=True)
class BaselineResult:
    kind: str  # stock-vram | stock-cpu | n-cpu-moe
    gpu_layers: int  # MoE layers whose experts sit in VRAM
    tpot_s: float  # estimate
    ttft_s: float | None  # estimate


def baseline(trace: Trace, kind: str, bytes_per_expert: Mapping[int, int], profile: HardwareProfile,
             budget: int | None = None, gpu_layers: Sequence[int] | None = None) -> BaselineResult:
    """Stock llama.cpp on the same routing, estimated on the same cost model (no cache, no route op):

    - ``stock-vram``: every expert in VRAM; ``stock-cpu``: every expert in host memory, computed by the CPU
      (``-ot exps=CPU``); ``n-cpu-moe``: the first MoE layers whose whole expert tensors fit ``budget`` in
      VRAM, the others on the CPU (``--n-cpu-moe``). A layer whose experts the CPU computes splits the graph
      (the activations to the host and back, a device sync): it pays the profile's ``hook_s`` (in the h100
      and composed profiles the measured cost of one such split; the pcie4 and egpu estimates hold the route
      callback's alone). Micro-batches of at least 32 tokens on host experts
      take llama.cpp's op offload: the layer's expert tensors are uploaded and the GPU computes.

    ``gpu_layers`` (``n-cpu-moe`` only): the MoE layers whose experts sit in VRAM, as a given ``--n-cpu-moe N``
    places them (the blocks from N on), instead of the budget's.
    """
    if kind not in BASELINES:
        raise UsageError(f"unknown baseline {kind!r}; choose one of {', '.join(BASELINES)}")
    m = trace.meta
    layers = [int(il) for il in trace.layers]
    costs = _Costs(profile, bytes_per_expert, m.n_expert)
    on_gpu: set[int] = set(layers) if kind == "stock-vram" else set()
    if kind == "n-cpu-moe" and gpu_layers is not None:
        on_gpu = set(gpu_layers)
    elif kind == "n-cpu-moe":
        if budget is None:
            raise UsageError("the n-cpu-moe baseline needs the VRAM budget")
        left = budget
        for il in layers:
            whole = m.n_expert * bytes_per_expert[il]
            if whole > left:
                break
            on_gpu.add(il)
            left -= whole
    ids = trace.ids.astype(np.int32)
    pos = {il: j for j, il in enumerate(layers)}
    decode_s, ttft, first, n_decode = 0.0, [], None, 0
    for rows in micro_batches(trace):
        n_tok = rows.stop - rows.start
        dt = 0.0
        for il in layers:
            need = len(set(ids[rows, pos[il]].ravel().tolist()))
            dt += costs.layer(n_tok)  # attention and router on the GPU, then the experts wherever they are
            if il in on_gpu:
                dt += costs.experts(il, need)
            elif n_tok >= OP_OFFLOAD_MIN_TOKENS:
                dt += costs.native_upload(il) + costs.experts(il, need)
            else:  # the scheduler splits the graph there: activations to the host and back, a device sync
                dt += costs.hook() + costs.cpu(il, need)
        if trace.stage[rows.start] == STAGE_PREFILL:
            first = (first or 0.0) + dt
        else:
            decode_s += dt
            n_decode += 1
            if first is not None:
                ttft.append(first + dt)
                first = None
    return BaselineResult(kind, len(on_gpu), decode_s / max(n_decode, 1), float(np.mean(ttft)) if ttft else None)
