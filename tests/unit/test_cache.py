"""Expert cache and policies: invariants, an independent LRU, on-demand, the simulator."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache import ExpertCache, NullCopyBackend
from ggmoe.cache.policies import POLICIES, Policy
from ggmoe.simulate import micro_batches, replay
from ggmoe.trace import STAGE_DECODE, STAGE_PREFILL, Trace, TraceMeta

E, K = 8, 2


class RecordingLoader(NullCopyBackend):
    """A copy backend that records every copy it was asked for."""

    def __init__(self):
        super().__init__(copy=lambda il, expert, slot: self.loads.append((il, expert, slot)))
        self.loads = []


def reference_lru(calls: list[tuple[int, np.ndarray]], n_slots: int) -> tuple[int, int]:
    """Hits and misses of an OrderedDict LRU per layer (independent of ggmoe.cache)."""
    lru: dict[int, OrderedDict] = {}
    hits = misses = 0
    for il, ids in calls:
        od = lru.setdefault(il, OrderedDict())
        need = sorted(set(ids.ravel().tolist()))
        for e in need:
            if e in od:
                hits += 1
            else:
                misses += 1
        for e in need:  # evict the least recent expert not used by this call
            if e not in od:
                if len(od) >= n_slots:
                    victim = next(x for x in od if x not in need)
                    del od[victim]
                od[e] = True
        for e in need:
            od.move_to_end(e)
    return hits, misses


def random_calls(seed: int, n: int, layers=(0, 1, 2), max_tokens=3) -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    skew = rng.dirichlet(np.full(E, 0.5))
    calls = []
    for _ in range(n):
        t = int(rng.integers(1, max_tokens + 1))
        for il in layers:
            ids = np.stack([rng.choice(E, K, replace=False, p=skew) for _ in range(t)]).astype(np.int32)
            calls.append((il, ids))
    return calls


@pytest.mark.parametrize("n_slots, seed", [(6, 0), (6, 1), (7, 2), (8, 3)])
def test_lru_matches_reference_and_keeps_invariants(n_slots, seed):
    calls = random_calls(seed, 200)
    loader = RecordingLoader()
    cache = ExpertCache(E, K, {0: n_slots, 1: n_slots, 2: n_slots}, POLICIES.get("lru")(E, [0, 1, 2]), loader,
                        bytes_per_expert={0: 100, 1: 100, 2: 100})
    for il, ids in calls:
        slots = cache.route(il, ids)
        table = cache.tables[il]
        assert slots.shape == ids.shape and slots.dtype == np.int32
        assert np.all(table.expert_in[slots] == ids)  # every selected expert is in its slot
        assert np.all(table.slot_of[table.expert_in[table.expert_in >= 0]] >= 0)
    tot = cache.stats.total()
    assert (tot.hits, tot.misses) == reference_lru(calls, n_slots)
    assert len(loader.loads) == tot.misses and tot.bytes_copied == 100 * tot.misses
    if n_slots == E:  # everything fits: only cold misses
        assert tot.misses == len({(il, int(e)) for il, ids in calls for e in ids.ravel()})


def test_on_demand_never_reuses():
    calls = random_calls(5, 50)
    cache = ExpertCache(E, K, {0: 6, 1: 6, 2: 6}, POLICIES.get("on-demand")(E, [0, 1, 2]))
    for il, ids in calls:
        cache.route(il, ids)
    tot = cache.stats.total()
    assert tot.hits == 0
    assert tot.misses == sum(len(np.unique(ids)) for _, ids in calls)


def test_never_evicts_experts_of_the_current_call():
    class WorstVictim(Policy):  # always names the first candidate: the cache must not offer in-use ones
        def victim(self, il, candidates, clock):
            return int(candidates[0])

    cache = ExpertCache(E, K, {0: 4}, WorstVictim(E, [0]))
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(2)]).astype(np.int32)
        slots = cache.route(0, ids)
        assert np.all(cache.tables[0].expert_in[slots] == ids)


@pytest.mark.parametrize("slots, message", [(1, "n_expert_used"), (E + 1, "n_expert")])
def test_rejects_bad_slot_counts(slots, message):
    with pytest.raises(UsageError, match=message):
        ExpertCache(E, K, {0: slots}, POLICIES.get("lru")(E, [0]))


def test_route_refuses_overfull_call():
    cache = ExpertCache(E, K, {0: 2}, POLICIES.get("lru")(E, [0]))
    assert not cache.fits(0, 2)
    with pytest.raises(UsageError, match="do not fit"):
        cache.route(0, np.array([[0, 1], [2, 3]], dtype=np.int32))


def test_unknown_policy_lists_choices():
    with pytest.raises(UsageError, match="lru"):
        POLICIES.get("nope")


def _trace(rows_per_prompt, n_prefill, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    layers = np.array([0, 1], dtype=np.int32)
    offs = np.cumsum([0, *rows_per_prompt]).astype(np.int64)
    t = int(offs[-1])
    stage = np.concatenate([np.r_[np.full(n_prefill, STAGE_PREFILL), np.full(r - n_prefill, STAGE_DECODE)]
                            for r in rows_per_prompt]).astype(np.uint8)
    ids = np.stack([[rng.choice(E, K, replace=False) for _ in layers] for _ in range(t)]).astype(np.int16)
    meta = TraceMeta(model_fingerprint="x", model_name="m", arch="qwen3moe", n_layer=2, n_expert=E,
                     n_expert_used=K, n_embd=4, mode="greedy", max_tokens=4, ggmoe_version="t", n_ubatch=4)
    return Trace(meta=meta, token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), stage=stage,
                 prompt_offsets=offs, layers=layers, ids=ids, probs=np.zeros((t, 2, E), np.float16), hidden=None)


def test_micro_batches_follow_the_engine_order():
    tr = _trace([10, 7], n_prefill=6)
    got = [(s.start, s.stop) for s in micro_batches(tr)]
    assert got == [(0, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10), (10, 14), (14, 16), (16, 17)]


def test_replay_matches_reference_lru_and_counts_native_calls():
    tr = _trace([12, 9], n_prefill=5)
    stats = replay(tr, 6, "lru")
    calls = []
    native = 0
    for rows in micro_batches(tr):
        for j in range(2):
            ids = tr.ids[rows, j].astype(np.int32)
            if min(ids.shape[0] * K, E) <= 6:
                calls.append((j, ids))
            else:
                native += 1
    tot = stats.total()
    assert (tot.hits, tot.misses) == reference_lru(calls, 6)
    assert tot.native_calls == native > 0


@pytest.mark.parametrize("text, value", [("123", 123), ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                         ("2 kib", 2048), ("10B", 10)])
def test_parse_bytes(text, value):
    from ggmoe.base.units import parse_bytes

    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "4XB", "-1GiB", "1e9"])
def test_parse_bytes_rejects(text):
    from ggmoe.base.units import parse_bytes

    with pytest.raises(UsageError, match="bad size"):
        parse_bytes(text)


def test_slots_for_budget():
    from ggmoe.cache import slots_for_budget

    bpe = {0: 1000, 1: 1000, 3: 2000}
    assert slots_for_budget(16_000, bpe, E, K) == {0: 4, 1: 4, 3: 4}
    assert slots_for_budget(10**9, bpe, E, K) == {0: E, 1: E, 3: E}
    with pytest.raises(UsageError, match="at least"):
        slots_for_budget(7_999, bpe, E, K)


def test_inspect_figures_and_vram_budgets_are_inverse():
    """What `ggmoe inspect` prints for N slots, given as --vram, buys exactly N slots per layer."""
    from ggmoe.cache import slots_for_budget
    from ggmoe.inspect import inspect_model
    from tools.fixtures.make_fixtures import fixture_path

    facts = inspect_model(fixture_path("qwen3moe", expert_type="q8_0"))
    bpe = {layer.il: layer.bytes_per_expert for layer in facts.layers}
    for n in range(facts.n_expert_used, facts.n_expert + 1):
        assert set(slots_for_budget(facts.cache_bytes(n), bpe, facts.n_expert, facts.n_expert_used).values()) == {n}
        assert set(slots_for_budget(facts.cache_bytes(n) + 1, bpe, facts.n_expert, facts.n_expert_used).values()) == {n}
        if n > facts.n_expert_used:
            assert set(slots_for_budget(facts.cache_bytes(n) - 1, bpe, facts.n_expert,
                                        facts.n_expert_used).values()) == {n - 1}


@pytest.mark.parametrize("policy, split, want, why", [
    ("auto", False, "auto", None),  # every decode mode has a host path (the async one: patch 0016)
    ("auto", True, "wait", "split experts"),
    ("cpu", True, "cpu", None),  # asked for explicitly: the engine refuses it, auto never errors
    ("wait", True, "wait", None),
])
def test_auto_without_host_path(policy, split, want, why):
    from ggmoe.cache.miss import auto_without_host_path

    got, note = auto_without_host_path(policy, split)
    assert got == want
    assert (note is None) if why is None else (why in note and note.startswith("auto: "))
