"""How big the expert cache is: slots per layer, or a VRAM budget spread evenly."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ggmoe.base.errors import UsageError

if TYPE_CHECKING:
    from ggmoe.inspect.facts import ModelFacts


class PrefetchSettings(Protocol):
    """What a cache's configuration holds of its stride prefetch (``ggmoe.control.prefetch.PrefetchConfig``,
    which lives above ``cache/``): read-only."""

    @property
    def predictor(self) -> str: ...  # a registered predictor name or a PRED.npz file
    @property
    def stride(self) -> int: ...  # MoE layers ahead
    @property
    def n_prefetch(self) -> int | None: ...  # experts prefetched per target layer (None: the default)
    @property
    def threshold(self) -> float | None: ...  # prefetch only experts whose score reaches this
    @property
    def train(self) -> tuple[str, ...]: ...  # training traces of a predictor that learns
    @property
    def background(self) -> bool: ...  # predict on a worker thread
    @property
    def state(self) -> Mapping[str, Any] | None: ...  # what a data-driven predictor learnt before
    @property
    def in_graph(self) -> bool: ...  # the predictor's nets in the decode graph when it has them


class PlannerSettings(Protocol):
    """What a cache's configuration holds of its planner between tokens (``ggmoe.control.planner.PlannerConfig``)."""

    @property
    def predictor(self) -> str: ...  # a cross-token predictor name or a PRED.npz file
    @property
    def n_protect(self) -> int | None: ...  # experts planned per layer (None: the default)
    @property
    def train(self) -> tuple[str, ...]: ...
    @property
    def state(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class CacheConfig:
    """How big the expert cache is and how it evicts: slots per layer, or a VRAM budget."""

    n_slots: int | None = None  # slots per MoE layer
    layer_slots: Mapping[int, int] | None = None  # slots of each MoE layer (a plan's uneven split)
    vram_bytes: int | None = None  # budget in bytes for all layers' slots (spread evenly)
    policy: str = "lru"
    # Tests and benchmarks only: copies run on a worker thread after this many seconds each (a slow link
    # simulated on a CPU-only machine, so readiness and priorities meet real concurrency). None: direct.
    copy_delay_s: float | None = None
    # what to do with an expert that is not on the device: wait for its copy, compute it on the CPU, or
    # whichever the measured cost model says is sooner (ggmoe.cache.miss)
    miss_policy: str = "wait"
    # the host path's CPU part on a worker of this many threads beside the device part (0: in the main graph,
    # after it); None: the build's default (ggmoe.engine.host_part: the context's threads on a GPU, 0 on the CPU
    # build; GGMOE_HOST_THREADS overrides it)
    host_threads: int | None = None
    # the auto miss policy's cost model: a hardware profile name or TOML file; None: measured at startup
    hw_profile: str | None = None
    # stride prefetching from a predictor (ggmoe.control.prefetch.PrefetchConfig), or None
    prefetch: PrefetchSettings | None = None
    # the planner between tokens: a cross-token predictor (ggmoe.control.planner.PlannerConfig), or None
    planner: PlannerSettings | None = None
    # the policy's keyword arguments (e.g. static's per-layer counts from saved routing statistics)
    policy_options: Mapping[str, Any] | None = None
    # sync (the route op per MoE layer), async (the expert table, no sync on the decode path) or auto
    # (ggmoe.cache.decode_mode)
    decode_mode: str = "auto"
    # the async decode's in-graph fills (patch 0012): the graph copies a layer's misses into free slots and reads
    # them there, so a miss crosses the link once; False: misses are read in place, then admitted (twice)
    fills: bool = True
    # MoEpic's split: the share θ of each named MoE layer's neurons whose top segment a slot holds (the rest is
    # read from host memory or prefetched); layers not named, and θ = 1, cache whole experts (ggmoe.cache.split)
    layer_theta: Mapping[int, float] | None = None
    # saved routing statistics' counts (il -> [n_expert] tokens that chose each expert; --stats-in): auto's
    # weighing of the decode modes takes each layer's misses from them instead of uniform routing
    routing_counts: Mapping[int, Any] | None = None
    # the host tier's budget in bytes (--host-ram; ggmoe.cache.tiers): when it holds fewer than every expert, the
    # experts stay in the model file (the disk tier) and the host tier reads them from there; None: what the
    # machine can pin, less a margin (a model that fits keeps every expert in host memory, as without a tier)
    host_ram: int | None = None
    # no cache size was given and the experts exceed the host budget: the engine splits that budget between the
    # GPU tier and the host tier for the machine it runs on (``ggmoe.engine.loader.resolve_tiers``)
    auto_tiers: bool = False

    def __post_init__(self) -> None:
        """The policy's options checked against what it declares (ggmoe.base.params), before anything is built;
        a prefetch threshold that is not a finite number refused (nan would silently prefetch nothing)."""
        threshold = self.prefetch.threshold if self.prefetch is not None else None
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                                      or not math.isfinite(threshold)):
            raise UsageError(f"prefetch threshold {threshold!r} is not a finite number")
        if self.host_threads is not None and (isinstance(self.host_threads, bool)
                                              or not isinstance(self.host_threads, int) or self.host_threads < 0):
            raise UsageError(f"host_threads {self.host_threads!r}: a whole number of threads >= 0 "
                             "(0: the host part in the main graph)")
        for il, t in (self.layer_theta or {}).items():
            if isinstance(il, bool) or not isinstance(il, int) or il < 0:
                raise UsageError(f"top share θ for layer {il!r}: layers are numbers >= 0")
            if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 <= t <= 1:
                raise UsageError(f"layer {il}: top share θ = {t!r}; it must be a number from 0 to 1")
        if self.policy_options:
            from ggmoe.base.params import check_params
            from ggmoe.cache.policies import POLICIES

            check_params(f"policy {self.policy!r}", POLICIES.get(self.policy).PARAMS, self.policy_options)

    def check_model(self, facts: ModelFacts) -> None:
        """This configuration against a model's facts, before the model loads: per-layer slots and top shares
        name its MoE layers, every split is possible, a budget gives enough slots (UsageError otherwise)."""
        from ggmoe.cache.split import model_split

        split = model_split(facts, self.layer_theta)
        self.slots({il: split[il].top_bytes if il in split else facts.bytes_per_expert(il) for il in facts.moe_layers},
                   facts.n_expert, facts.n_expert_used)

    def slots(self, bytes_per_expert: dict[int, int], n_expert: int, n_expert_used: int) -> dict[int, int]:
        """Slots of each MoE layer, each in [n_expert_used, n_expert]: checked before any slot is allocated."""
        given = [x is not None for x in (self.n_slots, self.vram_bytes, self.layer_slots)]
        if sum(given) != 1:
            raise UsageError("give the cache size as slots per layer, per-layer slots or a VRAM budget: one of them")
        if self.layer_slots is not None:
            missing = sorted(set(bytes_per_expert) - set(self.layer_slots))
            extra = sorted(set(self.layer_slots) - set(bytes_per_expert))
            if missing or extra:
                raise UsageError(f"the per-layer slots name MoE layers {sorted(self.layer_slots)}; the model's are "
                                 f"{sorted(bytes_per_expert)}")
            out = {il: self.layer_slots[il] for il in bytes_per_expert}
        elif self.n_slots is not None:
            out = dict.fromkeys(bytes_per_expert, self.n_slots)
        else:
            return slots_for_budget(self.vram_bytes, bytes_per_expert, n_expert, n_expert_used)
        for il, n in out.items():
            if isinstance(n, bool) or not isinstance(n, int) or not n_expert_used <= n <= n_expert:
                raise UsageError(f"layer {il}: {n!r} cache slots; the model needs an integer from n_expert_used = "
                                 f"{n_expert_used} to n_expert = {n_expert}")
        return out


