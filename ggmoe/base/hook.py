"""Gate-hook records: what the router of one MoE layer decided for one micro-batch.

Pure Python and numpy; the engine produces these from inside ``llama_decode``
and hands them to a ``RouteObserver``. Traces, predictors and the cache all
consume ``RouteEvent`` and never see llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class RouteEvent:
    """One MoE layer's routing for one micro-batch (copies, safe to keep)."""

    il: int  # layer index
    ids: np.ndarray  # [n_tokens, n_expert_used] int32, selected experts in router order
    # [n_tokens, n_expert] float32, router probabilities: the gating's (softmax, sigmoid, ...); for gpt-oss's
    # softmax over the selected experts' logits, the softmax of the logits over every expert
    probs: np.ndarray | None
    hidden: np.ndarray | None  # [n_tokens, n_embd] float32, the MoE layer input
    # [n_tokens, n_scores] float32, the layer's in-graph predictor's logits (None without one)
    scores: np.ndarray | None = None
    # [n_tokens, n_expert] float32, the raw router logits (with the router bias), where the graph hands them on
    # (gpt-oss: ``ggmoe.inspect.gating.Gating.hook_gives_logits``); None otherwise or when probs were not read
    logits: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class HookRequest:
    """Which tensors an observer wants; asking for less costs less per layer."""

    probs: bool = True
    hidden: bool = True


class RouteObserver(Protocol):
    """Receives every MoE layer's routing, in graph order, during a decode. An observer may also have
    ``wants_routing`` (read once per decoded token; absent: True): False tells the async decode's controller
    to build it no events between tokens (the stride prefetcher, which reads the mailbox instead)."""

    request: HookRequest

    def on_route(self, event: RouteEvent) -> None: ...


class RouteRecorder:
    """Collects the events of one ``decode`` call and joins micro-batches per layer."""

    def __init__(self, request: HookRequest | None = None) -> None:
        self.request = request or HookRequest()
        self._events: dict[int, list[RouteEvent]] = {}

    def on_route(self, event: RouteEvent) -> None:
        self._events.setdefault(event.il, []).append(event)

    def take(self) -> dict[int, RouteEvent]:
        """Events since the last take, one per layer, micro-batches concatenated in token order."""
        out = {il: _concat(evs) for il, evs in sorted(self._events.items())}
        self._events = {}
        return out


def _concat(events: list[RouteEvent]) -> RouteEvent:
    if len(events) == 1:
        return events[0]

    def cat(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if any(a is None for a in arrays) else np.concatenate(arrays, axis=0)

    return RouteEvent(
        il=events[0].il,
        ids=np.concatenate([e.ids for e in events], axis=0),
        probs=cat([e.probs for e in events]),
        hidden=cat([e.hidden for e in events]),
        logits=cat([e.logits for e in events]),
    )
