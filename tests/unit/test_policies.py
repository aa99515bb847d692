"""Eviction policies: hand-checked victim sequences, Belady against a brute-force optimum, invariants, replay.

The expected victims below were worked out by hand from each policy's definition (the comments show the
arithmetic); they are not computed by the code under test.
"""

from __future__ import annotations

import math
from functools import cache
from itertools import combinations

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.base.errors import UsageError
from ggmoe.cache import ExpertCache, NullCopyBackend
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.policies.base import Policy
from ggmoe.cache.policies.classlru import frequency_class
from ggmoe.predict import ModelShape
from ggmoe.predict.eam import EAM
from ggmoe.simulate import micro_batches, replay
from ggmoe.simulate.replay import next_uses
from ggmoe.trace import STAGE_DECODE, STAGE_PREFILL, Trace, TraceMeta
from ggmoe.trace.data import load_counts, trace_counts

pytestmark = pytest.mark.unit

E = 8
STATIC_COUNTS = [1, 5, 3, 0, 2, 0, 0, 0]  # layer 0's trace counts for the static cases


def victims_of(policy, calls: list[list[int]], n_slots: int, k: int = 1, layers=(0,)) -> list[int]:
    """Drive layer 0 of a cache with ``calls`` (each a list of distinct experts) and record the victims."""
    seen: list[int] = []
    pick = policy.victim

    def recording(il, candidates, clock):
        v = pick(il, candidates, clock)
        assert v in candidates
        seen.append(v)
        return v

    def recording_several(il, candidates, n, clock):  # a policy that picks several at once (Policy.victims)
        out = type(policy).victims(policy, il, candidates, n, clock)
        assert set(out) <= set(candidates) and len(out) == min(n, len(candidates))
        seen.extend(out)
        return out

    policy.victim = recording
    if type(policy).victims is not Policy.victims:
        policy.victims = recording_several
    cache = ExpertCache(E, k, {il: n_slots for il in layers}, policy)
    future = next_uses([(0, sorted(c)) for c in calls], E) if policy.needs_future else None
    for i, c in enumerate(calls):
        cache.route_flat(0, list(c), next_use=future[i] if future else None)
    return seen


def singles(*experts: int) -> list[list[int]]:
    return [[e] for e in experts]


def make(name: str, **options):
    return POLICIES.get(name)(E, [0], **options)


