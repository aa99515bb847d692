"""Runtime predictors (numpy): each one on a synthetic trace where the right answer is planted."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.inspect.gating import Gating
from ggmoe.inspect.router import Router
from ggmoe.predict import PREDICTORS, ModelShape, Predictor, make_predictor
from ggmoe.predict.eam import EAMCollection
from ggmoe.predict.evaluate import build_predictor, evaluate, render_text
from ggmoe.predict.expert_map import MapStore, select_count
from ggmoe.trace import load_trace
from ggmoe.trace.data import load_traces, merge_traces, select_prompts, split_prompts
from predictors.synthetic import planted_trace, synthetic_meta

SOFTMAX = Gating(func="softmax", norm_w=False, w_scale=0.0, n_expert_groups=0, n_group_used=0)

K, M = 2, 4  # n_expert_used, prefetch set


@pytest.fixture(scope="module")
def by_token(tmp_path_factory):
    """Token id determines the group, hence every layer's experts."""
    path = tmp_path_factory.mktemp("pred") / "token.npz"
    planted = planted_trace(path, n_prompts=30, tokens=20, group_by="token", seed=1)
    return load_trace(path), planted


@pytest.fixture(scope="module")
def by_prompt(tmp_path_factory):
    """Every token of a prompt has the prompt's group (request groups)."""
    path = tmp_path_factory.mktemp("pred") / "prompt.npz"
    planted = planted_trace(path, n_prompts=30, tokens=20, group_by="prompt", n_groups=4, seed=2)
    return load_trace(path), planted


def _split(trace):
    tr, va = split_prompts(trace.n_prompts, 0.2, seed=0)
    return select_prompts(trace, tr), select_prompts(trace, va), tr, va


def _shape(trace) -> ModelShape:
    return ModelShape.from_trace(trace.meta, trace.layers)


def test_registry_has_every_builtin():
    assert PREDICTORS.names() == ["eam", "expert-map", "mlp", "oracle", "reuse", "skip-gate", "token", "transition"]
    with pytest.raises(UsageError, match="unknown predictor 'nope'"):
        PREDICTORS.get("nope")


def test_split_is_by_prompt_seeded_and_disjoint():
    tr, va = split_prompts(50, 0.1, seed=3)
    assert len(va) == 5 and len(tr) == 45 and not set(tr) & set(va)
    assert np.array_equal(split_prompts(50, 0.1, seed=3)[1], va)
    assert not np.array_equal(split_prompts(50, 0.1, seed=4)[1], va)
    with pytest.raises(UsageError):
        split_prompts(1)


def test_select_and_merge_keep_prompts_whole(by_token):
    trace, _ = by_token
    sub = select_prompts(trace, np.array([3, 1]))
    assert sub.n_prompts == 2
    assert np.array_equal(sub.ids[:20], trace.ids[trace.prompt_slice(3)])
    both = merge_traces([sub, sub])
    assert both.n_prompts == 4 and both.prompt_offsets.tolist() == [0, 20, 40, 60, 80]
    assert np.array_equal(both.hidden[60:], trace.hidden[trace.prompt_slice(1)])


@pytest.mark.parametrize(("sources", "merged"), [
    (["", ""], ""),  # traces recorded here have no source
    (["a/intent", "a/law"], "a/intent; a/law"),  # imported routings: each named
    (["a/intent", "", "a/law", "a/intent"], "a/intent; a/law"),  # each once, in order
])
def test_a_merged_trace_names_every_source(by_token, sources, merged):
    from dataclasses import replace

    trace, _ = by_token
    parts = [replace(trace, meta=replace(trace.meta, source=src)) for src in sources]
    assert merge_traces(parts).meta.source == merged


def test_stride_must_leave_a_target(by_token):
    shape = _shape(by_token[0])
    with pytest.raises(UsageError, match="stride 4 needs at least 5 MoE layers"):
        PREDICTORS.get("reuse")(shape, stride=4)


def test_oracle_is_perfect(by_token):
    trace, _ = by_token
    r = evaluate(make_predictor("oracle", _shape(trace), 2), trace, M)
    assert r.overall.accuracy == 1.0 and r.overall.recall == 1.0 and r.overall.precision == K / M
    assert all(s.accuracy == 1.0 for s in r.layers)  # token-start layers too


