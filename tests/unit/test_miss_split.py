"""The balanced split of a layer's misses between the link and the CPU (``miss.split_misses``), and ``auto``
using it in the cache where the CPU runs beside the link."""

from __future__ import annotations

import pytest

from ggmoe.cache import ExpertCache
from ggmoe.cache.miss import SLOT_HOST, MissCosts, effective_miss_policy, host_path_pays_beside, split_misses
from ggmoe.cache.policies import POLICIES

pytestmark = pytest.mark.unit

US = 1e-6


def _finish(n: int, k: int, copy_s: float, cpu_s: float, link_busy: float, cpu_busy: float) -> float:
    return max(link_busy + (n - k) * copy_s, cpu_busy + k * cpu_s)


@pytest.mark.parametrize("n, copy_us, cpu_us, link_busy_us, cpu_busy_us, want", [
    (0, 200, 100, 0, 0, 0),  # nothing missed
    (6, 200, 200, 0, 0, 3),  # equal servers: half each
    (6, 224, 116, 0, 0, 4),  # the rtx4090 composed profile's Q4_K expert: the CPU takes two thirds
    (6, 100, 1000, 0, 0, 0),  # a CPU ten times slower: one expert there (1000) outlasts six copies (600)
    (6, 1000, 100, 0, 0, 6),  # a link ten times slower: six on the CPU (600) beat one copy (1000)
    (12, 1000, 100, 0, 0, 11),  # twelve: one copy beside eleven on the CPU
    (1, 200, 200, 0, 0, 0),  # a tie: the copy, which also caches the expert
    (4, 100, 100, 400, 0, 4),  # the link is busy with copies this call waits for: the CPU takes them all
    (4, 100, 100, 0, 300, 0),  # the CPU is busy with copies it took over: the link takes them all
    (5, 100, 100, 100, 0, 3),  # some of both
    (6, 0.0, 100, 0, 0, 0),  # a free link
    (6, 100, 0.0, 0, 0, 6),  # a free CPU
    (6, 0.0, 0.0, 0, 0, 0),  # both free: no host path
])
def test_split_misses(n, copy_us, cpu_us, link_busy_us, cpu_busy_us, want):
    k = split_misses(n, copy_us * US, cpu_us * US, link_busy_us * US, cpu_busy_us * US)
    assert k == want
    best = min(_finish(n, j, copy_us, cpu_us, link_busy_us, cpu_busy_us) for j in range(n + 1))
    assert _finish(n, k, copy_us, cpu_us, link_busy_us, cpu_busy_us) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(5))
def test_split_misses_is_the_best_of_every_split(seed):
    import random

    rng = random.Random(seed)
    for _ in range(200):
        n = rng.randrange(0, 12)
        copy_s, cpu_s = rng.uniform(0, 1e-3), rng.uniform(0, 1e-3)
        lb, cb = rng.choice([0.0, rng.uniform(0, 2e-3)]), rng.choice([0.0, rng.uniform(0, 2e-3)])
        k = split_misses(n, copy_s, cpu_s, lb, cb)
        assert 0 <= k <= n
        best = min(_finish(n, j, copy_s, cpu_s, lb, cb) for j in range(n + 1))
        assert _finish(n, k, copy_s, cpu_s, lb, cb) == pytest.approx(best, abs=1e-15)


def _costs(copy_us: float, cpu_us: float, nbytes: int = 1000) -> MissCosts:
    return MissCosts(copy_bytes_per_s=nbytes / (copy_us * US), copy_latency_s=0.0, cpu_bytes_per_s=nbytes / (cpu_us * US))


@pytest.mark.parametrize("copy_us, cpu_us, k, beside, idle_link_pays", [
    (100, 300, 4, True, False),  # a slower CPU still takes a share of four misses beside the link
    (100, 300, 1, False, False),  # one miss: the copy alone is sooner
    (100, 90, 1, True, True),
])
def test_host_path_pays_beside(copy_us, cpu_us, k, beside, idle_link_pays):
    costs = _costs(copy_us, cpu_us)
    assert host_path_pays_beside(costs, {0: 1000}, k) == beside
    assert host_path_pays_beside(None, {0: 1000}, k)
    assert effective_miss_policy("auto", costs, {0: 1000}, beside_k=k)[0] == ("auto" if beside else "wait")
    assert effective_miss_policy("auto", costs, {0: 1000})[0] == ("auto" if idle_link_pays else "wait")


def _cache(costs: MissCosts, beside: bool, policy: str = "auto") -> ExpertCache:
    cache = ExpertCache(16, 4, {0: 8}, POLICIES.get("lru")(16, [0]), bytes_per_expert={0: 1000},
                        miss_policy=policy, costs=costs)
    cache.cpu_beside_link = beside
    return cache


@pytest.mark.parametrize("copy_us, cpu_us, policy, beside, n_host", [
    (200, 200, "auto", True, 2),  # equal servers beside each other: half of four misses each
    (200, 200, "auto", False, 0),  # in turn: the CPU is not sooner for any one miss, all wait
    (300, 100, "auto", True, 3),  # a faster CPU: three of four
    (300, 100, "auto", False, 4),  # in turn: each miss to the sooner CPU
    (200, 200, "wait", True, 0),  # wait and cpu do as they say, beside the link or not
    (200, 200, "cpu", True, 4),
])
def test_the_cache_splits_misses_only_beside_the_link(copy_us, cpu_us, policy, beside, n_host):
    cache = _cache(_costs(copy_us, cpu_us), beside, policy)
    slots = cache.route_flat(0, [3, 1, 7, 5])
    assert sum(s == SLOT_HOST for s in slots) == n_host
    assert cache.stats.layers[0].host_computed == n_host
    # the highest ids go to the CPU (a fixed choice: replays reproduce it)
    if policy == "auto" and beside:
        assert {e for e, s in zip([3, 1, 7, 5], slots, strict=True) if s == SLOT_HOST} == set([7, 5, 3, 1][:n_host])


