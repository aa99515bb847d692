"""Planning the next token between tokens (ggmoe.control.planner): the training pairs, each cross-token
predictor's ``predict_next``, the plan's effect on the cache (admission order, no eviction of a planned
expert), the token-start prefetch, and the simulator running the same planner."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_controller import ManualCopies, Table
from test_simulator import trace as hand_trace

from ggmoe.base.errors import PredictorFileError, UsageError
from ggmoe.cache import ExpertCache
from ggmoe.cache.policies import POLICIES
from ggmoe.control import TokenController
from ggmoe.control.planner import NextTokenPlanner, default_protect
from ggmoe.control.prefetch import Prefetcher
from ggmoe.predict import ModelShape, make_predictor
from ggmoe.predict.base import Predictor
from ggmoe.simulate.des import SimConfig, simulate
from ggmoe.trace.data import next_token_pairs, select_prompts
from ggmoe.trace.format import STAGE_DECODE, STAGE_PREFILL

pytestmark = pytest.mark.unit

N_EXPERT, K = 8, 2
SHAPE = ModelShape(model_fingerprint="fp", layers=(0, 1), n_expert=N_EXPERT, n_expert_used=K, n_embd=4)


# -- the pairs a token-mode net learns from


def _prompts(lengths: list[int], n_prefill: int, seed: int):
    """A trace of several prompts (random ids, fixed seed): each prompt's first n_prefill rows prefill."""
    rng = np.random.default_rng(seed)
    rows = sum(lengths)
    base = hand_trace([[[0, 1], [2, 3]]] * rows, n_prefill=0)
    stage, positions = [], []
    for n in lengths:
        stage += [STAGE_PREFILL] * n_prefill + [STAGE_DECODE] * (n - n_prefill)
        positions += list(range(n))
    return replace(base, ids=rng.integers(0, N_EXPERT, (rows, 2, K)).astype(np.int16),
                   stage=np.asarray(stage, np.uint8), positions=np.asarray(positions, np.int32),
                   prompt_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def test_pairs_are_consecutive_decode_tokens_of_one_sequence():
    tr = _prompts([6, 3, 5], n_prefill=2, seed=11)
    # prompt 0: rows 0-5, decode 2-5 -> 2,3,4; prompt 1: rows 6-8, decode 8 only -> none; prompt 2: rows 9-13
    assert next_token_pairs(tr).tolist() == [2, 3, 4, 11, 12]
    gap = replace(tr, positions=tr.positions.copy())
    gap.positions[4] = 9  # a jump in positions (a sequence that was cut) breaks the pairs around it
    assert next_token_pairs(gap).tolist() == [2, 11, 12]
    assert next_token_pairs(select_prompts(tr, np.array([2, 0]))).tolist() == [2, 3, 7, 8, 9]
    assert next_token_pairs(_prompts([1], n_prefill=1, seed=0)).size == 0


def test_pairs_never_cross_a_prompt_on_random_traces():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        tr = _prompts(rng.integers(1, 12, 8).tolist(), n_prefill=int(rng.integers(0, 3)), seed=seed)
        rows = next_token_pairs(tr)
        prompt = np.searchsorted(tr.prompt_offsets, np.arange(tr.n_tokens), side="right") - 1
        assert np.all(prompt[rows] == prompt[rows + 1])
        assert np.all(tr.stage[rows] == STAGE_DECODE) and np.all(tr.stage[rows + 1] == STAGE_DECODE)
        want = sum(max(0, int(np.sum(tr.stage[a:b] == STAGE_DECODE)) - 1)  # a prompt's decode rows, less one
                   for a, b in zip(tr.prompt_offsets[:-1], tr.prompt_offsets[1:], strict=True))
        assert rows.size == want


# -- predict_next of the built-in cross-token predictors


def test_reuse_predicts_this_tokens_experts_first_then_older_ones():
    p = make_predictor("reuse", SHAPE, 1)
    p.begin_request()
    p.begin_token(0)
    p.observe(0, np.array([1, 2]), None, None)
    p.begin_token(1)
    p.observe(0, np.array([3, 4]), None, None)
    s = p.predict_next(0)
    assert set(np.argsort(-s)[:2].tolist()) == {3, 4} and set(np.argsort(-s)[2:4].tolist()) == {1, 2}
    p.begin_token(2)  # what predict_next said is what predict says at the next token
    np.testing.assert_allclose(p.predict(0), s)


def test_eam_and_expert_map_predict_the_next_token_from_what_they_matched():
    tr = hand_trace([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]], n_prefill=1)
    for name in ("eam", "expert-map"):
        p = make_predictor(name, SHAPE, 1)
        assert p.predicts_next
        p.fit(tr)
        p.begin_request()
        p.begin_token(0)
        p.observe(0, np.array([0, 1]), np.eye(N_EXPERT, dtype=np.float32)[0], None)
        assert set(np.argsort(-p.predict_next(1), kind="stable")[:2].tolist()) == {2, 3}, name
    assert not make_predictor("token", SHAPE, 1).predicts_next
    assert Predictor(SHAPE, 1).predict_next(0) is None