def slots_for_budget(budget: int, bytes_per_expert: dict[int, int], n_expert: int,
                     n_expert_used: int) -> dict[int, int]:
    """Spread a VRAM budget (bytes) for cached experts evenly over the MoE layers: slots per layer."""
    per_slot = sum(bytes_per_expert.values())  # bytes of one slot in every layer
    n = min(budget // per_slot, n_expert) if per_slot else n_expert
    if n < n_expert_used:
        raise UsageError(f"a budget of {budget} bytes gives {n} slots per layer; at least n_expert_used = "
                         f"{n_expert_used} are needed ({n_expert_used * per_slot} bytes)")
    return {il: int(n) for il in bytes_per_expert}


def build_cache_config(cache_slots: int | None, vram: int | str | None, policy: str | None,
                       facts: ModelFacts | None = None,
                       miss_policy: str | None = None, prefetch: PrefetchSettings | None = None,
                       hw: str | None = None, decode_mode: str | None = None,
                       planner: PlannerSettings | None = None, host_ram: int | str | None = None) -> CacheConfig | None:
    """A CacheConfig from the command line's (or ``ggmoe.load()``'s) options; None when no cache size is given.

    --vram becomes slots per layer in the engine through ``ggmoe.cache.slots_for_budget``: the inverse of
    ``ModelFacts.cache_bytes``, the figures ``ggmoe inspect`` prints.
    """
    auto_tiers = cache_slots is None and vram is None and _larger_than_ram(facts, host_ram)
    if auto_tiers:
        cache_slots = facts.n_expert_used  # the smallest GPU tier until the engine sizes the tiers
    if cache_slots is None and vram is None:
        if prefetch is not None or planner is not None:
            flag = "--predictor" if prefetch is not None else "--plan-predictor"
            raise UsageError(f"{flag} needs a cache size: --cache-slots N or --vram BYTES")
        if host_ram is not None and facts is not None:
            raise UsageError(f"--host-ram {host_ram} holds every expert of this model, so there is no disk tier; "
                             "it sizes the host tier under an expert cache (--cache-slots N or --vram BYTES), "
                             "or drop it")
        given = next((n for n, v in (("--policy", policy), ("--miss-policy", miss_policy),
                                     ("--decode-mode", decode_mode), ("--host-ram", host_ram)) if v is not None),
                     None)
        if given is not None:
            raise UsageError(f"{given} needs a cache size: --cache-slots N or --vram BYTES")
        return None
    from ggmoe.cache.miss import check_miss_policy
    from ggmoe.cache.policies import POLICIES

    if cache_slots is not None and vram is not None:
        raise UsageError("give either --cache-slots or --vram, not both")
    policy = "lru" if policy is None else policy
    POLICIES.get(policy)  # an unknown (or empty) name fails here, listing the choices
    miss = check_miss_policy("wait" if miss_policy is None else miss_policy)
    if hw is not None:
        if miss != "auto":
            raise UsageError("--hw gives the cost model of --miss-policy auto")
        from ggmoe.cache.hardware import load_profile

        load_profile(hw)  # a bad profile fails now, before the model loads
    if vram is not None and facts is not None:  # a budget too small fails now, before the model loads
        slots_for_budget(_bytes(vram), {layer.il: layer.bytes_per_expert for layer in facts.layers},
                         facts.n_expert, facts.n_expert_used)
    if host_ram is not None and facts is not None:  # a host tier too small for a token fails now
        from ggmoe.cache.tiers import tier_sizes

        tier_sizes(facts, 0, _bytes(host_ram))
    from ggmoe.cache.decode_mode import check_decode_mode

    mode = check_decode_mode(decode_mode or "auto")
    return CacheConfig(n_slots=cache_slots, vram_bytes=_bytes(vram) if vram is not None else None,
                       policy=policy, miss_policy=miss, prefetch=prefetch, hw_profile=hw,
                       decode_mode=mode, planner=planner,
                       host_ram=_bytes(host_ram) if host_ram is not None else None, auto_tiers=auto_tiers)


def _larger_than_ram(facts: ModelFacts | None, host_ram: int | str | None) -> bool:
    """Whether the model's experts exceed the host budget (given, or what the machine can pin): it then runs
    with a disk tier even when no cache size was given (loading every expert would exhaust RAM)."""
    if facts is None:
        return False
    from ggmoe.cache.tiers import tier_sizes

    return tier_sizes(facts, 0, None if host_ram is None else _bytes(host_ram)).disk


def _bytes(size: int | str) -> int:
    """A byte count given as an int or as a size string such as ``"4GiB"``."""
    from ggmoe.base.units import parse_bytes

    if isinstance(size, bool) or not isinstance(size, int | str):
        raise UsageError(f"a size must be a number of bytes or a string such as '4GiB', not {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise UsageError(f"a size must be >= 0 bytes, not {size}")
        return size
    return parse_bytes(size)
