"""Routing statistics that persist: hand-checked counts, the file format, refused files, predictor state."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from ggmoe.base.hook import RouteEvent
from ggmoe.predict import ModelShape, make_predictor
from ggmoe.predict.evaluate import evaluate
from ggmoe.trace import load_trace
from ggmoe.trace.data import select_prompts, split_prompts
from ggmoe.trace.routing_stats import (
    RoutingStats,
    RoutingStatsCollector,
    StatsFileError,
    load_stats,
    save_stats,
)
from predictors.synthetic import planted_trace

LAYERS = (0, 2)  # il of the MoE layers
E = 4  # n_expert


def _event(il: int, ids: list[list[int]]) -> RouteEvent:
    return RouteEvent(il=il, ids=np.asarray(ids, dtype=np.int32), probs=None, hidden=None)


def collected() -> RoutingStats:
    c = RoutingStatsCollector(RoutingStats.empty("fp", LAYERS, E))
    c.on_route(_event(0, [[0, 1], [1, 2]]))  # two tokens in one micro-batch
    c.on_route(_event(2, [[3, 0]]))
    c.on_route(_event(0, [[1, 3]]))
    c.on_route(_event(5, [[1, 2]]))  # not a MoE layer of the stats: ignored
    return c.snapshot()


def test_counts_and_coactivation_by_hand():
    s = collected()
    assert s.n_tokens.tolist() == [3, 1]
    assert s.counts.tolist() == [[1, 3, 1, 1], [1, 0, 0, 1]]
    # layer 0: tokens {0,1}, {1,2}, {1,3}
    want0 = np.zeros((E, E), np.int64)
    for a, b in ((0, 1), (1, 2), (1, 3)):
        want0[a, b] += 1
        want0[b, a] += 1
        want0[a, a] += 1
        want0[b, b] += 1
    assert (s.coact[0] == want0).all()
    assert s.coact[1, 0, 3] == s.coact[1, 3, 0] == 1
    assert s.counts_by_layer()[2].tolist() == [1, 0, 0, 1]
    assert np.allclose(s.frequencies()[0], [1 / 3, 1, 1 / 3, 1 / 3])


def test_a_collector_continues_from_loaded_counts(tmp_path):
    path = save_stats(tmp_path / "s.npz", collected())
    c = RoutingStatsCollector(load_stats(path))
    c.on_route(_event(2, [[1, 2]]))
    s = c.snapshot()
    assert s.n_tokens.tolist() == [3, 2]
    assert s.counts[1].tolist() == [1, 1, 1, 1]


def test_round_trip_with_predictor_state(tmp_path):
    state = {"ratio": np.random.default_rng(0).random((3, 2, E)).astype(np.float32),
             "origin": np.arange(3, dtype=np.int64)}
    s = collected()
    s = RoutingStats(s.model_fingerprint, s.layers, s.n_expert, s.counts, s.coact, s.n_tokens, "eam", state)
    back = load_stats(save_stats(tmp_path / "s.npz", s))
    assert back.layers == LAYERS and back.n_expert == E and back.predictor == "eam"
    assert (back.counts == s.counts).all() and (back.coact == s.coact).all()
    assert set(back.predictor_state) == {"ratio", "origin"}
    assert (back.predictor_state["ratio"] == state["ratio"]).all()


@pytest.mark.parametrize("fingerprint,layers,n_expert,match", [
    ("other", LAYERS, E, "another model"),
    ("fp", (0, 1), E, "MoE layers"),
    ("fp", LAYERS, 8, "MoE layers"),
])
def test_statistics_of_another_model_are_refused(fingerprint, layers, n_expert, match):
    with pytest.raises(Exception, match=match):
        collected().check_model(fingerprint, layers, n_expert)


def _rewrite(path, tmp_path, change) -> str:
    """A copy of the stats file with its arrays changed by ``change(dict)``."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    out = tmp_path / "bad.npz"
    np.savez(out, **arrays)
    return str(out)


