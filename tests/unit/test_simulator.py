"""The discrete-event simulator: the link's timeline by hand, and whole runs on hand-made traces."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.clock import ManualClock
from ggmoe.cache.copy import Priority
from ggmoe.cache.hardware import load_profile
from ggmoe.simulate.des import SimConfig, simulate
from ggmoe.simulate.replay import replay
from ggmoe.simulate.timeline import LinkCopyBackend
from ggmoe.trace.format import STAGE_DECODE, STAGE_PREFILL, Trace, TraceMeta

BPE = 1_000_000  # bytes per expert
# A made-up profile with round numbers: a copy chunk of 1/3 MB takes 1 ms + 0.333 ms.
PROFILE = dataclasses.replace(load_profile("pcie4"), copy_bytes_per_s=1e9, copy_latency_s=1e-3,
                              gpu_bytes_per_s=1e12, gpu_launch_s=0.0, gpu_layer_s=1e-3,
                              cpu_bytes_per_s=1e8, cpu_latency_s=0.0, hook_s=0.0)
CHUNK = 1e-3 + BPE / 3 / 1e9  # s per chunk of one expert (3 chunks)


def link(n_chunks: int = 3) -> tuple[ManualClock, LinkCopyBackend]:
    clock = ManualClock()
    return clock, LinkCopyBackend(clock, {0: BPE, 1: BPE}, PROFILE, n_chunks)


def test_one_copy_takes_its_chunks():
    clock, b = link()
    h = b.submit(0, 5, 0, Priority.DEMAND)
    assert not b.done(h)
    b.wait([h])
    assert clock.now() == pytest.approx(3 * CHUNK)
    assert b.done(h) and b.busy_s == pytest.approx(3 * CHUNK)


def test_demand_waits_at_most_one_chunk_of_a_prefetch():
    clock, b = link()
    p = b.submit(0, 1, 0, Priority.PREFETCH)
    clock.advance(CHUNK / 2)  # the prefetch's first chunk is running
    d = b.submit(0, 2, 1, Priority.DEMAND)
    b.wait([d])
    assert clock.now() == pytest.approx(CHUNK + 3 * CHUNK)  # after that one chunk, the demand's three
    assert not b.done(p)
    b.wait([p])
    assert clock.now() == pytest.approx(6 * CHUNK)


def test_within_a_priority_lower_rank_first():
    clock, b = link(n_chunks=1)
    far = b.submit(0, 1, 0, Priority.PREFETCH, rank=2.0)
    near = b.submit(0, 2, 1, Priority.PREFETCH, rank=1.0)
    b.wait([near])
    assert clock.now() == pytest.approx(1e-3 + BPE / 1e9)
    assert not b.done(far)


def test_cancel_only_what_has_not_started():
    clock, b = link()
    a = b.submit(0, 1, 0, Priority.PREFETCH)
    c = b.submit(0, 2, 1, Priority.PREFETCH)
    clock.advance(CHUNK / 2)
    assert not b.cancel(a)  # its first chunk runs
    assert b.cancel(c)
    b.wait([a])
    assert clock.now() == pytest.approx(3 * CHUNK)


def test_a_copy_cannot_start_before_it_is_submitted():
    clock, b = link(n_chunks=1)
    clock.advance(10.0)
    h = b.submit(0, 1, 0, Priority.DEMAND)
    b.wait([h])
    assert clock.now() == pytest.approx(10.0 + 1e-3 + BPE / 1e9)


def test_without_a_profile_copies_land_at_once():
    clock = ManualClock()
    b = LinkCopyBackend(clock, {0: BPE}, None)
    h = b.submit(0, 1, 0, Priority.DEMAND)
    assert b.done(h)
    b.wait([h])
    assert clock.now() == 0.0


def test_demand_now_runs_whole_copies_only_on_an_idle_link():
    clock, b = link()
    assert b.demand_now(0, 2)  # nothing queued: both copies run whole, the clock at the second's landing
    assert clock.now() == pytest.approx(6 * CHUNK) and b.busy_s == pytest.approx(6 * CHUNK)
    p = b.submit(0, 1, 0, Priority.PREFETCH)
    assert not b.demand_now(0, 1)  # a queued prefetch: the copies must be jobs among the others
    assert clock.now() == pytest.approx(6 * CHUNK) and not b.done(p)


@pytest.mark.parametrize("policy", ["lru", "belady"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_copies_without_handles_change_nothing(monkeypatch, policy: str, mode: str):
    """A replay whose idle-link demand copies skip handles (demand_now) equals one that makes every handle."""
    rng = np.random.default_rng(3)
    tr = trace(rng.integers(0, 8, (60, 3, 2)).tolist(), n_prefill=5)
    tr.ids.sort(axis=2)
    tr.ids[:, :, 1] = np.where(tr.ids[:, :, 0] == tr.ids[:, :, 1], (tr.ids[:, :, 1] + 1) % 8, tr.ids[:, :, 1])
    cfg = SimConfig({0: 3, 1: 3, 2: 4}, policy=policy, decode_mode=mode)
    fast = simulate(tr, cfg, {0: BPE, 1: BPE, 2: BPE}, PROFILE)
    monkeypatch.setattr(LinkCopyBackend, "demand_now", lambda self, il, n: False)
    assert simulate(tr, cfg, {0: BPE, 1: BPE, 2: BPE}, PROFILE) == fast


def trace(ids: list[list[list[int]]], n_prefill: int = 1, n_expert: int = 8,
          hidden: np.ndarray | None = None) -> Trace:
    """A one-prompt trace of ids [T][L][k] (layers 0..L-1), the first n_prefill tokens prefill; hidden
    [T, L, n_embd] optional."""
    a = np.asarray(ids, dtype=np.int16)
    t, n_layer, k = a.shape
    meta = TraceMeta(model_fingerprint="fp", model_name="hand", arch="qwen3moe", n_layer=n_layer,
                     n_expert=n_expert, n_expert_used=k, n_embd=4 if hidden is None else hidden.shape[2],
                     mode="teacher", max_tokens=t - n_prefill, ggmoe_version="test", n_ubatch=512)
    probs = np.zeros((t, n_layer, n_expert), dtype=np.float16)
    for i in range(t):
        for j in range(n_layer):
            probs[i, j, a[i, j]] = 1.0 / k
    stage = np.array([STAGE_PREFILL] * n_prefill + [STAGE_DECODE] * (t - n_prefill), dtype=np.uint8)
    return Trace(meta=meta, token_ids=np.arange(t, dtype=np.int32), positions=np.arange(t, dtype=np.int32),
                 stage=stage, prompt_offsets=np.array([0, t], dtype=np.int64),
                 layers=np.arange(n_layer, dtype=np.int32), ids=a, probs=probs,
                 hidden=None if hidden is None else hidden.astype(np.float16))


def test_misses_wait_for_their_copies():
    # one layer, top-1: experts 0, 1, 0 -> two misses (cold), one hit
    tr = trace([[[0]], [[1]], [[0]]])
    r = simulate(tr, SimConfig({0: 2}), {0: BPE}, PROFILE)
    assert (r.stats["total"]["hits"], r.stats["total"]["misses"]) == (1, 2)
    assert r.exposed_copy_s == pytest.approx(2 * 3 * CHUNK)
    gpu = 1e-3 + BPE / 1e12  # a layer and one expert on the GPU
    assert r.tpot_s == pytest.approx((3 * CHUNK + gpu + gpu) / 2)  # decode: a miss, then a hit
    assert r.ttft_s == pytest.approx(3 * CHUNK + gpu + 3 * CHUNK + gpu)


def test_the_host_path_computes_misses_on_the_cpu():
    tr = trace([[[0]], [[1]], [[0]]])
    r = simulate(tr, SimConfig({0: 2}, miss_policy="cpu"), {0: BPE}, PROFILE)
    # both misses go to the CPU and are admitted at low priority; the admission of expert 0 (4 ms) has
    # landed by the third token, which hits
    assert r.host_computed == 2 and r.exposed_copy_s == 0.0
    assert (r.stats["total"]["hits"], r.stats["total"]["admission_copies"]) == (1, 2)
    layer = 1e-3  # attention and router: the CPU starts on the router's answer
    cpu = BPE / 1e8  # 10 ms per expert on the CPU (the GPU computes no expert meanwhile)
    gpu = BPE / 1e12  # one expert on the GPU
    assert r.ttft_s == pytest.approx(2 * (layer + cpu))
    assert r.tpot_s == pytest.approx((layer + cpu + layer + gpu) / 2)


def test_auto_picks_the_cheaper():
    tr = trace([[[0]], [[1]], [[2]]])
    fast_cpu = dataclasses.replace(PROFILE, cpu_bytes_per_s=1e11)  # 10 us per expert: beats a copy
    slow_cpu = dataclasses.replace(PROFILE, cpu_bytes_per_s=1e6)  # 1 s per expert: a copy wins
    assert simulate(tr, SimConfig({0: 2}, miss_policy="auto"), {0: BPE}, fast_cpu).host_computed == 3
    assert simulate(tr, SimConfig({0: 2}, miss_policy="auto"), {0: BPE}, slow_cpu).host_computed == 0
    # 3 ms on the CPU against a copy of 3 chunks, 3 x 1 ms latency + 1 ms of bytes: the CPU is sooner
    mid_cpu = dataclasses.replace(PROFILE, cpu_bytes_per_s=BPE / 3e-3)
    r = simulate(tr, SimConfig({0: 2}, miss_policy="auto"), {0: BPE}, mid_cpu)
    assert r.host_computed == 3 and r.exposed_copy_s == 0.0
    # the async decode weighs the same costs for its host part: a fast CPU takes every miss, a slow one none
    assert simulate(tr, SimConfig({0: 2}, miss_policy="auto", decode_mode="async"), {0: BPE}, fast_cpu
                    ).host_computed == 3
    assert simulate(tr, SimConfig({0: 2}, miss_policy="auto", decode_mode="async"), {0: BPE}, slow_cpu
                    ).host_computed == 0


def test_an_oracle_prefetch_one_layer_ahead_hides_the_copy_when_the_gpu_is_slow_enough():
    # two layers, top-1; decode tokens use new experts in layer 1 each time
    tr = trace([[[0], [0]], [[1], [1]], [[2], [2]], [[3], [3]]])
    slow_gpu = dataclasses.replace(PROFILE, gpu_layer_s=10e-3)  # a layer takes longer than a copy
    base = simulate(tr, SimConfig({0: 2, 1: 2}), {0: BPE, 1: BPE}, slow_gpu)
    pre = simulate(tr, SimConfig({0: 2, 1: 2}, predictor="oracle", stride=1, predictor_s=0.0), {0: BPE, 1: BPE},
                   slow_gpu)
    assert pre.prefetch_issued > 0 and pre.pred_accuracy == 1.0
    # layer 1's experts were all prefetched during layer 0's 10 ms and landed in time: no miss, no wait
    assert pre.stats["layers"]["1"]["misses"] == 0 and pre.stats["layers"]["1"]["wait_s"] == 0.0
    assert base.stats["layers"]["1"]["wait_s"] == pytest.approx(4 * 3 * CHUNK)
    # layer 0's experts are predicted at the token's start and land during layer 0's attention: none late
    assert (pre.late_prefetches, pre.prefetch_hits) == (0, 8)
    assert pre.goodpred == 1.0 and pre.exposed_copy_s == 0.0
    assert pre.tpot_s == pytest.approx(2 * (10e-3 + BPE / 1e12))  # two layers, nothing waited for
    assert pre.tpot_s < base.tpot_s


def test_a_late_prefetch_costs_the_rest_of_its_copy():
    # two layers, top-1, new experts each token; a layer's attention (1 ms) is shorter than a copy (4 ms)
    tr = trace([[[0], [0]], [[1], [1]], [[2], [2]]])
    cfg = SimConfig({0: 2, 1: 2}, predictor="oracle", stride=1, n_prefetch=1, predictor_s=0.0)
    r = simulate(tr, cfg, {0: BPE, 1: BPE}, PROFILE)
    gpu = BPE / 1e12
    # per token: layer 0's expert is prefetched at the token's start and waited for after the 1 ms attention;
    # layer 1's is prefetched once layer 0 routed and waited for after layer 0's expert and layer 1's attention
    assert r.stats["layers"]["0"]["wait_s"] == pytest.approx(3 * (3 * CHUNK - 1e-3))
    assert r.stats["layers"]["1"]["wait_s"] == pytest.approx(3 * (3 * CHUNK - gpu - 1e-3))
    assert (r.late_prefetches, r.prefetch_hits, r.goodpred) == (6, 6, 0.0)
    assert r.tpot_s == pytest.approx(2 * 3 * CHUNK + gpu)  # the link is the bottleneck: two copies a token
    base = simulate(tr, dataclasses.replace(cfg, predictor=None), {0: BPE, 1: BPE}, PROFILE)
    assert base.tpot_s == pytest.approx(2 * (1e-3 + 3 * CHUNK + gpu))


def test_counts_without_a_profile_equal_replay():
    rng = np.random.default_rng(3)
    ids = [[sorted(rng.choice(8, size=2, replace=False).tolist()) for _ in range(3)] for _ in range(40)]
    tr = trace(ids, n_prefill=5)
    for policy in ("lru", "lfu", "belady"):
        a = simulate(tr, SimConfig(dict.fromkeys(range(3), 3), policy=policy), dict.fromkeys(range(3), BPE), None)
        b = replay(tr, 3, policy)
        assert (a.stats["total"]["hits"], a.stats["total"]["misses"]) == (b.total().hits, b.total().misses)
        assert a.tpot_s is None and a.ttft_s is None  # no profile: no times


def test_baselines_by_hand():
    from ggmoe.simulate.des import baseline

    # two layers, top-1, one prefill token then two decode tokens
    tr = trace([[[0], [1]], [[2], [3]], [[4], [5]]])
    bpe = {0: BPE, 1: BPE}
    gpu = 1e-3 + BPE / 1e12  # attention and router, then one expert on the GPU
    cpu = 1e-3 + BPE / 1e8  # attention and router on the GPU, then one expert on the CPU
    assert baseline(tr, "stock-vram", bpe, PROFILE).tpot_s == pytest.approx(2 * gpu)
    assert baseline(tr, "stock-cpu", bpe, PROFILE).tpot_s == pytest.approx(2 * cpu)
    # a budget of one layer's whole expert tensors (8 experts): layer 0 on the GPU, layer 1 on the CPU
    b = baseline(tr, "n-cpu-moe", bpe, PROFILE, budget=8 * BPE)
    assert b.gpu_layers == 1 and b.tpot_s == pytest.approx(gpu + cpu)
    assert b.ttft_s == pytest.approx(2 * (gpu + cpu))
    with pytest.raises(Exception, match="budget"):
        baseline(tr, "n-cpu-moe", bpe, PROFILE)


def test_a_waited_copy_is_promoted_past_queued_prefetches():
    clock, b = link(n_chunks=1)
    one = 1e-3 + BPE / 1e9
    ahead = [b.submit(0, e, e, Priority.PREFETCH) for e in range(3)]
    late = b.submit(0, 7, 7, Priority.PREFETCH, rank=9.0)  # the last of the queued prefetches
    clock.advance(1e-4)  # the first prefetch has started
    assert b.remaining_s(late) == pytest.approx(one - 1e-4 + one)  # the running chunk, then itself
    b.promote(late)
    b.wait([late])
    # the first prefetch had started at 0 and finishes; then the promoted copy
    assert clock.now() == pytest.approx(2 * one)
    assert not b.done(ahead[1])


def test_auto_does_not_wait_for_a_copy_stuck_behind_a_backlog():
    """An expert whose admission copy is queued behind others: the CPU is sooner than the link."""
    from ggmoe.cache import ExpertCache
    from ggmoe.cache.miss import SLOT_HOST
    from ggmoe.cache.policies import POLICIES

    clock = ManualClock()
    prof = dataclasses.replace(PROFILE, cpu_bytes_per_s=1e9)  # 1 ms per expert on the CPU; a copy takes 4 ms
    b = LinkCopyBackend(clock, {0: BPE}, prof, 3)
    cache = ExpertCache(8, 1, {0: 4}, POLICIES.get("lru")(8, [0]), copies=b, bytes_per_expert={0: BPE},
                        clock=clock, miss_policy="auto", costs=prof.miss_costs())
    assert cache.route_flat(0, [1]) == [SLOT_HOST]  # computed on the CPU, admitted at low priority
    assert cache.route_flat(0, [2]) == [SLOT_HOST]
    clock.advance(1e-4)
    # expert 2's admission is queued behind expert 1's: over 5 ms away, so the CPU computes it again
    assert cache.route_flat(0, [2]) == [SLOT_HOST]
    assert cache.stats.layers[0].wait_s == 0.0


def test_admissions_in_flight_are_capped_per_layer():
    from ggmoe.cache import ExpertCache
    from ggmoe.cache.policies import POLICIES

    clock = ManualClock()
    b = LinkCopyBackend(clock, {0: BPE}, PROFILE, 3)
    cache = ExpertCache(8, 2, {0: 6}, POLICIES.get("lru")(8, [0]), copies=b, bytes_per_expert={0: BPE},
                        clock=clock, miss_policy="cpu")
    for e in range(0, 8, 2):
        cache.route_flat(0, [e, e + 1])
    assert cache.stats.layers[0].admission_copies == 2  # n_expert_used in flight at most; the link is busy


def _identity_mlp(path, n_embd: int, n_expert: int = 8) -> str:
    """A PRED.npz for layer 0 -> layer 1 whose net passes the hidden state through (ReLU of the identity):
    with n_embd = n_expert it predicts the expert whose one-hot the hidden state holds."""
    import json

    meta = {"format": "ggmoe-predictor", "version": 1, "kind": "mlp", "model_fingerprint": "fp",
            "model_name": "hand", "layers": [0, 1], "n_expert": n_expert, "n_expert_used": 1, "n_embd": n_embd,
            "dtype": "float32", "hidden": n_embd, "nets": [{"il": 0, "targets": [1], "metrics": {}}]}
    zero = np.zeros(n_embd, np.float32)
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **{
        "net0.w1": np.eye(n_embd, dtype=np.float32), "net0.b1": zero,
        "net0.w2": np.eye(n_expert, n_embd, dtype=np.float32), "net0.b2": np.zeros(n_expert, np.float32),
        "net0.mean": zero, "net0.std": np.ones(n_embd, np.float32)})
    return str(path)


def test_a_predictor_of_hidden_states_reads_the_traces_hidden_states(tmp_path):
    # two layers, top-1, new experts each token, two prefill tokens; layer 0's MoE input is the one-hot of
    # layer 1's expert
    ids = [[[e], [e]] for e in range(5)]
    hidden = np.zeros((5, 2, 8), np.float32)
    for t in range(5):
        hidden[t, 0, ids[t][1][0]] = 1.0
    slow_gpu = dataclasses.replace(PROFILE, gpu_layer_s=10e-3)  # a layer takes longer than a copy
    cfg = SimConfig({0: 2, 1: 2}, predictor=_identity_mlp(tmp_path / "p.npz", 8), stride=1, n_prefetch=1,
                    predictor_s=0.0)
    r = simulate(trace(ids, n_prefill=2, hidden=hidden), cfg, {0: BPE, 1: BPE}, slow_gpu)
    # each decode token: layer 1's expert predicted from layer 0's hidden state, copied during layer 0
    assert (r.prefetch_issued, r.prefetch_hits, r.pred_accuracy) == (3, 3, 1.0)
    # layer 1 misses only in the prefill (nothing is predicted for a prefill): two copies waited for
    assert r.stats["layers"]["1"]["misses"] == 2 and r.stats["layers"]["1"]["wait_s"] == pytest.approx(6 * CHUNK)
    assert r.late_prefetches == 0 and r.goodpred == 1.0
    with pytest.raises(UsageError, match="hidden states"):
        simulate(trace(ids), dataclasses.replace(cfg, predictor=_identity_mlp(tmp_path / "q.npz", 4)),
                 {0: BPE, 1: BPE}, slow_gpu)


def test_skip_gate_needs_the_model():
    with pytest.raises(UsageError, match="model"):
        simulate(trace([[[0], [0]], [[1], [1]]]), SimConfig({0: 2, 1: 2}, predictor="skip-gate", stride=1),
                 {0: BPE, 1: BPE}, PROFILE)


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    from ggmoe.cli.simulate import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(UsageError, match="pip install"):
        pyplot()


def test_the_async_decode_reads_misses_over_the_link_and_admits_between_tokens():
    """One layer, top-1, 2 slots; a layer takes 10 ms, a zero-copy read of an expert 2 ms (0.5 GB/s), a copy
    4 ms (3 chunks). Every token is an async step (one token each)."""
    profile = dataclasses.replace(PROFILE, zero_copy_bytes_per_s=5e8, gpu_layer_s=10e-3)
    tr = trace([[[0]], [[1]], [[0]], [[0]]])
    r = simulate(tr, SimConfig({0: 2}, decode_mode="async"), {0: BPE}, profile)
    layer, gpu, zc = 10e-3, BPE / 1e12, BPE / 5e8
    # token 0 (0-12 ms): 0 missed, read over the link; admitted after, its copy lands at 16 ms
    # token 1 (12-24 ms): 1 missed; 0 landed but becomes readable only at the boundary after token 1
    # tokens 2 and 3: 0 read from its slot
    st = r.stats["total"]
    assert (st["hits"], st["misses"], st["host_reads"], st["admission_copies"]) == (2, 2, 2, 2)
    assert st["host_read_bytes"] == 2 * BPE and st["landed"] == 2
    assert r.ttft_s == pytest.approx(2 * (layer + zc))
    assert r.tpot_s == pytest.approx((layer + zc + 2 * (layer + gpu)) / 3)
    # the reads share the link with the copies (each at half its rate while both run): with 1 ms layers,
    # token 1's read of 1 (2 ms alone) meets 0's admission copy and takes 4 ms, token 2's read of 0 (not
    # readable yet: its copy, delayed 2 ms by that read, lands at 9 ms) meets 1's copy likewise; token 3 hits
    fast = simulate(tr, SimConfig({0: 2}, decode_mode="async"), {0: BPE},
                    dataclasses.replace(profile, gpu_layer_s=1e-3))
    ft = fast.stats["total"]
    assert (ft["hits"], ft["misses"], ft["landed"]) == (1, 3, 1)
    assert fast.tpot_s == pytest.approx((1e-3 + 2 * zc + 1e-3 + 2 * zc + 1e-3 + gpu) / 3)
    # the sync mode on the same trace waits for each miss's copy instead
    s = simulate(tr, SimConfig({0: 2}), {0: BPE}, profile)
    assert s.stats["total"]["misses"] == 2 and s.exposed_copy_s == pytest.approx(2 * 3 * CHUNK)


@pytest.mark.parametrize("layer_s", [10e-3, 1e-3])
def test_fills_cross_the_link_once_and_admit_nothing(layer_s):
    """The trace of the test above with in-graph fills: each miss is copied into a fill slot inside its layer
    (the zero-copy rate, on the layer's path) and computed from there; nothing is admitted after, so a
    fast layer hits what a slow one does (no admission to wait for) and the hit rate is sync LRU's."""
    profile = dataclasses.replace(PROFILE, zero_copy_bytes_per_s=5e8, gpu_layer_s=layer_s)
    tr = trace([[[0]], [[1]], [[0]], [[0]]])
    r = simulate(tr, SimConfig({0: 2}, decode_mode="async", fills=True), {0: BPE}, profile)
    gpu, zc = BPE / 1e12, BPE / 5e8
    st = r.stats["total"]
    assert r.decode_mode == "async-fill" and "async-fill" in r.label
    assert (st["hits"], st["misses"], st["fills"]) == (2, 2, 2)
    assert (st["host_reads"], st["admission_copies"], st["bytes_copied"]) == (0, 0, 2 * BPE)
    assert r.ttft_s == pytest.approx(2 * (layer_s + zc + gpu))  # the one-token prompt fills too
    assert r.tpot_s == pytest.approx((layer_s + zc + gpu + 2 * (layer_s + gpu)) / 3)
    s = simulate(tr, SimConfig({0: 2}), {0: BPE}, profile)
    assert r.hit_rate == s.hit_rate


def test_fills_follow_sync_lrus_hits_on_every_layer_and_plan_only_one_token_decodes():
    """Three layers, top-2, 3 slots, a 3-token prompt (read through the tables, no fills: the engine plans
    them only for a one-token decode) then 60 tokens: with copies that land at once, fills are the decode's
    misses, read in place and admitted only in the prompt; with a profile, faster than sync."""
    rng = np.random.default_rng(5)
    tr = trace([[sorted(rng.choice(8, size=2, replace=False).tolist()) for _ in range(3)] for _ in range(63)],
               n_prefill=3)
    bpe = dict.fromkeys(range(3), BPE)
    cfg = SimConfig(dict.fromkeys(range(3), 3), decode_mode="async", fills=True)
    ft = simulate(tr, cfg, bpe, None).stats["total"]
    distinct = [len({e for t in range(3) for e in tr.ids[t, j].tolist()}) for j in range(3)]  # the prompt's
    assert ft["fills"] + sum(distinct) == ft["misses"] and ft["host_reads"] == sum(distinct)
    assert ft["admission_copies"] == sum(min(3, n) for n in distinct)  # as many as the slots hold
    sync = simulate(tr, SimConfig(dict.fromkeys(range(3), 3)), bpe, PROFILE)
    assert simulate(tr, cfg, bpe, PROFILE).tpot_s < sync.tpot_s
    with pytest.raises(UsageError, match="async decode"):
        simulate(tr, SimConfig(dict.fromkeys(range(3), 3), fills=True), bpe, PROFILE)


def test_simulate_names_async_with_fills_async_fill():
    from ggmoe.cli.simulate import _check_choices

    choices = _check_choices((), (), (), ("sync,async,async-fill",), (), ())
    assert choices.modes == ["sync", "async", "async-fill"]
    with pytest.raises(UsageError, match="async-fill"):
        _check_choices((), (), (), ("fill",), (), ())


def test_the_async_decode_refuses_what_needs_the_sync_mode():
    tr = trace([[[0]], [[1]]])
    disk = dataclasses.replace(PROFILE, disk_bytes_per_s=1e9)
    for mode in ("sync", "async"):  # as the engine: cpu refused under a disk tier, auto run as wait
        with pytest.raises(UsageError, match="disk tier"):
            simulate(tr, SimConfig({0: 2}, decode_mode=mode, miss_policy="cpu", host_slots=2), {0: BPE}, disk)
        r = simulate(tr, SimConfig({0: 2}, decode_mode=mode, miss_policy="auto", host_slots=2), {0: BPE}, disk)
        assert r.host_computed == 0
    with pytest.raises(UsageError, match="decode mode"):
        simulate(tr, SimConfig({0: 2}, decode_mode="fast"), {0: BPE}, PROFILE)


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
def test_without_a_profile_the_async_replay_counts_what_the_sync_one_counts(policy):
    """A decode stream with copies landing at once: the async decode's hits are the sync decode's (Belady
    gets the future of the controller's calls as it gets the route op's)."""
    rng = np.random.default_rng(5)
    tr = trace([[sorted(rng.choice(8, size=2, replace=False).tolist()) for _ in range(3)] for _ in range(60)],
               n_prefill=0)
    bpe = dict.fromkeys(range(3), BPE)
    a, s = (simulate(tr, SimConfig(dict.fromkeys(range(3), 3), policy=policy, decode_mode=mode), bpe, None)
            for mode in ("async", "sync"))
    assert (a.stats["total"]["hits"], a.stats["total"]["misses"]) == (s.stats["total"]["hits"],
                                                                      s.stats["total"]["misses"])


def test_belady_runs_in_the_async_replay_with_a_profile():
    rng = np.random.default_rng(6)
    tr = trace([[sorted(rng.choice(8, size=2, replace=False).tolist())] for _ in range(80)], n_prefill=0)
    hit = {p: simulate(tr, SimConfig({0: 3}, policy=p, decode_mode="async"), {0: BPE}, PROFILE).hit_rate
           for p in ("lru", "belady")}
    assert hit["belady"] >= hit["lru"] > 0.0