def test_reuse_repeats_the_previous_token(by_prompt):
    trace, _ = by_prompt
    r = evaluate(make_predictor("reuse", _shape(trace), 1), trace, M, stage="decode")
    assert r.overall.accuracy == 1.0  # every decode token repeats its predecessor's experts
    first = evaluate(make_predictor("reuse", _shape(trace), 1), trace, M, stage="prefill")
    assert first.overall.accuracy < 1.0  # the first token of a prompt has no predecessor


def test_reuse_ranks_older_tokens_after_the_previous_one():
    shape = ModelShape("f", (0, 1), n_expert=6, n_expert_used=2, n_embd=4)
    p = make_predictor("reuse", shape)
    p.begin_request()
    for ids in ([0, 1], [2, 3], [4, 5]):
        p.begin_token(0)
        p.observe(0, np.array(ids), None, None)
        p.observe(1, np.array(ids), None, None)
    p.begin_token(0)
    order = np.argsort(-p.predict(1), kind="stable")
    assert order[:2].tolist() == [4, 5] and order[2:4].tolist() == [2, 3]


def test_token_frequency_learns_token_routing(by_token):
    trace, _ = by_token
    train, test, _, _ = _split(trace)
    seen = np.isin(test.token_ids, train.token_ids)
    assert seen.mean() > 0.9
    r = evaluate(build_predictor("token", _shape(trace), 1, train, {}), test, M)
    assert r.overall.accuracy >= 0.9 and r.layers[0].accuracy >= 0.9  # token-start layer too
    p = build_predictor("token", _shape(trace), 1, train, {})
    p.begin_token(10_000)  # never seen: the layer's overall frequencies
    assert np.isclose(p.predict(1).sum(), 1.0)


def test_token_is_exact_on_seen_tokens(by_token):
    trace, planted = by_token
    p = build_predictor("token", _shape(trace), 1, trace, {})
    for tok in np.unique(trace.token_ids)[:10]:
        p.begin_token(int(tok))
        for j, il in enumerate(trace.layers):
            top = np.argsort(-p.predict(int(il)), kind="stable")[:K]
            assert set(top) == set(planted.sets[j, planted.token_group[tok]])


def test_data_driven_predictors_need_training(by_token):
    shape = _shape(by_token[0])
    for name in ("token", "eam", "expert-map"):
        with pytest.raises(UsageError, match="learns from training traces"):
            build_predictor(name, shape, 1, None, {})


def test_eam_matches_the_planted_request_group(by_prompt):
    trace, planted = by_prompt
    train, test, tr_idx, va_idx = _split(trace)
    p = build_predictor("eam", _shape(trace), 1, train, {"n_match": 2, "online": False})
    assert p.collection.n == train.n_prompts  # capacity 256 > prompts: one entry per training prompt
    for q in range(test.n_prompts):
        group = planted.prompt_group[va_idx[q]]
        p.begin_request()
        sl = test.prompt_slice(q)
        p.begin_token(int(test.token_ids[sl.start]))
        p.observe(0, test.ids[sl.start, 0], None, None)
        p.predict(1)
        entries, cos = p.last_match
        matched_groups = planted.prompt_group[tr_idx[p.collection.origin[entries]]]
        assert (matched_groups == group).all()
        assert np.allclose(cos, 0.5, atol=1e-5)  # 1 of the L = 4 rows seen, and it is identical: 1 / sqrt(4)
        for j in range(1, 4):  # the aggregate predicts the group's experts at every later layer
            assert set(np.argsort(-p.predict(j), kind="stable")[:K]) == set(planted.sets[j, group])
    r = evaluate(build_predictor("eam", _shape(trace), 1, train, {}), test, M)
    assert r.overall.accuracy == 1.0


def test_eam_layer_proximity_weight():
    shape = ModelShape("f", (0, 1, 2, 3), n_expert=4, n_expert_used=1, n_embd=2)
    p = PREDICTORS.get("eam")(shape, stride=1)
    p.collection.add(np.ones((4, 4)))
    p.begin_request()
    p.begin_token(0)
    p.observe(0, np.array([1]), None, None)
    # aggregated ratio 1/4 per expert, times 1 - (i - l) / L with l = 0, L = 4
    assert np.allclose(p.predict(1), 0.25 * 0.75) and np.allclose(p.predict(3), 0.25 * 0.25)


def test_eam_collection_replaces_the_most_similar():
    c = EAMCollection(capacity=2, n_layer=2, n_expert=4)
    a = np.array([[5, 0, 0, 0], [0, 5, 0, 0]], float)
    b = np.array([[0, 0, 5, 0], [0, 0, 0, 5]], float)
    assert c.add(a) == 0 and c.add(b) == 1
    assert c.add(a + np.array([[0, 1, 0, 0], [0, 0, 0, 0]])) == 0  # near a: a's slot
    assert c.add(b * 2) == 1
    assert c.origin.tolist() == [2, 3]