def _meta(**kw):
    def change(a):
        meta = json.loads(a["meta"].tobytes())
        meta.update(kw)
        a["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return change


BAD = [
    ("wrong-format", _meta(format="something-else"), "not a routing statistics file"),
    ("future-version", _meta(version=99), "version 99"),
    ("bad-layers", _meta(layers=[2, 0]), "malformed"),
    ("huge-n-expert", _meta(n_expert=10**6), "malformed"),
    ("counts-shape", lambda a: a.update(counts=np.zeros((2, 5), np.int64)), "counts: shape"),
    ("counts-dtype", lambda a: a.update(counts=a["counts"].astype(np.float64)), "counts: dtype"),
    ("negative", lambda a: a.update(n_tokens=-a["n_tokens"]), "negative"),
    ("diagonal", lambda a: a.update(counts=a["counts"] + 1), "diagonal"),
    ("missing-coact", lambda a: a.pop("coact"), "missing array coact"),
    ("extra-array", lambda a: a.update(extra=np.zeros(1)), "unexpected arrays"),
    ("object-array", lambda a: a.update(counts=np.array([{"x": 1}], dtype=object)), "pickle"),
    ("meta-not-json", lambda a: a.update(meta=np.frombuffer(b"\xff{", dtype=np.uint8)), "not JSON"),
    ("state-missing", _meta(predictor="eam", predictor_arrays=["ratio"]), "missing array pred.ratio"),
]


@pytest.mark.parametrize("change,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_files_are_refused_with_one_message(tmp_path, change, match):
    good = save_stats(tmp_path / "good.npz", collected())
    with pytest.raises(StatsFileError, match=match):
        load_stats(_rewrite(good, tmp_path, change))


@pytest.mark.parametrize("content,match", [
    (b"", "not a readable .npz"),
    (b"PK\x03\x04 truncated", "not a readable .npz"),
    (b"\x93NUMPY not a zip", "not a readable .npz"),
])
def test_not_a_stats_file(tmp_path, content, match):
    p = tmp_path / "x.npz"
    p.write_bytes(content)
    with pytest.raises(StatsFileError, match=match):
        load_stats(p)


def test_a_zip_of_something_else(tmp_path):
    p = tmp_path / "x.npz"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", "hello")
    p.write_bytes(buf.getvalue())
    with pytest.raises(StatsFileError, match="unexpected zip member"):
        load_stats(p)


def test_missing_file(tmp_path):
    with pytest.raises(StatsFileError, match="no such file"):
        load_stats(tmp_path / "none.npz")


@pytest.mark.parametrize("name", ["eam", "expert-map"])
def test_predictor_state_restores_the_same_predictions(tmp_path, name):
    """A predictor restored from state() predicts exactly as the one that learnt it."""
    path = tmp_path / "t.npz"
    planted_trace(path, n_prompts=20, tokens=12, group_by="prompt", n_groups=3, seed=4)
    trace = load_trace(path)
    tr, va = split_prompts(trace.n_prompts, 0.25, seed=0)
    train, val = select_prompts(trace, tr), select_prompts(trace, va)
    shape = ModelShape.from_trace(trace.meta, trace.layers)
    learnt = make_predictor(name, shape, 1)
    learnt.fit(train)
    fresh = make_predictor(name, shape, 1)
    assert not fresh.has_state
    state = {k: v.copy() for k, v in learnt.state().items()}
    fresh.load_state(state)
    assert fresh.has_state
    a = evaluate(learnt, val, prefetch=4)
    b = evaluate(fresh, val, prefetch=4)
    scores = [(s.il, s.n, s.accuracy, s.recall, s.precision) for s in (*a.layers, a.overall)]
    assert scores == [(s.il, s.n, s.accuracy, s.recall, s.precision) for s in (*b.layers, b.overall)]
    assert a.overall.accuracy > 0.5  # it did learn the planted groups


@pytest.mark.parametrize("name,bad", [
    ("eam", {"ratio": np.zeros((2, 3, 3), np.float32), "origin": np.zeros(2, np.int64)}),
    ("eam", {"ratio": np.ones((1, 2, 4), np.float64), "origin": np.zeros(1, np.int64)}),
    ("expert-map", {"maps": np.zeros((1, 2, 4), np.float32)}),
    ("reuse", {"x": np.zeros(1)}),
])
def test_state_that_does_not_fit_is_refused(name, bad):
    from ggmoe.base.errors import UsageError

    shape = ModelShape(model_fingerprint="fp", layers=(0, 1), n_expert=4, n_expert_used=2, n_embd=8)
    with pytest.raises(UsageError):
        make_predictor(name, shape, 1).load_state(bad)
