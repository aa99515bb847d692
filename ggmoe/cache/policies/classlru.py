"""ClassLRU: recency scaled by a power-of-two frequency class, kept across evictions.

Each expert of a layer has a use count that decays with a half-life of ``HALF_LIFE`` = 128 calls of its layer
(tokens, while decoding) and survives the expert's eviction, so an expert that comes back is recognised. The
count puts the expert in one of ``N_CLASS`` = 8 classes, ``class = min(7, floor(log2(count)))`` (0 below a
count of 2, i.e. used about once lately); the victim is the candidate with the largest ``age / 2**class``,
``age`` being the layer's calls since its last use: an expert of class c may stay 2**c times longer unused
than one of class 0. Ties: lowest id. An expert never used (only prefetched) has count 0 and the age of the
layer's whole history.

Source: the issue describing llama.cpp's ``--moe-cache-mib`` ClassLRU. The copy of llama.cpp's
``src/llama-moe-cache.cpp`` that could be read here (ggml-org/llama.cpp at 4b060f27) has only the exact LRU
(``moe_cache_lru``: one list per group of layers, hits touched first, misses taking the head in ascending
expert order); what is matched from it is the unit (per-layer calls, the same for hits and misses) and that
only layer calls on the cache count. The decay, the classes and the score follow the issue's definition.
"""

from __future__ import annotations

import math

from ggmoe.base.params import Param
from ggmoe.cache.policies.base import POLICIES, Policy

HALF_LIFE = 128.0  # calls of a layer after which an expert's count has halved
N_CLASS = 8  # frequency classes 0..7


def frequency_class(count: float, n_class: int = N_CLASS) -> int:
    """floor(log2(count)) clamped to [0, n_class - 1] (exact for powers of two: frexp, not log2)."""
    if count < 1.0:
        return 0
    return min(n_class - 1, math.frexp(count)[1] - 1)


@POLICIES.register("classlru")
class ClassLRU(Policy):
    """llama.cpp's ClassLRU: evict the largest age / 2^class (class: log2 of a count with a 128-call half-life)."""

    PARAMS = (Param("half_life", float, low=0.0, high=1e12, low_open=True,
                    help="calls of a layer after which a count has halved"),)

    def __init__(self, n_expert: int, layers: list[int], half_life: float = HALF_LIFE) -> None:
        super().__init__(n_expert, layers)
        self.half_life = half_life
        self.calls = dict.fromkeys(layers, 0)  # il -> routed calls so far
        self.count = {il: [0.0] * n_expert for il in layers}  # il -> [n_expert] decayed count at ``stamp``
        self.stamp = {il: [0] * n_expert for il in layers}  # il -> [n_expert] call the count was decayed to
        self.last = {il: [0] * n_expert for il in layers}  # il -> [n_expert] call of the last use, 0: never

    def decayed(self, il: int, expert: int, now: int) -> float:
        """The expert's count decayed to call ``now``."""
        return self.count[il][expert] * 2.0 ** (-(now - self.stamp[il][expert]) / self.half_life)

    def on_access(self, il: int, experts: list[int], clock: int) -> None:
        n = self.calls[il] + 1
        self.calls[il] = n
        for e in experts:
            self.count[il][e] = self.decayed(il, e, n) + 1.0
            self.stamp[il][e] = n
            self.last[il][e] = n

    def score(self, il: int, expert: int) -> float:
        """age / 2**class at the layer's current call count; the largest is evicted."""
        now = self.calls[il]
        age = now - self.last[il][expert]
        return age / 2.0 ** frequency_class(self.decayed(il, expert, now))

    def victim(self, il: int, candidates: list[int], clock: int) -> int:
        return min(candidates, key=lambda e: (-self.score(il, e), e))