# -- the plan in the cache, through the controller


class Fixed(Predictor):
    """Predicts, for every layer's next token, the experts ``plan`` (likeliest first)."""

    name = "fixed"
    predicts_next = True

    def __init__(self, plan: list[int]) -> None:
        super().__init__(SHAPE, 1)
        self.plan = plan

    def predict_next(self, il: int) -> np.ndarray:
        s = np.zeros(N_EXPERT, np.float32)
        s[self.plan] = np.arange(len(self.plan), 0, -1)
        return s


def _controlled(n_slots: int, plan: list[int] | None, n_protect: int = 2):
    copies = ManualCopies()
    table = Table(copies)
    cache = ExpertCache(N_EXPERT, K, {0: n_slots}, POLICIES.get("lru")(N_EXPERT, [0]), copies,
                        bytes_per_expert={0: 100})
    cache.follow_tables()
    table.apply(cache.take_step())
    planner = None
    if plan is not None:
        planner = NextTokenPlanner(cache, Fixed(plan), [0], n_protect)
        planner.via_controller = True
    ctl = TokenController(cache, [], planner)
    ctl.table = table  # the test's executor: every step's changes go to it (and is checked there)
    return cache, copies, ctl, planner


def _decode(ctl: TokenController, planner: NextTokenPlanner | None, experts: list[int], token: int = 0) -> None:
    if planner is not None:
        planner.begin_step([token])
    ctl.table.apply(ctl.on_routing([0], np.asarray([[experts]], dtype=np.int32)))


def test_admissions_follow_the_plan_and_never_evict_a_planned_expert():
    cache, copies, ctl, planner = _controlled(4, plan=[6, 2])
    planner.begin_step([1, 2, 3])  # a prefill starts the request
    _decode(ctl, planner, [1, 2])  # planned before the cache admits: 2 (planned) first, then 1
    _decode(ctl, planner, [3, 6])  # 6 (planned first), then 3
    assert [h.expert for h in copies.handles] == [2, 1, 6, 3]
    copies.land_all()
    _decode(ctl, planner, [2, 6])
    _decode(ctl, planner, [4, 5])  # full: LRU would evict 1 and 3, never the planned 2 and 6
    copies.land_all()
    resident = set(cache.tables[0].resident())
    assert {2, 6} <= resident and resident == {2, 6, 4, 5}
    st = cache.stats.layers[0]
    # the plan (top k = [6, 2]) was scored at every decode token after the first: 1 + 2 + 0 of 2 each
    assert (st.plan_total, st.plan_correct) == (6, 3)


