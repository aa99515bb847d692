"""The async decode's cache controller: runs on the host between tokens.

After a decode whose micro-batch read its experts through the expert tables,
the engine hands the token's routing here (once per decode, not per layer).
The controller feeds every cached layer's selected experts to the cache
(``ExpertCache.after_token``: hits and host reads counted, landed copies made
readable, misses admitted at low priority with their victims' entries pointed
back at host memory first) and then gives the observers (statistics,
recorder, user hooks) one ``RouteEvent`` per layer. Python decides here; the
engine's copy backend and expert tables execute.

The invariants the engine relies on hold because this runs while no graph
runs (after the decode's logits were read): an entry points back at host
memory before a copy may overwrite its slot, and at a slot only after the
copy into it landed (``SlotTable`` tells the table through its listener).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ggmoe.cache.cache import ExpertCache
from ggmoe.hook import RouteEvent, RouteObserver


class TokenController:
    """Per decoded micro-batch: the routing to the cache, then to the observers."""

    def __init__(self, cache: ExpertCache | None, observers: Iterable[RouteObserver] | None = None) -> None:
        self.cache = cache
        self.observers = observers  # an iterable read on every call (the engine's live list)
        self.tokens = 0  # table-mode micro-batches handled
        self.calls = 0  # layer routings handled (one per MoE layer per micro-batch)

    def on_routing(self, layers: Iterable[int], routing: np.ndarray) -> None:
        """``routing`` I32 [n_layer, n_tokens, n_expert_used]: the selected experts of ``layers`` (the MoE
        layers that read through tables) in the micro-batch just decoded; rows of -1 are tokens a layer did
        not compute (the last layer computes only the tokens whose logits are wanted)."""
        # Once per token, so kept to plain lists: one tolist() for every layer, no numpy per layer (a decode
        # step of the embedded model takes about 1 ms; this loop is most of what the async decode adds to it).
        cache = self.cache
        tables = cache.tables if cache is not None else {}
        self.tokens += 1
        if cache is not None:
            cache.token += 1
        observers = tuple(self.observers) if self.observers is not None else ()
        rows_of = routing.tolist()  # [n_layer][n_tokens][n_expert_used]
        for il in layers:
            rows = rows_of[il]
            if rows[-1][0] < 0:  # the layer computed fewer tokens (llama.cpp's output skipping)
                rows = [r for r in rows if r[0] >= 0]
                if not rows:
                    continue
            self.calls += 1
            if il in tables:
                cache.after_token(il, rows[0] if len(rows) == 1 else [e for r in rows for e in r])
            if observers:
                event = RouteEvent(il=il, ids=np.asarray(rows, dtype=np.int32), probs=None, hidden=None)
                for obs in observers:
                    obs.on_route(event)
