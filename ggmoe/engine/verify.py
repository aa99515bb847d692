"""Independent check of the gate hook: recompute every router in numpy.

For each hooked event, the router of that layer applied to the hooked MoE input
must give the hooked ids (as sets per token; a swap between two experts whose
selection scores differ by less than ``tie_tol`` is a numerical tie, not an error),
probabilities close to the hooked ones and, where the hook hands them (gpt-oss),
logits close to the hooked ones. The router follows the model's gating
(``ggmoe.inspect.gating``), so this checks that too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.engine.engine import Engine
from ggmoe.inspect.router import Router


@dataclass(frozen=True)
class HookCheck:
    n_layers: int  # MoE layers that fired
    n_rows: int  # token x layer rows compared
    n_mismatch: int  # rows whose id sets differ beyond a numerical tie
    n_ties: int  # rows whose id sets differ only at a near tie
    max_prob_diff: float  # max |p_hook - p_numpy|
    max_logit_diff: float = 0.0  # max |logit_hook - logit_numpy| where the hook hands logits

    @property
    def ok(self) -> bool:
        return self.n_rows > 0 and self.n_mismatch == 0 and self.max_prob_diff < 1e-2 and self.max_logit_diff < 1e-2


def check_hook(engine: Engine, routers: dict[int, Router], prompt_ids: list[int], n_expert_used: int,
               tie_tol: float = 1e-3) -> HookCheck:
    rec = RouteRecorder(HookRequest(probs=True, hidden=True))
    with engine.observing(rec):
        engine.reset()
        engine.decode(prompt_ids, all_logits=True)  # else the last layer routes one token
        events = rec.take()
    rows = mismatch = ties = 0
    max_diff = max_logit = 0.0
    for il, ev in events.items():
        router = routers[il]
        max_diff = max(max_diff, float(np.abs(router.probs(ev.hidden) - ev.probs).max()))
        if ev.logits is not None:
            max_logit = max(max_logit, float(np.abs(router.logits(ev.hidden) - ev.logits).max()))
        score = router.selection_scores(ev.hidden)
        want = router.topk(ev.hidden, n_expert_used)
        for t in range(ev.n_tokens):
            rows += 1
            a, b = set(ev.ids[t].tolist()), set(want[t].tolist())
            if a == b:
                continue
            # A tie: the experts that differ score within tie_tol of the k-th best score.
            kth = np.sort(score[t])[-n_expert_used]
            if all(abs(score[t, e] - kth) <= tie_tol for e in a ^ b):
                ties += 1
            else:
                mismatch += 1
    return HookCheck(n_layers=len(events), n_rows=rows, n_mismatch=mismatch, n_ties=ties, max_prob_diff=max_diff,
                     max_logit_diff=max_logit)
