"""Eviction policies of the expert cache: which resident expert of a layer gives up its slot.

A policy only ranks; ``ggmoe.cache.ExpertCache`` owns the slots, decides what is
a hit or a miss, and never offers as victims the experts the current layer call
is using. Policies register in ``POLICIES`` by name (the built-ins too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from ggmoe.registry import Registry


class Policy(ABC):
    name: ClassVar[str]
    # False: nothing survives a layer call (on-demand loading, the no-cache baseline).
    reuse: ClassVar[bool] = True

    def __init__(self, n_expert: int, layers: list[int]) -> None:
        self.n_expert = n_expert
        self.layers = list(layers)

    def on_access(self, il: int, experts: list[int], clock: int) -> None:  # noqa: B027 - optional hook
        """Distinct experts (ascending) used by layer ``il`` at access number ``clock`` (hits and misses)."""

    def on_insert(self, il: int, expert: int, clock: int) -> None:  # noqa: B027 - optional hook
        """``expert`` was loaded into a slot of layer ``il``."""

    def on_evict(self, il: int, expert: int) -> None:  # noqa: B027 - optional hook
        """``expert`` left its slot of layer ``il``."""

    @abstractmethod
    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        """Pick one of ``candidates`` (resident experts of layer ``il``, ascending, n >= 1) to evict."""


POLICIES: Registry[Policy] = Registry("policy")