CASES = [
    # lfu, 2 slots: 0 0 1 | 2: counts 0:2 1:1 -> 1 | 1: 0:2 2:1 -> 2 | 3: 0:2 (last 2) 1:2 (last 5), LRU -> 0
    # | 2: 1:2 3:1 -> 3
    ("lfu", {}, singles(0, 0, 1, 2, 1, 3, 2), 2, [1, 2, 0, 3]),
    # lfu ties: {0,1} then {2,3} in 3 slots: 2 takes the free slot, 3 needs a victim among 0 and 1 (count 1,
    # last use 1 each) -> lowest id 0
    ("lfu", {}, [[0, 1], [2, 3]], 3, [0]),
    # lcp with rho 0.5, omega 1: priority count/calls * 0.5**nu
    # 0 0 0 1 | 2 at calls=4: 0: 3/4*0.5 = .375, 1: 1/4 = .25 -> 1 | 1 at calls=5: 0: 3/5*.25 = .15, 2: 1/5 = .2
    # -> 0 | 3 at calls=6: 1: 2/6 = .33, 2: 1/6*.5 = .083 -> 2
    ("lcp", {"rho": 0.5, "omega": 1.0}, singles(0, 0, 0, 1, 2, 1, 3), 2, [1, 0, 2]),
    # lcp defaults (rho .25, omega 128): 0 three times, 2 three hundred times, 1 once, then 3 (3 slots):
    # 0: 3/304 * .25**(301/128) = 3/304 * .038 = .00038; 1: 1/304 = .0033; 2: 300/304 -> 0 (lfu would evict 1)
    ("lcp", {}, singles(0, 0, 0, *[2] * 300, 1, 3), 3, [0]),
    # classlru, 3 slots: 0 five times (count ~4.95: class 2), 1, 2 | 3 at now=7: 0: age 2 / 4 = .5,
    # 1: age 1 / 1 = 1 (count .99: class 0), 2: age 0 -> 1 | 4 at now=8: 0: 3/4, 2: 1/1, 3: 0 -> 2
    # | 5 at now=9: 0: 4/4 = 1, 3: 1/1 = 1, 4: 0 -> tie, lowest id 0
    ("classlru", {}, singles(0, 0, 0, 0, 0, 1, 2, 3, 4, 5), 3, [1, 2, 0]),
    # fmoe with a window of 2 calls: priority (recent calls using it)/2 * count
    # 0 0 0 1 | 2: 0: 1/2*3 = 1.5, 1: 1/2*1 = .5 -> 1 | 3 (window [1, 2]): 0: 0*3 = 0, 2: 1/2*1 -> 0
    # | 4 (window [2, 3]): 2: .5, 3: .5, tie -> least recent 2
    ("fmoe", {"window": 2}, singles(0, 0, 0, 1, 2, 3, 4), 2, [1, 0, 2]),
    # eam without a collection: p = count / total, the same order as lfu
    ("eam", {}, singles(0, 0, 1, 2, 1, 3, 2), 2, [1, 2, 0, 3]),
    # static, counts 0:1 1:5 2:3 4:2; 3 slots: 1 2 0 | 4: coldest of {0,1,2} is 0 | 3: coldest of {1,2,4} is 4
    ("static", {"counts": {0: STATIC_COUNTS}}, singles(1, 2, 0, 4, 3), 3, [0, 4]),
    # static with only expert 1 pinned, the rest LRU: | 4: unpinned 0 (last 3), 2 (last 2) -> 2
    # | 3: unpinned 0 (last 3), 4 (last 4) -> 0
    ("static", {"counts": {0: STATIC_COUNTS}, "n_pinned": 1}, singles(1, 2, 0, 4, 3), 3, [2, 0]),
    # static with 1 and 2 pinned, 2 slots: 1 2 | 0: every candidate pinned -> the colder, 2 (3 < 5)
    ("static", {"counts": {0: STATIC_COUNTS}, "n_pinned": 2}, singles(1, 2, 0), 2, [2]),
    # belady, 2 slots: 0 1 | 2: next 0 at 4, 1 at 5 -> 1 | 1 (call 5): 0 at 7, 2 never -> 2 | 3: 0 at 7, 1 never -> 1
    ("belady", {}, singles(0, 1, 2, 0, 1, 3, 0), 2, [1, 2, 1]),
    # lru on the lfu trace: 0 0 1 | 2: 0 (last 2) vs 1 (3) -> 0 | 1: hit | 3: 1 (last 5) vs 2 (4) -> 2
    # | 2: 1 (5) vs 3 (6) -> 1
    ("lru", {}, singles(0, 0, 1, 2, 1, 3, 2), 2, [0, 2, 1]),
]


