"""tinylfu (ggmoe.cache.policies.tinylfu): LRU eviction behind a frequency filter on admissions, by hand."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache import ExpertCache
from ggmoe.cache.copy import NullCopyBackend
from ggmoe.cache.policies import POLICIES, make_policy
from ggmoe.cache.policies.tinylfu import TinyLFU

pytestmark = pytest.mark.unit


def _policy(uses: list[list[int]], age: float = 1000.0) -> TinyLFU:
    p = TinyLFU(8, [0], age=age)
    for clock, experts in enumerate(uses):
        p.on_access(0, experts, clock)
    return p


# (uses in order, wanting, victims, free slots, admitted in order)
ADMIT = [
    ([[1], [1], [2]], [3, 4], [1, 2], 2, [3, 4]),  # free slots: everything, the most used first (ties by id)
    ([[4], [4], [3]], [3, 4], [1, 2], 1, [4, 3]),  # the free slot to the most used; 3 (1 use) beats victim 1 (none)
    ([[1], [1], [2], [3]], [3], [1, 2], 0, []),  # 3 (1 use) against LRU's victim 1 (2 uses): refused
    ([[2], [1], [3], [3]], [3], [1, 2], 0, [3]),  # 3 (2 uses) against LRU's victim 2 (1 use, used longest ago)
    ([[2], [1], [3], [3], [4], [4]], [3, 4], [1, 2], 0, [3, 4]),  # each against the next victim: 2, then 1
    ([[1], [1], [2], [3], [3]], [3], [1, 2], 0, []),  # a tie (2 uses against 1's 2) keeps the resident
]


@pytest.mark.parametrize(("uses", "wanting", "victims", "n_free", "want"), ADMIT)
def test_admission_by_hand(uses, wanting, victims, n_free, want):
    assert _policy(uses).admit(0, wanting, victims, n_free) == want


def test_counts_halve_every_window_and_eviction_is_lru():
    p = _policy([[1, 2]] * 4, age=1.0)  # a window of 8 accesses (8 experts x 1)
    assert p.freq[0][1] == 2.0 and p.seen[0] == 0  # 4 uses, halved once at the 8th access
    p.on_access(0, [3], 10)
    assert p.victims(0, [1, 2, 3], 2, 11) == [1, 2]  # the oldest first, as LRU


def test_its_age_is_checked_and_it_is_registered():
    assert POLICIES.get("tinylfu") is TinyLFU
    assert make_policy("tinylfu", 8, [0], {"age": 4}).window == 32
    with pytest.raises(UsageError, match="age"):
        make_policy("tinylfu", 8, [0], {"age": 0.5})


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("tinylfu", True)])
def test_an_expert_used_once_does_not_evict_one_used_often(policy, kept):
    """The async decode's step: experts 0 and 1 used every token fill the layer's two slots; a token then
    reads 0 and 5 (5 read in place). LRU admits 5 over 1; tinylfu keeps 1 (used 4 times, 5 once)."""
    cache = ExpertCache(8, 2, {0: 2}, make_policy(policy, 8, [0]), NullCopyBackend(), bytes_per_expert={0: 10})
    for _ in range(4):
        cache.after_token(0, [0, 1])
    admitted = cache.stats.layers[0].admission_copies
    cache.after_token(0, [0, 5])
    assert (cache.tables[0].slot_of_list[1] >= 0) is kept
    assert cache.stats.layers[0].admission_copies - admitted == (0 if kept else 1)
