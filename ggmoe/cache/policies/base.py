"""Eviction policies of the expert cache: which resident expert of a layer gives up its slot.

A policy only ranks; ``ggmoe.cache.ExpertCache`` owns the slots, decides what is
a hit or a miss, and never offers as victims the experts the current layer call
is using. Events, in order, per layer call: ``on_insert`` for each expert copied
in, ``on_evict`` for each one pushed out, ``on_access`` with the call's experts,
then ``release`` (what to drop right away: on-demand drops everything).
A caller that knows the future (the simulator replaying a trace) passes the
next-use time of the layer's experts through ``set_future`` before the call;
Belady uses it. Policies register in ``POLICIES`` by name, the built-ins too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from ggmoe.base.params import Param, check_params
from ggmoe.base.registry import Registry


class Policy(ABC):
    name: ClassVar[str]
    # True: the policy ranks by next use and needs ``set_future`` before each call (the simulator replaying a
    # trace gives it); a live engine cannot, and should refuse such a policy before it loads a model
    needs_future: ClassVar[bool] = False
    # the keyword options of __init__ after (n_expert, layers), with types and bounds (ggmoe.base.params):
    # policy_options and plan files are checked against them before any policy is built
    PARAMS: ClassVar[tuple[Param, ...]] = ()

    def __init__(self, n_expert: int, layers: list[int]) -> None:
        self.n_expert = n_expert
        self.layers = list(layers)

    def on_access(self, il: int, experts: list[int], clock: int) -> None:  # noqa: B027 - optional hook
        """Distinct experts (ascending) used by layer ``il`` at access number ``clock`` (hits and misses)."""

    def on_insert(self, il: int, expert: int, clock: int) -> None:  # noqa: B027 - optional hook
        """``expert`` was loaded into a slot of layer ``il``."""

    def on_evict(self, il: int, expert: int) -> None:  # noqa: B027 - optional hook
        """``expert`` left its slot of layer ``il``."""

    def set_future(self, il: int, next_use: Mapping[int, float] | None) -> None:  # noqa: B027 - optional hook
        """Next-use time (access number, or inf for never) of layer ``il``'s experts, when the caller knows it."""

    def admit(self, il: int, wanting: list[int], victims: list[int], n_free: int) -> list[int]:
        """Which of ``wanting`` (missing experts a call served without a slot: the async decode's, read in
        place, and the host path's, computed on the CPU) to copy in for later calls, given ``n_free`` free slots
        and ``victims``, the resident experts that may be evicted (ascending). Asked only where skipping a copy
        costs the call nothing; the cache then evicts by ``victims``/``victim`` as always. Default: all."""
        return wanting

    def admit_scores(self, il: int) -> list[float] | None:
        """The in-graph fills' form of ``admit`` (``ggmoe.cache.fill``): per expert of layer ``il`` a score, such
        that a miss may take a victim's slot only when its score is above the victim's (free slots take any).
        None (the default): every miss may take any fill slot."""
        return None

    def release(self, il: int, resident: list[int]) -> list[int]:
        """Experts of ``resident`` to drop at the end of a layer call (none: keep them for reuse)."""
        return []

    @abstractmethod
    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        """Pick one of ``candidates`` (resident experts of layer ``il``, ascending, n >= 1) to evict."""

    def victims(self, il: int, candidates: list[int], n: int, clock: int) -> list[int]:
        """The first ``n`` of ``candidates`` that ``victim`` would pick one after another, each removed before
        the next pick (fewer if there are fewer). A policy overrides it (one sort instead of a scan per pick)
        only where the picks equal that sequence although ``on_evict`` and ``on_insert`` run between them:
        the cache then asks it once per call instead of ``victim`` per eviction."""
        cand, out = list(candidates), []
        while cand and len(out) < n:
            out.append(self.victim(il, cand, clock))
            cand.remove(out[-1])
        return out


POLICIES: Registry[Policy] = Registry("policy")


def make_policy(name: str, n_expert: int, layers: list[int], options: Mapping[str, object] | None = None) -> Policy:
    """The policy ``name`` for these layers, its ``options`` checked against its ``PARAMS`` first."""
    cls = POLICIES.get(name)
    return cls(n_expert, layers, **check_params(f"policy {name!r}", cls.PARAMS, options))


def releases(policy: Policy) -> bool:
    """Whether ``policy`` drops what it loaded at the end of a call (on-demand): every use is then a miss, whatever
    the slots, and a cache under it never warms."""
    return type(policy).release is not Policy.release