def _norm(p: np.ndarray) -> np.ndarray:
    p = p.astype(np.float32)
    return p / p.sum(axis=-1, keepdims=True)


def test_expert_map_retrieves_the_planted_map(by_prompt):
    trace, planted = by_prompt
    train, test, tr_idx, va_idx = _split(trace)
    p = build_predictor("expert-map", _shape(trace), 1, train, {"online": False})
    for q in range(test.n_prompts):
        group = planted.prompt_group[va_idx[q]]
        # the planted map of the group: that of any training token of the group
        q0 = int(np.nonzero(planted.prompt_group[tr_idx] == group)[0][0])
        planted_map = _norm(train.probs[train.prompt_slice(q0).start])  # [L, E]
        sl = test.prompt_slice(q)
        p.begin_request()
        for t in range(sl.start, sl.start + 3):
            p.begin_token(int(test.token_ids[t]))
            if t > sl.start:  # semantic search: the request's key so far is near the group's centroid
                p.predict(0)
                entry, score = p.last_match
                assert score > 0.95
                assert np.allclose(p.store.maps[entry], planted_map, atol=2e-3)
            p.observe(0, test.ids[t, 0], test.probs[t, 0].astype(np.float32), test.hidden[t, 0].astype(np.float32))
            scores = p.predict(1)  # trajectory search on layer 0
            entry, score = p.last_match
            assert score > 0.999
            assert np.allclose(p.store.maps[entry], planted_map, atol=2e-3)
            # a confident match (delta ~ 0) selects just k experts: exactly the planted ones
            assert set(np.nonzero(scores >= 1.0)[0]) == set(planted.sets[1, group])
            for j in (1, 2, 3):
                p.observe(j, test.ids[t, j], test.probs[t, j].astype(np.float32), None)
    r = evaluate(build_predictor("expert-map", _shape(trace), 1, train, {}), test, M)
    assert r.overall.accuracy == 1.0


def test_expert_map_threshold_and_deduplication():
    row = np.array([0.125, 0.5, 0.125, 0.25], dtype=np.float32)  # sorted: 0.5, 0.25, 0.125, 0.125 (exact)
    assert select_count(row, 1.0, 2) == 2  # delta 0: at least k
    assert select_count(row, 0.5, 1) == 1  # delta 0.5: 0.5 reaches it
    assert select_count(row, 0.3, 1) == 2  # delta 0.7: 0.5 + 0.25
    assert select_count(row, 0.2, 1) == 3  # delta 0.8: 0.5 + 0.25 + 0.125
    assert select_count(row, 0.0, 1) == 4  # delta 1: everything
    assert select_count(row, -0.5, 1) == 4  # score below 0: delta clipped to 1
    s = MapStore(capacity=2, n_layer=2, n_expert=3, n_embd=2, semantic_weight=0.5)
    m1 = np.array([[1, 0, 0], [0, 1, 0]], np.float32)
    m2 = np.array([[0, 0, 1], [0, 1, 0]], np.float32)
    assert s.add(np.array([1.0, 0.0]), m1) == 0 and s.add(np.array([0.0, 1.0]), m2) == 1
    assert s.add(np.array([0.9, 0.1]), m1) == 0  # most redundant with entry 0
    assert s.semantic(np.array([0.0, 2.0]))[0] == 1
    assert s.semantic(None) == (-1, 0.0)


def _router_trace(tmp_path, noise: float, seed: int = 0):
    """Hidden state shared by all layers (plus noise); each layer's ids = its router's top-k."""
    from ggmoe.base.hook import RouteEvent
    from ggmoe.trace import TraceWriter

    meta = synthetic_meta(n_layer=4, n_expert=8, k=2, n_embd=16)
    rng = np.random.default_rng(seed)
    routers = {il: Router(il=il, weight=rng.standard_normal((8, 16)).astype(np.float32), bias=None,
                          selection_bias=None, gating=SOFTMAX) for il in range(4)}
    w = TraceWriter(meta, keep_hidden=True)
    for _ in range(4):
        for _t in range(10):
            h = rng.standard_normal((1, 16)).astype(np.float32)
            ev = {}
            for il, r in routers.items():
                hl = h + noise * rng.standard_normal(h.shape).astype(np.float32)
                ev[il] = RouteEvent(il=il, ids=r.topk(hl, 2), probs=r.probs(hl), hidden=hl)
            w.add_step([1], 0, 1, ev)
        w.end_prompt()
    path = w.save(tmp_path / "router.npz")
    return load_trace(path), routers


