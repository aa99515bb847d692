"""Per-layer use counts and recency: the bookkeeping that frequency- and recency-based policies share.

Time is counted per MoE layer, in that layer's routed calls (one per micro-batch, so one per token while
decoding), not in the cache's global ``clock`` (one per routed call of any layer): "128 accesses" then means
128 tokens of decode whatever the number of layers.
"""

from __future__ import annotations


class LayerUsage:
    """For each layer: how many calls it had; for each expert: how many of them used it and the last one."""

    def __init__(self, n_expert: int, layers: list[int]) -> None:
        self.calls = dict.fromkeys(layers, 0)  # il -> routed calls so far
        self.count = {il: [0] * n_expert for il in layers}  # il -> [n_expert] calls that used the expert
        self.last = {il: [0] * n_expert for il in layers}  # il -> [n_expert] call number of the last use, 0: never

    def record(self, il: int, experts: list[int]) -> int:
        """Layer ``il`` had a call using ``experts``; returns that call's number (1 for the first)."""
        n = self.calls[il] + 1
        self.calls[il] = n
        count, last = self.count[il], self.last[il]
        for e in experts:
            count[e] += 1
            last[e] = n
        return n