class _WaitSpy:
    """Copies that land at once, and the order in which the cache waited for them."""

    def __init__(self) -> None:
        from ggmoe.cache.copy import NullCopyBackend

        self.inner = NullCopyBackend()
        self.waited: list[list[int]] = []

    def submit(self, il, expert, slot, priority, rank=0.0):
        return self.inner.submit(il, expert, slot, priority, rank)

    def done(self, handle) -> bool:
        return self.inner.done(handle)

    def wait(self, handles) -> None:
        self.waited.append(sorted(h.expert for h in handles))

    def cancel(self, handle) -> bool:
        return self.inner.cancel(handle)

    def close(self) -> None:
        self.inner.close()


def _deferring_cache(defer: bool) -> tuple[ExpertCache, _WaitSpy]:
    spy = _WaitSpy()
    cache = ExpertCache(16, 4, {0: 8}, POLICIES.get("lru")(16, [0]), copies=spy, bytes_per_expert={0: 1000},
                        miss_policy="auto", costs=_costs(200, 200))
    cache.cpu_beside_link = True
    cache.defer_wait = defer
    return cache, spy


@pytest.mark.parametrize("defer", [True, False])
def test_a_call_with_cpu_entries_waits_in_the_wait_hook_when_deferred(defer):
    """Beside the link, half of four misses go to the CPU and half are copied; deferred, the call answers its
    slots without waiting and ``finish_wait`` waits (the engine's wait hook, after the CPU part started)."""
    cache, spy = _deferring_cache(defer)
    slots = cache.route_flat(0, [3, 1, 7, 5])
    assert sum(s == SLOT_HOST for s in slots) == 2
    copied = sorted(e for e, s in zip([3, 1, 7, 5], slots, strict=True) if s != SLOT_HOST)
    assert spy.waited == ([] if defer else [copied])
    assert cache.stats.layers[0].deferred_waits == int(defer)
    cache.finish_wait(0)
    assert spy.waited == [copied] and not cache.deferred
    cache.finish_wait(0)  # nothing left: a second hook call does nothing
    assert spy.waited == [copied]


def test_a_deferred_call_left_unfinished_ends_before_the_next_call():
    """A decode that stopped between the route op and the wait hook: the layer's next call ends it first."""
    cache, spy = _deferring_cache(True)
    cache.route_flat(0, [3, 1, 7, 5])
    assert spy.waited == [] and 0 in cache.deferred
    cache.route_flat(0, [3, 1, 7, 5])  # every expert resident or on the CPU now: nothing new to wait for
    assert len(spy.waited) == 1


def _mib_costs(copy_us: float, cpu_us: float, split_us: float = 0.0, zero_copy_us: float | None = None):
    from ggmoe.cache.miss import MissCosts

    nb = 1 << 20  # one expert of 1 MiB: its times are the fixed costs plus nothing measurable
    zc = nb / (zero_copy_us * US) if zero_copy_us is not None else None
    return MissCosts(copy_bytes_per_s=nb / (copy_us * US), copy_latency_s=0.0, cpu_bytes_per_s=nb / (cpu_us * US),
                     host_split_s=split_us * US, zero_copy_bytes_per_s=zc), nb


@pytest.mark.parametrize("policy, copy_us, cpu_us, split_us, zero_copy_us, slots, want", [
    ("wait", 100, 1, 0, None, 4, 0),      # never the CPU
    ("cpu", 100, 1000, 0, None, 4, 16),   # every expert, whatever it costs
    ("cpu", 100, 1000, 0, None, 16, 0),   # a slot for every expert: no miss to serve
    ("auto", 100, 100, 0, None, 4, 0),    # as fast as the link: the link (a fill also caches the expert)
    ("auto", 100, 99, 0, None, 4, 16),    # a hair faster: every expert
    ("auto", 100, 10000, 0, None, 4, 0),  # the CPU far slower: none
    ("auto", 100, 60, 100, None, 4, 16),  # 3 misses a token expected: 60 + 100 / 3 < 100
    ("auto", 100, 70, 100, None, 4, 0),   # 70 + 100 / 3 > 100: the split costs more than the CPU saves
    ("auto", 100, 70, 0, 50, 4, 0),       # the graph reads a miss at twice the copy engine's rate
])
def test_async_cpu_experts_choice(policy, copy_us, cpu_us, split_us, zero_copy_us, slots, want):
    """The async decode's host part: a layer's experts the CPU computes while no slot holds them, all or none."""
    from ggmoe.cache.miss import async_cpu_experts

    costs, nb = _mib_costs(copy_us, cpu_us, split_us, zero_copy_us)
    assert async_cpu_experts(policy, costs, nb, slots, 16, 4) == tuple(range(want))


def test_async_cpu_experts_expect_misses_from_counts():
    """With routing counts the expected misses are what the hottest experts leave: a layer whose 4 slots cover
    nearly every choice misses too rarely for its split to pay, where uniform routing pays it."""
    from ggmoe.cache.miss import async_cpu_experts

    costs, nb = _mib_costs(100, 60, 100)
    hot = [1000] * 4 + [1] * 12  # four experts take nearly every choice
    assert async_cpu_experts("auto", costs, nb, 4, 16, 4) == tuple(range(16))
    assert async_cpu_experts("auto", costs, nb, 4, 16, 4, hot) == ()


