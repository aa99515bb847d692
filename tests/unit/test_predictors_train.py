"""Training (torch, predictors/): the MLP learns a planted mapping, training is deterministic, and the
exported file computes in numpy what the torch net computes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ggmoe.base.errors import UsageError  # noqa: E402
from ggmoe.predict import ModelShape, make_predictor  # noqa: E402
from ggmoe.predict.evaluate import evaluate  # noqa: E402
from ggmoe.trace import load_trace  # noqa: E402
from ggmoe.trace.data import next_token_pairs, select_prompts, split_prompts  # noqa: E402
from predictors.mlp import FitSettings, PredictorMLP  # noqa: E402
from predictors.synthetic import planted_trace, synthetic_meta  # noqa: E402
from predictors.train import TrainConfig, export, plan_nets, train  # noqa: E402

FIT = FitSettings(hidden=64, dropout=0.5, lr=3e-3, batch_size=64, max_epochs=40, patience=4)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Hidden state of layer l (group centroid + noise) determines the experts of every later layer."""
    path = tmp_path_factory.mktemp("train") / "trace.npz"
    planted_trace(path, n_prompts=40, tokens=24, meta=synthetic_meta(n_layer=4, n_expert=8, k=2, n_embd=16),
                  n_groups=12, group_by="token", noise=0.3, seed=5)
    return load_trace(path)


def _shape(trace) -> ModelShape:
    return ModelShape.from_trace(trace.meta, trace.layers)


@pytest.fixture(scope="module")
def trained(planted, tmp_path_factory):
    cfg = TrainConfig(fit=FIT, strides=(1, 2), seed=0, threads=1)
    arrays, meta = train(planted, cfg, progress=False)
    return export(tmp_path_factory.mktemp("pred") / "pred.npz", arrays, meta), arrays, meta


def test_mlp_learns_the_planted_mapping(planted, trained):
    path, _, meta = trained
    _, va = split_prompts(planted.n_prompts, 0.1, seed=0)  # the prompts training held out
    held_out = select_prompts(planted, va)
    assert meta["training"]["val_prompts"] == va.tolist()
    for stride in (1, 2):
        r = evaluate(make_predictor(str(path), _shape(planted), stride), held_out, prefetch=4)
        assert r.overall.accuracy >= 0.95, (stride, r.overall)
    assert [(n["il"], n["targets"]) for n in meta["nets"]] == [(0, [1]), (0, [2]), (1, [2]), (1, [3]), (2, [3])]
    assert all(n["metrics"]["val_accuracy_mean"] >= 0.95 for n in meta["nets"])
    assert meta["model_fingerprint"] == planted.meta.model_fingerprint
    assert meta["training"]["n_train_prompts"] + meta["training"]["n_val_prompts"] == planted.n_prompts


def test_numpy_matches_torch_float32(planted, trained):
    path, arrays, meta = trained
    pred = make_predictor(str(path), _shape(planted), 1)
    hidden = planted.hidden[:50, 0].astype(np.float32)  # [50, n_embd] MoE inputs of layer 0
    net = PredictorMLP(16, FIT.hidden, 8, FIT.dropout)
    net.load_state_dict({"fc1.weight": torch.from_numpy(arrays["net0.w1"]), "fc1.bias": torch.from_numpy(arrays["net0.b1"]),
                         "fc2.weight": torch.from_numpy(arrays["net0.w2"]), "fc2.bias": torch.from_numpy(arrays["net0.b2"])})
    net.eval()
    x = (hidden - arrays["net0.mean"]) / arrays["net0.std"]
    with torch.no_grad():
        want = torch.sigmoid(net(torch.from_numpy(x))).numpy()
    got = []
    for h in hidden:
        pred.begin_token(0)
        pred.observe(0, np.array([0, 1]), None, h)
        got.append(pred.predict(1))
    assert np.allclose(np.stack(got), want, atol=1e-5, rtol=0)


def test_float16_export_is_close(planted, trained, tmp_path):
    path, arrays, meta = trained
    half = {k: v.astype(np.float16) if k.split(".")[1] in ("w1", "b1", "w2", "b2") else v for k, v in arrays.items()}
    p16 = export(tmp_path / "half.npz", half, {**meta, "dtype": "float16"})
    a, b = make_predictor(str(path), _shape(planted), 1), make_predictor(str(p16), _shape(planted), 1)
    for h in planted.hidden[:20, 1].astype(np.float32):
        for p in (a, b):
            p.begin_token(0)
            p.observe(1, np.array([0, 1]), None, h)
        assert np.allclose(a.predict(2), b.predict(2), atol=1e-2)


def test_training_is_deterministic(planted):
    cfg = TrainConfig(fit=FitSettings(hidden=16, max_epochs=3, batch_size=64), strides=(1,), sources=(1,),
                      seed=7, threads=1)
    a1, m1 = train(planted, cfg, progress=False)
    a2, m2 = train(planted, cfg, progress=False)
    assert a1.keys() == a2.keys() and all(np.array_equal(a1[k], a2[k]) for k in a1)
    assert m1["nets"] == m2["nets"]
    a3, _ = train(planted, TrainConfig(fit=cfg.fit, strides=(1,), sources=(1,), seed=8, threads=1), progress=False)
    assert not np.array_equal(a1["net0.w1"], a3["net0.w1"])


