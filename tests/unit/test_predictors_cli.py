"""``ggmoe train-predictor`` / ``ggmoe eval-predictor`` on a small synthetic trace (TraceWriter)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.base.hook import RouteEvent
from ggmoe.cli import main
from ggmoe.trace import STAGE_DECODE, STAGE_PREFILL, TraceWriter
from predictors.synthetic import planted_trace, synthetic_meta


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    planted_trace(d / "a.npz", n_prompts=20, tokens=12, group_by="token", seed=3)
    planted_trace(d / "nohidden.npz", n_prompts=6, tokens=6, keep_hidden=False, seed=4)
    other = synthetic_meta(fingerprint="0123456789abcdef")
    planted_trace(d / "other.npz", n_prompts=4, tokens=6, meta=other, seed=5)
    return d


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _one_line_error(res, text: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], res.stderr


def test_eval_builtins_text_json_and_plot(traces, tmp_path):
    res = _run("eval-predictor", str(traces / "a.npz"), "-p", "oracle", "-p", "reuse", "-p", "token",
               "-p", "eam", "-p", "expert-map", "--plot", str(tmp_path / "acc.png"))
    assert res.exit_code == 0, res.output
    assert "oracle: stride 1, k=2, prefetch m=4, 2 held-out prompts, 24 tokens" in res.output
    assert (tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG"
    res = _run("eval-predictor", str(traces / "a.npz"), "-p", "oracle", "-p", "token", "-p", "reuse", "--json",
               "--stride", "2", "--prefetch", "3", "--stage", "decode", "--opt", "decay=0.25")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    oracle, token, _ = out["results"]
    assert out["stage"] == "decode" and oracle["stride"] == 2 and oracle["prefetch"] == 3
    assert oracle["overall"]["accuracy"] == 1.0 and token["overall"]["accuracy"] > 0.8  # a few unseen tokens
    assert [s["il"] for s in oracle["layers"]] == [0, 1, 2, 3]


def test_eval_with_separate_training_traces(traces):
    res = _run("eval-predictor", str(traces / "a.npz"), "--train", str(traces / "a.npz"), "-p", "token", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["results"][0]
    assert r["n_prompts"] == 20 and r["overall"]["accuracy"] == 1.0


@pytest.mark.parametrize("args, text", [
    (["missing.npz", "-p", "reuse"], "trace file not found"),
    (["{d}/a.npz", "-p", "nope"], "unknown predictor 'nope'"),
    (["{d}/a.npz", "-p", "reuse", "--stride", "4"], "stride 4 needs at least 5 MoE layers"),
    (["{d}/nohidden.npz", "-p", "skip-gate", "--model", "{d}/a.npz"], "is not the model the trace was recorded"),
    (["{d}/nohidden.npz", "-p", "{d}/missing-pred.npz"], "predictor file not found"),
    (["{d}/a.npz", "-p", "reuse", "--prefetch", "99"], "prefetch 99 must be between"),
    (["{d}/a.npz", "-p", "reuse", "--opt", "capacity=3"], "not accepted by"),
    (["{d}/a.npz", "-p", "eam", "--opt", "nonsense"], "expected KEY=VALUE"),
    (["{d}/a.npz", "-p", "token", "--train", "{d}/other.npz"], "another model"),
    (["{d}/a.npz", "-p", "skip-gate"], "needs the model's GGUF"),
])
def test_eval_bad_inputs(traces, args, text):
    _one_line_error(_run("eval-predictor", *[a.format(d=traces) for a in args]), text)


def test_eval_mlp_on_trace_without_hidden(traces, tmp_path):
    pytest.importorskip("torch")
    pred = tmp_path / "p.npz"
    res = _run("train-predictor", str(traces / "a.npz"), "-o", str(pred), "--hidden", "8", "--epochs", "2",
               "--threads", "1")
    assert res.exit_code == 0, res.output
    meta = synthetic_meta()
    w = TraceWriter(meta, keep_hidden=False)  # same model, no hidden states
    for stage, n in ((STAGE_PREFILL, 3), (STAGE_DECODE, 1)):
        ev = {il: RouteEvent(il=il, ids=np.tile(np.array([[0, 1]], np.int32), (n, 1)),
                             probs=np.full((n, 8), 0.125, np.float32), hidden=None) for il in range(4)}
        w.add_step([1] * n, 0, stage, ev)
    w.end_prompt()
    w.add_step([1], 0, STAGE_PREFILL, {il: RouteEvent(il=il, ids=np.array([[2, 3]], np.int32),
                                                      probs=np.full((1, 8), 0.125, np.float32), hidden=None)
                                       for il in range(4)})
    w.end_prompt()
    w.save(tmp_path / "nh.npz")
    _one_line_error(_run("eval-predictor", str(tmp_path / "nh.npz"), "-p", str(pred)), "needs MoE input hidden states")


def test_train_then_eval(traces, tmp_path):
    pytest.importorskip("torch")
    pred = tmp_path / "pred.npz"
    res = _run("train-predictor", str(traces / "a.npz"), "-o", str(pred), "--stride", "1", "--stride", "3",
               "--layers", "0,1", "--hidden", "32", "--epochs", "3", "--seed", "1", "--dtype", "float16",
               "--threads", "1")
    assert res.exit_code == 0, res.output
    assert f"{pred}: 3 nets" in res.stdout
    with np.load(pred, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes())
        assert z["net0.w1"].dtype == np.float16 and z["net0.mean"].dtype == np.float32
    assert [(n["il"], n["targets"]) for n in meta["nets"]] == [(0, [1]), (0, [3]), (1, [2])]
    res = _run("eval-predictor", str(traces / "a.npz"), "-p", str(pred), "--stride", "3", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["results"][0]
    assert r["layers"][3]["n"] == 24 and r["layers"][1]["n"] == 0
    _one_line_error(_run("eval-predictor", str(traces / "a.npz"), "-p", str(pred), "--stride", "2"),
                    "trained for strides 1, 3; this run needs stride 2")
    _one_line_error(_run("eval-predictor", str(traces / "other.npz"), "-p", str(pred)), "trained for model")


def test_train_bad_inputs(traces, tmp_path):
    pytest.importorskip("torch")
    out = str(tmp_path / "p.npz")
    _one_line_error(_run("train-predictor", str(traces / "nohidden.npz"), "-o", out), "no hidden states")
    _one_line_error(_run("train-predictor", str(traces / "a.npz"), "-o", out, "--stride", "5"), "stride 5 needs")
    _one_line_error(_run("train-predictor", str(traces / "a.npz"), "-o", out, "--layers", "x"), "comma-separated")
    _one_line_error(_run("train-predictor", str(tmp_path / "none.npz"), "-o", out), "trace file not found")


def test_train_without_torch_says_what_to_install(traces, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    _one_line_error(_run("train-predictor", str(traces / "a.npz"), "-o", str(tmp_path / "p.npz")),
                    "install ggmoe[train]")


def test_help_lists_the_commands():
    res = _run("--help")
    assert "train-predictor" in res.output and "eval-predictor" in res.output