def test_without_a_plan_lru_evicts_them():
    cache, copies, ctl, _ = _controlled(4, plan=None)
    for experts in ([1, 2], [3, 6], [2, 6]):
        _decode(ctl, None, experts)
        copies.land_all()
    _decode(ctl, None, [4, 5])
    copies.land_all()
    assert set(cache.tables[0].resident()) == {2, 6, 4, 5}  # the same here: LRU's victims are 1 and 3
    cache, copies, ctl, planner = _controlled(4, plan=[1, 3])
    for experts in ([1, 2], [3, 6], [2, 6]):
        _decode(ctl, planner, experts)
        copies.land_all()
    _decode(ctl, planner, [4, 5])
    copies.land_all()
    assert set(cache.tables[0].resident()) == {1, 3, 4, 5}  # the plan keeps 1 and 3 instead


def test_a_full_cache_of_planned_and_used_experts_admits_nothing():
    cache, copies, ctl, planner = _controlled(2, plan=[0, 1])
    _decode(ctl, planner, [0, 1])
    copies.land_all()
    _decode(ctl, planner, [3, 4])  # no victim left (0, 1 planned; 3, 4 in use): read from host, not admitted
    assert [h.expert for h in copies.handles] == [0, 1] and set(cache.tables[0].resident()) == {0, 1}


def test_a_prefill_clears_the_plan_and_a_multi_token_step_plans_nothing():
    cache, _, ctl, planner = _controlled(4, plan=[6, 2])
    _decode(ctl, planner, [1, 2])
    assert cache.planned[0] == [6, 2]
    planner.begin_step([5, 6])
    assert cache.planned[0] == []
    ctl.table.apply(ctl.on_routing([0], np.asarray([[[1, 2], [3, 4]]], dtype=np.int32)))
    assert cache.planned[0] == []


def test_the_planner_refuses_what_cannot_plan():
    cache, _, _, _ = _controlled(4, plan=None)
    with pytest.raises(UsageError, match="does not predict the next token"):
        NextTokenPlanner(cache, make_predictor("token", SHAPE, 1), [0], 2)
    with pytest.raises(UsageError, match="protects 1 to n_expert = 8"):
        NextTokenPlanner(cache, Fixed([1]), [0], 9)
    assert default_protect(8, 2) == 4 and default_protect(6, 4) == 6


# -- the prefetcher at a token's start


class Blind(Predictor):
    """A stride predictor with nothing to say before a layer of the token has been seen (as mlp, skip-gate)."""

    name = "blind"

    def predict(self, il_target: int) -> np.ndarray | None:
        return None


def test_the_token_start_prefetch_takes_the_plan_and_keeps_planned_experts():
    cache = ExpertCache(N_EXPERT, K, {0: 3, 1: 3}, POLICIES.get("lru")(N_EXPERT, [0, 1]),
                        bytes_per_expert={0: 100, 1: 100})
    pf = Prefetcher(cache, Blind(SHAPE, 1), [0, 1], n_prefetch=2)
    for e in (0, 1, 2):  # layer 0 full, LRU order 0, 1, 2
        cache.route(0, np.array([[e, (e + 1) % 3]]))
    cache.plan_next(0, [0, 5])
    pf.begin_step([7])  # a decode token: layer 0 is the target no earlier layer predicts
    resident = set(cache.tables[0].resident())
    assert 5 in resident and 0 in resident  # the plan's 5 prefetched, its 0 kept (LRU's victim was 0)
    assert cache.stats.layers[0].prefetch_issued == 1


# -- the simulator runs the same planner