@pytest.mark.parametrize("name, options, calls, n_slots, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_victims_match_hand_checked_sequences(name, options, calls, n_slots, expected):
    k = max(len(c) for c in calls)
    assert victims_of(make(name, **options), calls, n_slots, k) == expected


def test_eam_with_a_matched_collection_keeps_what_similar_requests_used():
    shape = ModelShape(model_fingerprint="x", layers=(0, 1), n_expert=E, n_expert_used=1, n_embd=4)
    pred = EAM(shape, stride=1, capacity=2, n_match=1)
    past = np.zeros((2, E), np.float32)
    past[0, 3], past[0, 5], past[1, 0] = 9, 1, 1  # layer 0: expert 3 90 %, expert 5 10 %
    pred.collection.add(past)
    # 3 5 5 | 6: matched p 3: .9, 5: .1 -> 5 (the running EAM would evict 3: count 1 < 2) | 5: 3: .9, 6: 0 -> 6
    calls = singles(3, 5, 5, 6, 5)
    assert victims_of(POLICIES.get("eam")(E, [0, 1], predictor=pred), calls, 2, layers=(0, 1)) == [5, 6]
    assert victims_of(POLICIES.get("eam")(E, [0, 1]), calls, 2, layers=(0, 1)) == [3]


def test_eam_layer_factor_falls_with_depth():
    pol = POLICIES.get("eam")(E, [0, 2, 4, 6])
    p = np.full(E, 0.5, np.float32)
    assert [float(pol.priority(il, p)[0]) for il in (0, 2, 4, 6)] == pytest.approx(
        [(0.5 + 1e-3) * f for f in (1.0, 0.75, 0.5, 0.25)])


def test_classlru_frequency_classes_and_half_life():
    assert [frequency_class(c) for c in (0.0, 0.5, 1.0, 1.99, 2.0, 3.9, 4.0, 127.0, 128.0, 1e6)] == \
        [0, 0, 0, 0, 1, 1, 2, 6, 7, 7]
    pol = make("classlru")
    pol.on_access(0, [2], 1)
    assert pol.decayed(0, 2, 1 + 128) == 0.5  # one use, one half-life later
    victims_of(pol, singles(3, 4, 5), 2)  # 3 is evicted ...
    assert pol.decayed(0, 3, 4) > 0.9  # ... and its count stays


def test_lcp_priority_formula():
    pol = make("lcp")
    for _ in range(3):
        pol.on_access(0, [1], 0)
    for _ in range(5):
        pol.on_access(0, [2], 0)
    # expert 1: used 3 of 8 calls, last 5 calls ago: 3/8 * 0.25**(5/128)
    assert pol.priority(0, 1) == pytest.approx(3 / 8 * 0.25 ** (5 / 128))
    assert pol.priority(0, 2) == pytest.approx(5 / 8)
    assert pol.priority(0, 0) == 0.0


@pytest.mark.parametrize("options, message", [({}, "counts"), ({"counts": {1: STATIC_COUNTS}}, "layers"),
                                              ({"counts": {0: [1, 2]}}, "expected"),
                                              ({"counts": {0: STATIC_COUNTS}, "n_pinned": 9}, "n_pinned")])
def test_static_rejects_missing_or_bad_counts(options, message):
    with pytest.raises(UsageError, match=message):
        make("static", **options)


@pytest.mark.parametrize("name, options", [("lcp", {"rho": 1.5}), ("lcp", {"omega": 0}), ("fmoe", {"window": 0})])
def test_bad_options_are_usage_errors(name, options):
    with pytest.raises(UsageError):
        make(name, **options)


def test_belady_refuses_to_run_without_the_future():
    assert POLICIES.get("belady").needs_future
    assert not any(POLICIES.get(n).needs_future for n in POLICIES.names() if n != "belady")
    cache = ExpertCache(E, 1, {0: 2}, make("belady"))
    cache.route_flat(0, [0])
    cache.route_flat(0, [1])  # no eviction yet: nothing to refuse
    with pytest.raises(UsageError, match="simulator"):
        cache.route_flat(0, [2])  # the first eviction


def test_next_uses_by_hand():
    calls = [(0, [0, 1]), (1, [2]), (0, [1, 3]), (0, [0])]
    inf = math.inf
    assert next_uses(calls, 4) == [
        {0: 4.0, 1: 3.0, 2: inf, 3: 3.0},  # layer 0's first call: also the first use of 2 and 3
        {2: inf, 0: inf, 1: inf, 3: inf},  # layer 1's first (and only) call
        {1: inf, 3: inf},
        {0: inf},
    ]


def next_uses_by_scan(calls: list[tuple[int, list[int]]], n_expert: int) -> list[dict[int, float]]:
    """next_uses by its definition, a forward scan for each (call, expert) (independent of replay.py)."""

    def use_after(i: int, il: int, e: int) -> float:  # access number of layer il's next call after i using e
        return next((j + 1.0 for j in range(i + 1, len(calls)) if calls[j][0] == il and e in calls[j][1]), math.inf)

    out = []
    for i, (il, need) in enumerate(calls):
        first = all(calls[j][0] != il for j in range(i))
        out.append({e: use_after(i, il, e) for e in (range(n_expert) if first else need)})
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_layers,n_expert,k", [(1, 4, 2), (3, 8, 3), (2, 64, 6)])
def test_next_uses_matches_a_scan(seed: int, n_layers: int, n_expert: int, k: int):
    rng = np.random.default_rng(seed)
    calls = [(int(rng.integers(n_layers)) * 2, sorted({int(e) for e in rng.integers(0, n_expert, k)}))
             for _ in range(int(rng.integers(0, 40)))]
    assert next_uses(calls, n_expert) == next_uses_by_scan(calls, n_expert)


def test_next_uses_refuses_an_expert_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        next_uses([(0, [1, 4])], 4)


def brute_force_hits(calls: list[list[int]], n_slots: int) -> int:
    """Most hits any eviction choice gives (exhaustive; independent of ggmoe.cache)."""

    @cache
    def best(i: int, resident: frozenset) -> int:
        if i == len(calls):
            return 0
        need = frozenset(calls[i])
        hits = len(need & resident)
        after = resident | need
        over = len(after) - n_slots
        if over <= 0:
            return hits + best(i + 1, after)
        return hits + max(best(i + 1, after - frozenset(out))
                          for out in combinations(sorted(resident - need), over))

    return best(0, frozenset())


def hits_of(policy, calls: list[list[int]], n_slots: int, k: int) -> int:
    cache = ExpertCache(E, k, {0: n_slots}, policy)
    future = next_uses([(0, sorted(c)) for c in calls], E) if policy.needs_future else None
    for i, c in enumerate(calls):
        cache.route_flat(0, list(c), next_use=future[i] if future else None)
    return cache.stats.total().hits


@pytest.mark.parametrize("seed", range(6))
def test_belady_equals_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    k = 1 + seed % 2
    calls = [sorted(rng.choice(6, size=int(rng.integers(1, k + 1)), replace=False).tolist()) for _ in range(12)]
    n_slots = k + 1
    assert hits_of(make("belady"), calls, n_slots, k) == brute_force_hits(calls, n_slots)


def _options(name: str, trace: Trace | None = None) -> dict:
    """Options a policy needs to be built: static gets counts (from the trace when there is one)."""
    if name == "static":
        return {"counts": trace_counts(trace) if trace is not None else {il: STATIC_COUNTS for il in (0, 1, 2)}}
    return {}


def random_trace(seed: int, rows_per_prompt=(30, 22), n_prefill=7, k=2, n_layer=3) -> Trace:
    rng = np.random.default_rng(seed)
    skew = rng.dirichlet(np.full(E, 0.4), size=n_layer)
    offs = np.cumsum([0, *rows_per_prompt]).astype(np.int64)
    t = int(offs[-1])
    stage = np.concatenate([np.r_[np.full(n_prefill, STAGE_PREFILL), np.full(r - n_prefill, STAGE_DECODE)]
                            for r in rows_per_prompt]).astype(np.uint8)
    ids = np.stack([[rng.choice(E, k, replace=False, p=skew[j]) for j in range(n_layer)]
                    for _ in range(t)]).astype(np.int16)
    meta = TraceMeta(model_fingerprint="x", model_name="m", arch="qwen3moe", n_layer=n_layer, n_expert=E,
                     n_expert_used=k, n_embd=4, mode="greedy", max_tokens=4, ggmoe_version="t", n_ubatch=3)
    return Trace(meta=meta, token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), stage=stage,
                 prompt_offsets=offs, layers=np.arange(n_layer, dtype=np.int32), ids=ids,
                 probs=np.zeros((t, n_layer, E), np.float16), hidden=None)