def test_multi_target_nets(planted, tmp_path):
    cfg = TrainConfig(fit=FIT, multi=True, sources=(0,), seed=0, threads=1)
    arrays, meta = train(planted, cfg, progress=False)
    assert [n["targets"] for n in meta["nets"]] == [[1, 2, 3]] and meta["nets"][0]["strides"] == [1, 2, 3]
    assert arrays["net0.w2"].shape == (3 * 8, FIT.hidden)
    path = export(tmp_path / "multi.npz", arrays, meta)
    _, va = split_prompts(planted.n_prompts, 0.1, seed=0)
    for stride in (1, 2, 3):
        r = evaluate(make_predictor(str(path), _shape(planted), stride), select_prompts(planted, va), prefetch=4)
        assert r.layers[stride].accuracy >= 0.95  # the only source layer is 0: target position = stride


def test_plan_rejects_bad_requests(planted):
    layers = [0, 1, 2, 3]
    with pytest.raises(UsageError, match="stride 4 needs at least 5"):
        plan_nets(layers, TrainConfig(strides=(4,)))
    with pytest.raises(UsageError, match="not MoE layers"):
        plan_nets(layers, TrainConfig(sources=(9,)))
    with pytest.raises(UsageError, match="no net to train"):
        plan_nets(layers, TrainConfig(sources=(3,)))
    from dataclasses import replace

    with pytest.raises(UsageError, match="no hidden states"):
        train(replace(planted, hidden=None), TrainConfig(), progress=False)


def test_report_runs_the_whole_evaluation(tmp_path, monkeypatch):
    from predictors import report

    meta = synthetic_meta(n_layer=3, n_expert=8, k=2, n_embd=8)
    planted_trace(tmp_path / "train.npz", n_prompts=8, tokens=10, meta=meta, seed=1)
    planted_trace(tmp_path / "eval.npz", n_prompts=3, tokens=10, meta=meta, seed=2)
    monkeypatch.setattr("sys.argv", ["report", "--train", str(tmp_path / "train.npz"), "--eval",
                                     str(tmp_path / "eval.npz"), "--out", str(tmp_path / "rep"), "--hidden", "8",
                                     "--epochs", "1", "--strides", "1", "2"])
    pytest.importorskip("matplotlib")
    report.main()
    import json

    res = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert [r["predictor"] for r in res["strides"]["2"]] == ["mlp", "mlp-multi", "token", "reuse", "eam",
                                                             "expert-map", "oracle"]
    assert res["strides"]["1"][-1]["overall"]["accuracy"] == 1.0
    assert (tmp_path / "rep" / "accuracy-s2.png").is_file() and "## Stride 2" in (tmp_path / "rep" / "README.md").read_text()


@pytest.fixture(scope="module")
def planted_requests(tmp_path_factory):
    """Every token of a prompt has the prompt's group: token t's input at layer l gives token t+1's experts there."""
    path = tmp_path_factory.mktemp("train") / "requests.npz"
    planted_trace(path, n_prompts=40, tokens=24, meta=synthetic_meta(n_layer=4, n_expert=8, k=2, n_embd=16),
                  n_groups=12, group_by="prompt", noise=0.3, seed=6)
    return load_trace(path)


def test_token_mode_learns_the_next_token_of_each_layer(planted_requests, tmp_path):
    cfg = TrainConfig(fit=FIT, mode="token", strides=(2,), seed=0, threads=1)
    arrays, meta = train(planted_requests, cfg, progress=False)
    assert meta["mode"] == "token" and meta["version"] == 2 and meta["training"]["strides"] == []
    assert [(n["il"], n["targets"]) for n in meta["nets"]] == [(0, [0]), (1, [1]), (2, [2]), (3, [3])]
    assert all(n["metrics"]["val_accuracy_mean"] >= 0.95 for n in meta["nets"])
    # 40 prompts of 8 prefill + 16 decode tokens: 15 pairs each, split 36 / 4 by prompt
    assert (meta["training"]["n_train_rows"], meta["training"]["n_val_rows"]) == (36 * 15, 4 * 15)
    path = export(tmp_path / "token.npz", arrays, meta)
    shape = _shape(planted_requests)
    p = make_predictor(str(path), shape, 1, mode="token")
    _, va = split_prompts(planted_requests.n_prompts, 0.1, seed=0)
    held = select_prompts(planted_requests, va)
    rows = next_token_pairs(held)
    hits = 0
    for r in rows:
        for j, il in enumerate(shape.layers):
            p.observe(il, held.ids[r, j], None, held.hidden[r, j].astype(np.float32))
            top = np.argsort(-p.predict_next(il), kind="stable")[:2]
            hits += len(set(top.tolist()) & set(held.ids[r + 1, j].tolist()))
    assert hits / (2 * len(rows) * shape.n_layer) >= 0.95
    from ggmoe.base.errors import PredictorFileError

    with pytest.raises(PredictorFileError, match="trained for mode token, stride 1; this run needs mode layer"):
        make_predictor(str(path), shape, 1)  # the stride prefetcher's predictor


def test_token_mode_refuses_what_it_cannot_learn_from(planted_requests):
    from dataclasses import replace

    with pytest.raises(UsageError, match="does not go with --mode token"):
        train(planted_requests, TrainConfig(mode="token", multi=True), progress=False)
    prefill_only = replace(planted_requests, stage=np.zeros_like(planted_requests.stage))
    with pytest.raises(UsageError, match="consecutive decode tokens of one sequence: the traces have none"):
        train(prefill_only, TrainConfig(mode="token"), progress=False)