def test_the_simulator_plans_as_the_controller_does():
    layer0 = [[0, 1], [2, 3], [0, 1], [4, 5], [0, 1], [2, 3]]  # decode rows 2-5: never the previous token's
    tr = hand_trace([[a, [6, 7]] for a in layer0], n_prefill=2)
    slots, bpe = {0: 4, 1: 4}, {0: 100, 1: 100}
    base = simulate(tr, SimConfig(slots, decode_mode="async"), bpe)
    planned = simulate(tr, SimConfig(slots, decode_mode="async", planner="reuse"), bpe)
    sync = simulate(tr, SimConfig(slots, planner="reuse"), bpe)
    assert base.plan_accuracy == 0.0 and planned.planner == "reuse" and "planner reuse" in planned.label
    # 4 decode tokens: 3 plans scored per layer, k = 2 experts each; reuse plans the token's own experts:
    # layer 0 never selects them again, layer 1 always
    assert planned.stats["total"]["plan_total"] == sync.stats["total"]["plan_total"] == 2 * 3 * 2
    assert planned.plan_accuracy == sync.plan_accuracy == pytest.approx(0.5)
    assert [st["plan_correct"] for st in planned.stats["layers"].values()] == [0, 6]
    with pytest.raises(UsageError, match="does not predict the next token"):
        simulate(tr, SimConfig(slots, planner="skip-gate"), bpe)


def test_the_simulator_refuses_a_planner_file_of_mode_layer(tmp_path):
    from test_predictors_file import _write

    meta = {"format": "ggmoe-predictor", "version": 1, "kind": "mlp", "model_fingerprint": "fp",
            "model_name": "hand", "layers": [0, 1], "n_expert": N_EXPERT, "n_expert_used": K, "n_embd": 4,
            "dtype": "float32", "hidden": 5, "nets": [{"il": 0, "targets": [1], "metrics": {}}]}
    rng = np.random.default_rng(0)
    arrays = {"net0.w1": rng.standard_normal((5, 4)).astype(np.float32), "net0.b1": np.zeros(5, np.float32),
              "net0.w2": rng.standard_normal((N_EXPERT, 5)).astype(np.float32),
              "net0.b2": np.zeros(N_EXPERT, np.float32), "net0.mean": np.zeros(4, np.float32),
              "net0.std": np.ones(4, np.float32)}
    path = _write(tmp_path / "layer.npz", meta, arrays)
    tr = hand_trace([[[0, 1], [2, 3]]] * 3, n_prefill=1, hidden=np.zeros((3, 2, 4), np.float32))
    with pytest.raises(PredictorFileError, match="trained for mode layer, stride 1; this run needs mode token, "
                                                 "stride 1$"):
        simulate(tr, SimConfig({0: 4, 1: 4}, decode_mode="async", planner=str(path)), {0: 100, 1: 100})


class Reads(Fixed):
    """A ``Fixed`` plan whose predictor reads MoE input rows; it records the rows it was shown."""

    needs_hidden = True

    def __init__(self, plan: list[int]) -> None:
        super().__init__(plan)
        self.seen: list[tuple[int, object]] = []

    def observe(self, il, ids, probs, hidden):
        self.seen.append((il, None if hidden is None else hidden.tolist()))
        super().observe(il, ids, probs, hidden)


@pytest.mark.parametrize("tokens, n_tokens, reads", [
    ([1], 1, True),  # a one-token decode: the planner reads the rows handed with the routing
    ([1, 2, 3], 3, False),  # a prefill micro-batch: no plan, nothing read
])
def test_the_planner_reads_the_rows_handed_with_the_routing(tokens, n_tokens, reads):
    """The controller takes the MoE input rows as data with the routing (no callback into the engine), and
    says beforehand whether it reads them, so the caller gathers them only then."""
    cache, _, ctl, planner = _controlled(4, plan=[6, 2])
    planner.predictor = pred = Reads([6, 2])
    planner.begin_step(tokens)
    assert ctl.wants_hidden(n_tokens) is reads
    rows = {0: np.array([0.5, 1.0, 1.5, 2.0], np.float32)}
    routing = np.asarray([[[1, 2]] * n_tokens], dtype=np.int32)
    ctl.table.apply(ctl.on_routing([0], routing, hidden=rows))
    assert pred.seen == ([(0, [0.5, 1.0, 1.5, 2.0])] if reads else [])