@pytest.mark.parametrize("name", POLICIES.names())
@pytest.mark.parametrize("n_slots, seed", [(2, 0), (4, 1), (6, 2), (E, 3)])
def test_every_policy_keeps_the_cache_invariants(name, n_slots, seed):
    k = 2
    rng = np.random.default_rng(seed)
    skew = rng.dirichlet(np.full(E, 0.5))
    calls = []
    for _ in range(150):
        t = int(rng.integers(1, n_slots // k + 1))
        for il in (0, 1, 2):
            ids = np.stack([rng.choice(E, k, replace=False, p=skew) for _ in range(t)]).astype(np.int32)
            calls.append((il, ids))
    loads: list = []
    policy = POLICIES.get(name)(E, [0, 1, 2], **_options(name))
    cache = ExpertCache(E, k, dict.fromkeys((0, 1, 2), n_slots), policy,
                        NullCopyBackend(copy=lambda il, e, s: loads.append((il, e, s))),
                        bytes_per_expert=dict.fromkeys((0, 1, 2), 10))
    future = next_uses([(il, sorted(set(ids.ravel().tolist()))) for il, ids in calls], E) \
        if cache.policy.needs_future else None
    distinct = 0
    for i, (il, ids) in enumerate(calls):
        slots = np.asarray(cache.route_flat(il, ids.ravel().tolist(), next_use=future[i] if future else None),
                           dtype=np.int32).reshape(ids.shape)
        table = cache.tables[il]
        assert slots.min() >= 0
        if name != "on-demand":  # on-demand empties the slots right after the call
            assert np.all(table.expert_in[slots] == ids)  # every selected expert is in its slot
        resident = table.expert_in[table.expert_in >= 0]
        assert len(set(resident.tolist())) == len(resident)  # no expert twice
        assert np.all(table.slot_of[resident] >= 0)
        assert len(resident) + len(table.free) == n_slots
        distinct += len(np.unique(ids))
    tot = cache.stats.total()
    assert tot.hits + tot.misses == distinct
    assert len(loads) == tot.misses and tot.bytes_copied == 10 * tot.misses
    if name == "on-demand":
        assert tot.hits == 0
    if n_slots == E and name != "on-demand":  # everything fits: only cold misses
        assert tot.misses == len({(il, int(e)) for il, ids in calls for e in ids.ravel()})


@pytest.mark.parametrize("seed", range(4))
def test_every_policy_runs_in_replay_and_belady_has_the_most_hits(seed):
    tr = random_trace(seed)
    routed = sum(len(np.unique(tr.ids[rows, j])) for rows in micro_batches(tr) for j in range(3)
                 if min((rows.stop - rows.start) * 2, E) <= 4)
    hits = {}
    for name in POLICIES.names():
        tot = replay(tr, 4, name, policy_options=_options(name, tr)).total()
        assert tot.hits + tot.misses == routed, name
        assert tot.native_calls > 0
        hits[name] = tot.hits
    assert hits["on-demand"] == 0
    assert all(hits["belady"] >= h for h in hits.values()), hits


def test_replay_belady_equals_brute_force_on_a_decode_trace():
    tr = random_trace(7, rows_per_prompt=(14,), n_prefill=1, k=1, n_layer=1)
    calls = [sorted(set(tr.ids[rows, 0].ravel().tolist())) for rows in micro_batches(tr)]
    assert replay(tr, 2, "belady").total().hits == brute_force_hits(calls, 2)


def save_trace(tr: Trace, path) -> None:
    """Write ``tr`` in the trace format (what ``TraceWriter.save`` writes)."""
    import json
    from dataclasses import asdict

    np.savez(path, token_ids=tr.token_ids, positions=tr.positions, stage=tr.stage, ids=tr.ids, probs=tr.probs,
             prompt_offsets=tr.prompt_offsets, layers=tr.layers,
             meta=np.frombuffer(json.dumps(asdict(tr.meta)).encode(), dtype=np.uint8))


def test_static_counts_from_trace_files(tmp_path):
    tr = random_trace(1)
    counts = trace_counts(tr)
    assert set(counts) == {0, 1, 2}
    assert all(int(c.sum()) == tr.n_tokens * 2 for c in counts.values())  # k = 2 selections per token
    assert counts[1].tolist() == np.bincount(tr.ids[:, 1].ravel().astype(np.int64), minlength=E).tolist()
    path = tmp_path / "t.npz"
    save_trace(tr, path)
    pol = POLICIES.get("static")(E, [0, 1, 2], counts=load_counts([path, path]))
    assert all(pol.counts[il].tolist() == (2 * counts[il]).tolist() for il in (0, 1, 2))
    by_file = replay(tr, 4, "static", policy_options={"counts": load_counts(path)}).total()
    assert (by_file.hits, by_file.misses) == \
        (lambda t: (t.hits, t.misses))(replay(tr, 4, "static", policy_options={"counts": counts}).total())


def test_cli_lists_every_policy_with_a_description():
    from ggmoe.cli import main

    r = CliRunner().invoke(main, ["policies"])
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines() if ln.strip()}
    assert set(lines) == set(POLICIES.names())
    assert {"lfu", "lcp", "classlru", "eam", "fmoe", "static", "belady"} <= set(lines)
    assert all(len(ln.split(None, 1)) == 2 for ln in lines.values())  # a description after each name


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", sorted(n for n in POLICIES.names() if POLICIES.get(n).victims is not Policy.victims))
def test_several_victims_at_once_equal_one_after_another(name: str, seed: int):
    """A policy's own ``victims`` (one sort) picks what ``victim`` picks one after another, ties included."""
    rng = np.random.default_rng(seed)
    policy = make(name)
    for clock in range(1, 30):  # accesses with repeats, so that ages and next uses tie
        policy.on_access(0, sorted({int(e) for e in rng.integers(0, E, 2)}), clock // 3)
    policy.set_future(0, {e: float(rng.choice([5, 9, math.inf])) for e in range(E)})
    cand = sorted({int(e) for e in rng.integers(0, E, 6)})
    for n in range(len(cand) + 2):
        assert policy.victims(0, cand, n, 30) == Policy.victims(policy, 0, cand, n, 30)