def test_skip_gate_uses_the_next_router(tmp_path):
    trace, routers = _router_trace(tmp_path, noise=0.0)
    shape = _shape(trace)
    for stride in (1, 2, 3):
        r = evaluate(PREDICTORS.get("skip-gate")(shape, stride, routers=routers), trace, M)
        assert r.overall.accuracy > 0.99  # same hidden state: the router of l+s gives l+s's choice (fp16 ties aside)
        assert all(s.n == 0 for s in r.layers[:stride])  # nothing to apply the router to at the token start
    noisy, routers = _router_trace(tmp_path, noise=0.3)
    r = evaluate(PREDICTORS.get("skip-gate")(_shape(noisy), 1, routers=routers), noisy, M)
    assert 0.5 < r.overall.accuracy < 1.0


def test_skip_gate_reads_the_gguf_and_checks_the_model(tmp_path):
    import gguf

    from ggmoe.inspect.fingerprint import model_fingerprint

    trace, routers = _router_trace(tmp_path, noise=0.0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    for il, r in routers.items():
        w.add_tensor(f"blk.{il}.ffn_gate_inp.weight", r.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UsageError, match="is not the model the trace was recorded with"):
        make_predictor("skip-gate", _shape(trace), 1, model=str(tmp_path / "m.gguf"))
    shape = ModelShape(model_fingerprint(tmp_path / "m.gguf"), *(_shape(trace).__dict__[k] for k in
                                                                  ("layers", "n_expert", "n_expert_used", "n_embd")))
    p = make_predictor("skip-gate", shape, 1, model=str(tmp_path / "m.gguf"))
    assert np.allclose(p.routers[2].weight, routers[2].weight)
    with pytest.raises(UsageError, match="needs the model's GGUF"):
        make_predictor("skip-gate", shape, 1)


class _Fixed(Predictor):
    """Predicts experts 0 and 1 first, then 2 and 3."""

    name = "fixed"

    def predict(self, il_target):
        return np.array([4, 3, 2, 1, 0, 0, 0, 0], dtype=np.float32)


def test_metrics_count_overlaps(tmp_path):
    from ggmoe.base.hook import RouteEvent
    from ggmoe.trace import TraceWriter

    meta = synthetic_meta(n_layer=3, n_expert=8, k=2, n_embd=4)
    w = TraceWriter(meta, keep_hidden=False)
    for ids in ([0, 5], [2, 3], [6, 7]):  # top-2 {0,1}, top-4 {0,1,2,3}
        ev = {il: RouteEvent(il=il, ids=np.array([ids], np.int32), probs=np.full((1, 8), 0.125, np.float32),
                             hidden=None) for il in range(3)}
        w.add_step([0], 0, 0, ev)
        w.end_prompt()
    trace = load_trace(w.save(tmp_path / "t.npz"))
    r = evaluate(_Fixed(_shape(trace), 1), trace, prefetch=4)
    # hits in top-2: 1, 0, 0 of 2 per token; in top-4: 1, 2, 0
    assert r.overall.n == 6
    assert np.isclose(r.overall.accuracy, 1 / 6) and np.isclose(r.overall.recall, 3 / 6)
    assert np.isclose(r.overall.precision, 3 / 12)
    assert "all" in render_text(r)
    with pytest.raises(UsageError, match="prefetch 9"):
        evaluate(_Fixed(_shape(trace), 1), trace, prefetch=9)
    zero = {il: Router(il=il, weight=np.zeros((8, 4), np.float32), bias=None, selection_bias=None,
                       gating=SOFTMAX) for il in range(3)}
    with pytest.raises(UsageError, match="needs MoE input hidden states"):
        evaluate(PREDICTORS.get("skip-gate")(_shape(trace), 1, routers=zero), trace, 4)


def test_load_traces_merges_files(by_token, tmp_path):
    trace, _ = by_token
    path = tmp_path / "t.npz"
    planted_trace(path, n_prompts=3, tokens=5)
    both = load_traces([path, path])
    assert both.n_prompts == 6 and both.n_tokens == 30


def test_runtime_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, ggmoe.cli, ggmoe.predict, ggmoe.predict.evaluate, ggmoe.trace.data; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
