"""A run's configuration, made once at the edge (the CLI, ``ggmoe.load()``, a plan file) and handed down: the
cache's size and policy, how a token is decoded around it, the host tier, the prefetch and the planner."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ggmoe.base.errors import UsageError
from ggmoe.cache.config import CacheConfig, slots_for_budget
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.tiers import TierConfig

if TYPE_CHECKING:
    from ggmoe.control.planner import PlannerConfig
    from ggmoe.control.prefetch import PrefetchConfig
    from ggmoe.inspect.facts import ModelFacts


@dataclass(frozen=True)
class RunConfig:
    """Everything a run with an expert cache is built from; each part a record of its own stage."""

    cache: CacheConfig  # slots per layer or a VRAM budget, the eviction policy, MoEpic's top shares
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # decode mode, miss policy, cost model
    tiers: TierConfig = field(default_factory=TierConfig)  # the host tier's budget (the disk tier under it)
    prefetch: PrefetchConfig | None = None  # stride prefetching from a predictor
    planner: PlannerConfig | None = None  # the planner between tokens (a cross-token predictor)
    # tests and benchmarks only: copies run on a worker thread after this many seconds each (a slow link
    # simulated on a CPU-only machine, so readiness and priorities meet real concurrency); None: direct
    copy_delay_s: float | None = None

    def __post_init__(self) -> None:
        """A prefetch threshold that is not a finite number refused (nan would silently prefetch nothing)."""
        threshold = self.prefetch.threshold if self.prefetch is not None else None
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                                      or not math.isfinite(threshold)):
            raise UsageError(f"prefetch threshold {threshold!r} is not a finite number")

    def check_model(self, facts: ModelFacts) -> None:
        """The cache's size and top shares against a model's facts, before the model loads."""
        self.cache.check_model(facts)


def build_run_config(cache_slots: int | None, vram: int | str | None, policy: str | None,
                     facts: ModelFacts | None = None, miss_policy: str | None = None,
                     prefetch: PrefetchConfig | None = None, hw: str | None = None, decode_mode: str | None = None,
                     planner: PlannerConfig | None = None, host_ram: int | str | None = None) -> RunConfig | None:
    """A RunConfig from the command line's (or ``ggmoe.load()``'s) options; None when no cache size is given.

    --vram becomes slots per layer in the engine through ``ggmoe.cache.slots_for_budget``: the inverse of
    ``ModelFacts.cache_bytes``, the figures ``ggmoe inspect`` prints.
    """
    auto_tiers = cache_slots is None and vram is None and _larger_than_ram(facts, host_ram)
    if auto_tiers:
        cache_slots = facts.n_expert_used  # the smallest GPU tier until the engine sizes the tiers
    if cache_slots is None and vram is None:
        _refuse_without_size(facts, policy, miss_policy, prefetch, decode_mode, planner, host_ram)
        return None
    if cache_slots is not None and vram is not None:
        raise UsageError("give either --cache-slots or --vram, not both")
    from ggmoe.cache.decode_mode import check_decode_mode
    from ggmoe.cache.policies import POLICIES

    policy = "lru" if policy is None else policy
    POLICIES.get(policy)  # an unknown (or empty) name fails here, listing the choices
    miss = _check_miss(miss_policy, hw)
    if vram is not None and facts is not None:  # a budget too small fails now, before the model loads
        slots_for_budget(_bytes(vram), {layer.il: layer.bytes_per_expert for layer in facts.layers},
                         facts.n_expert, facts.n_expert_used)
    if host_ram is not None and facts is not None:  # a host tier too small for a token fails now
        from ggmoe.cache.tiers import tier_sizes

        tier_sizes(facts, 0, _bytes(host_ram))
    cache = CacheConfig(n_slots=cache_slots, vram_bytes=_bytes(vram) if vram is not None else None, policy=policy)
    decode = DecodeConfig(mode=check_decode_mode(decode_mode or "auto"), miss_policy=miss, hw_profile=hw)
    tiers = TierConfig(host_ram=_bytes(host_ram) if host_ram is not None else None, auto_tiers=auto_tiers)
    return RunConfig(cache, decode, tiers, prefetch=prefetch, planner=planner)


def _refuse_without_size(facts: ModelFacts | None, policy: str | None, miss_policy: str | None,
                         prefetch: PrefetchConfig | None, decode_mode: str | None, planner: PlannerConfig | None,
                         host_ram: int | str | None) -> None:
    """No cache size: a flag that shapes a cache has nothing to shape (UsageError naming it)."""
    if prefetch is not None or planner is not None:
        flag = "--predictor" if prefetch is not None else "--plan-predictor"
        raise UsageError(f"{flag} needs a cache size: --cache-slots N or --vram BYTES")
    if host_ram is not None and facts is not None:
        raise UsageError(f"--host-ram {host_ram} holds every expert of this model, so there is no disk tier; "
                         "it sizes the host tier under an expert cache (--cache-slots N or --vram BYTES), "
                         "or drop it")
    given = next((n for n, v in (("--policy", policy), ("--miss-policy", miss_policy),
                                 ("--decode-mode", decode_mode), ("--host-ram", host_ram)) if v is not None), None)
    if given is not None:
        raise UsageError(f"{given} needs a cache size: --cache-slots N or --vram BYTES")


def _check_miss(miss_policy: str | None, hw: str | None) -> str:
    """The miss policy asked for (wait when none), and ``--hw`` only as auto's cost model, loaded now."""
    from ggmoe.cache.miss import check_miss_policy

    miss = check_miss_policy("wait" if miss_policy is None else miss_policy)
    if hw is not None:
        if miss != "auto":
            raise UsageError("--hw gives the cost model of --miss-policy auto")
        from ggmoe.cache.hardware import load_profile

        load_profile(hw)  # a bad profile fails now, before the model loads
    return miss


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
