"""The async decode's cache controller: runs on the host between tokens.

After a decode whose micro-batch read its experts through the expert tables,
the engine hands the token's routing here (once per decode, not per layer).
The controller feeds every cached layer's selected experts to the cache
(``ExpertCache.after_token``: hits and host reads counted, landed copies made
readable, misses admitted at low priority with their victims' entries pointed
back at host memory first) and then gives the observers (statistics,
recorder, user hooks) one ``RouteEvent`` per layer. With a planner
(``ggmoe.control.planner``), each layer of a one-token decode is first shown to it (ids, and the MoE
input rows handed in with the routing: the engine's mailbox, the simulator's trace), so that the cache admits
the layer's misses in the order of its plan for the next token and evicts none of the planned
experts. Python decides here; the engine's copy backend and expert tables execute.

The invariants the engine relies on hold because this runs while no graph
runs (after the decode's logits were read): an entry points back at host
memory before a copy may overwrite its slot, and at a slot only after the
copy into it landed: the cache writes each change as a flip, in order, and
``on_routing`` returns them with the copies it issued as one ``StepChanges``
(``ggmoe.cache.step``), which the engine's tables apply before the next graph.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import numpy as np

from ggmoe.base.hook import RouteEvent, RouteObserver
from ggmoe.cache.cache import ExpertCache
from ggmoe.cache.step import EMPTY_STEP, StepChanges
from ggmoe.control.planner import NextTokenPlanner


class TokenController:
    """Per decoded micro-batch: the routing to the planner and the cache, then to the observers."""

    def __init__(self, cache: ExpertCache | None, observers: Iterable[RouteObserver] | None = None,
                 planner: NextTokenPlanner | None = None) -> None:
        self.cache = cache
        self.observers = observers  # read by every call that is handed none (the simulator; the engine hands its own)
        self.planner = planner  # plans each layer's next call before the cache admits (None: no plan)
        self.tokens = 0  # table-mode micro-batches handled
        self.calls = 0  # layer routings handled (one per MoE layer per micro-batch)
        self._cached_layers: tuple[int, ...] | None = None  # the layers read through tables

    def on_routing(self, layers: Iterable[int], routing: np.ndarray, observers: Iterable[RouteObserver] | None = None,
                   hidden: Mapping[int, np.ndarray] | None = None) -> StepChanges:
        """``routing`` I32 [n_layer, n_tokens, n_expert_used]: the selected experts of ``layers`` (the MoE
        layers that read through tables) in the micro-batch just decoded; rows of -1 are tokens a layer did
        not compute (the last layer computes only the tokens whose logits are wanted). Returns the cache's step:
        the table flips and copies it decided since the last step, for the executor. ``observers``: this step's
        observers, handed over as data (None: those given at construction). ``hidden``: il -> the decoded
        token's MoE input row [n_embd] float32, for a planner whose predictor reads them (``wants_hidden``)."""
        # Once per token, so kept to plain lists: one tolist() for every layer, no numpy per layer (a decode
        # step of the embedded model takes about 1 ms; this loop is most of what the async decode adds to it).
        cache = self.cache
        tables = cache.tables if cache is not None else {}
        self.tokens += 1
        if cache is not None:
            cache.token += 1
        if observers is None:
            observers = self.observers
        observers = _wanting_routing(observers) if observers is not None else ()
        rows_of = routing.tolist()  # [n_layer][n_tokens][n_expert_used]
        planner = self.planner  # a plan follows one decoded token (not a prefill's last micro-batch)
        if planner is not None and (routing.shape[1] != 1 or not planner.decoding):
            planner = None
        if cache is not None and planner is None and not observers and routing.shape[1] == 1:
            if self._cached_layers is None:  # the cached layers (the same every call)
                self._cached_layers = tuple(il for il in layers if il in tables)
            self.calls += cache.after_one_token(self._cached_layers, rows_of)  # one call a token: nothing else reads
            return cache.take_step()
        for il in layers:
            rows = rows_of[il]
            if rows[-1][0] < 0:  # the layer computed fewer tokens (llama.cpp's output skipping)
                rows = [r for r in rows if r[0] >= 0]
                if not rows:
                    continue
            self.calls += 1
            if planner is not None:
                row = hidden.get(il) if hidden is not None and planner.predictor.needs_hidden else None
                planner.observe(il, np.asarray(rows[0], dtype=np.int32), None, row)
            if il in tables:
                cache.after_token(il, rows[0] if len(rows) == 1 else [e for r in rows for e in r])
            if observers:
                event = RouteEvent(il=il, ids=np.asarray(rows, dtype=np.int32), probs=None, hidden=None)
                for obs in observers:
                    obs.on_route(event)
        return cache.take_step() if cache is not None else EMPTY_STEP

    def on_identity_token(self, layers: Collection[int], observers: Iterable[RouteObserver]) -> StepChanges | None:
        """``on_routing`` of a one-token decode whose cached ``layers`` were all read with identity (every expert
        in its own slot), where nothing reads the routing (no planner, no observer that wants it): the cache
        counts the hits without the routing being read. None where something does: call ``on_routing``."""
        cache = self.cache
        if cache is None or not cache.roomy or self.planner is not None or _wanting_routing(observers):
            return None
        self.tokens += 1
        cache.token += 1
        self.calls += len(layers)
        cache.after_identity_token(layers)
        return cache.take_step()

    def wants_hidden(self, n_tokens: int) -> bool:
        """Whether ``on_routing`` of a micro-batch of ``n_tokens`` reads the MoE input rows (a planner whose
        predictor reads them, after a one-token decode): the caller gathers them only then."""
        planner = self.planner
        return planner is not None and n_tokens == 1 and planner.decoding and planner.predictor.needs_hidden


def _wanting_routing(observers: Iterable[RouteObserver]) -> tuple[RouteObserver, ...]:
    """The observers that read the routing (an observer says otherwise with ``wants_routing = False``)."""
    return tuple(o for o in observers if getattr(o, "wants_routing", True))
