"""The mlp predictor file: a valid file loads and computes what it says; every malformed or
mismatched file is refused with PredictorFileError (numpy only, no torch)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ggmoe.base.errors import PredictorFileError, UsageError
from ggmoe.predict import ModelShape, make_predictor
from ggmoe.predict.mlp import load_mlp_file

SHAPE = ModelShape(model_fingerprint="00aa11bb22cc33dd", layers=(0, 1, 2), n_expert=4, n_expert_used=2, n_embd=3)
H = 5


def _meta(**kw) -> dict:
    meta = {"format": "ggmoe-predictor", "version": 1, "kind": "mlp", "model_fingerprint": SHAPE.model_fingerprint,
            "model_name": "m.gguf", "layers": [0, 1, 2], "n_expert": 4, "n_expert_used": 2, "n_embd": 3,
            "dtype": "float32", "hidden": H,
            "nets": [{"il": 0, "targets": [1], "metrics": {}}, {"il": 1, "targets": [2], "metrics": {}}]}
    meta.update(kw)
    return meta


def _arrays(seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(2):
        out |= {f"net{i}.w1": rng.standard_normal((H, 3)).astype(dtype), f"net{i}.b1": rng.standard_normal(H).astype(dtype),
                f"net{i}.w2": rng.standard_normal((4, H)).astype(dtype), f"net{i}.b2": rng.standard_normal(4).astype(dtype),
                f"net{i}.mean": rng.standard_normal(3).astype(np.float32),
                f"net{i}.std": rng.uniform(0.5, 2, 3).astype(np.float32)}
    return out


def _write(path, meta: dict | None = None, arrays: dict | None = None, raw_meta: np.ndarray | None = None):
    meta_arr = raw_meta if raw_meta is not None else np.frombuffer(json.dumps(meta or _meta()).encode(), np.uint8)
    np.savez(path, meta=meta_arr, **(arrays if arrays is not None else _arrays()))
    return path


def test_valid_file_computes_the_documented_function(tmp_path):
    path = _write(tmp_path / "p.npz")
    a = _arrays()
    p = make_predictor(str(path), SHAPE, 1)
    h = np.array([0.3, -1.0, 2.0], np.float32)
    p.begin_request()
    p.begin_token(7)
    assert p.predict(1) is None  # no layer seen yet
    p.observe(0, np.array([0, 1]), None, h)
    x = (h - a["net0.mean"]) / a["net0.std"]
    want = 1 / (1 + np.exp(-(a["net0.w2"] @ np.maximum(a["net0.w1"] @ x + a["net0.b1"], 0) + a["net0.b2"])))
    assert np.allclose(p.predict(1), want, atol=1e-6)
    assert p.strides() == [1]


def test_multi_target_columns(tmp_path):
    meta = _meta(nets=[{"il": 0, "targets": [1, 2], "metrics": {}}])
    rng = np.random.default_rng(1)
    arrays = {"net0.w1": rng.standard_normal((H, 3)).astype(np.float32), "net0.b1": np.zeros(H, np.float32),
              "net0.w2": rng.standard_normal((8, H)).astype(np.float32), "net0.b2": np.zeros(8, np.float32),
              "net0.mean": np.zeros(3, np.float32), "net0.std": np.ones(3, np.float32)}
    path = _write(tmp_path / "m.npz", meta, arrays)
    p1, p2 = make_predictor(str(path), SHAPE, 1), make_predictor(str(path), SHAPE, 2)
    h = np.array([1.0, 2.0, 3.0], np.float32)
    for p in (p1, p2):
        p.begin_token(0)
        p.observe(0, np.array([0, 1]), None, h)
    z = arrays["net0.w2"] @ np.maximum(arrays["net0.w1"] @ h, 0)
    assert np.allclose(p1.predict(1), 1 / (1 + np.exp(-z[:4])), atol=1e-6)
    assert np.allclose(p2.predict(2), 1 / (1 + np.exp(-z[4:])), atol=1e-6)
    p1.observe(1, np.array([0, 1]), None, h)
    assert p1.predict(2) is None  # no net from layer 1: not scored


def test_float16_weights_load(tmp_path):
    path = _write(tmp_path / "h.npz", _meta(dtype="float16"), _arrays(dtype=np.float16))
    assert load_mlp_file(path, SHAPE).nets[0].w1t.dtype == np.float32


def _drop(key):
    a = _arrays()
    del a[key]
    return a


def _with(key, value):
    return _arrays() | {key: value}


BAD = {
    "other model": (dict(meta=_meta(model_fingerprint="ffffffffffffffff")),
                    "trained for model ffffffffffffffff \\(m.gguf\\); this run needs model 00aa11bb22cc33dd$"),
    "n_expert": (dict(meta=_meta(n_expert=8)), "n_expert 8 does not match"),
    "layers": (dict(meta=_meta(layers=[0, 1, 3])), "MoE layers"),
    "format": (dict(meta=_meta(format="something")), "not a ggmoe predictor file"),
    "version": (dict(meta=_meta(version=9)), "version 9 is not supported"),
    "mode": (dict(meta=_meta(version=2, mode="chunk")), "mode 'chunk' is not one of"),
    "mode missing": (dict(meta=_meta(version=2)), "mode None is not one of"),
    "token mode in version 1": (dict(meta=_meta(mode="token")), "mode 'token' needs predictor format version 2"),
    "token net on another layer": (dict(meta=_meta(version=2, mode="token")), "a mode token net predicts its own"),
    "kind": (dict(meta=_meta(kind="gru")), "kind 'gru'"),
    "dtype": (dict(meta=_meta(dtype="int8")), "weight dtype 'int8'"),
    "hidden type": (dict(meta=_meta(hidden="5")), "hidden must be a positive integer"),
    "no nets": (dict(meta=_meta(nets=[])), "lists no nets"),
    "missing meta key": (dict(meta={k: v for k, v in _meta().items() if k != "n_embd"}), "lacks \\['n_embd'\\]"),
    "bad net entry": (dict(meta=_meta(nets=[{"il": 0}])), "net 0: bad entry"),
    "target not later": (dict(meta=_meta(nets=[{"il": 1, "targets": [0]}])), "not later MoE layers"),
    "meta not json": (dict(raw_meta=np.frombuffer(b"\xff{", np.uint8)), "bad metadata"),
    "meta dtype": (dict(raw_meta=np.zeros(3, np.float32)), "meta: dtype float32"),
    "missing array": (dict(arrays=_drop("net1.b2")), "missing array net1.b2"),
    "wrong dtype": (dict(arrays=_with("net0.w1", np.zeros((H, 3), np.float64))), "net0.w1: dtype float64"),
    "wrong shape": (dict(arrays=_with("net0.w2", np.zeros((5, H), np.float32))), "net0.w2: shape \\(5, 5\\)"),
    "nan": (dict(arrays=_with("net1.b1", np.full(H, np.nan, np.float32))), "NaN"),
    "std": (dict(arrays=_with("net0.std", np.zeros(3, np.float32))), "std must be positive"),
    "extra array": (dict(arrays=_with("net7.w1", np.zeros(1, np.float32))), "unexpected arrays"),
    "pickle": (dict(arrays=_with("net0.b1", np.array([{"a": 1}], dtype=object))), "without pickle"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_or_mismatched_files_are_refused(tmp_path, case):
    kw, message = BAD[case]
    path = _write(tmp_path / "bad.npz", **kw)
    with pytest.raises(PredictorFileError, match=message):
        make_predictor(str(path), SHAPE, 1)


def test_not_an_npz(tmp_path):
    (tmp_path / "garbage.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(PredictorFileError, match="not a readable .npz"):
        load_mlp_file(tmp_path / "garbage.npz", SHAPE)
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with pytest.raises(PredictorFileError, match="not an .npz archive"):
        load_mlp_file(tmp_path / "plain.npy", SHAPE)
    import pickle

    (tmp_path / "pickled.npz").write_bytes(pickle.dumps({"meta": 1}))
    with pytest.raises(PredictorFileError, match="not a readable .npz"):
        load_mlp_file(tmp_path / "pickled.npz", SHAPE)
    with pytest.raises(PredictorFileError, match="not found"):
        make_predictor(str(tmp_path / "missing.npz"), SHAPE, 1)


def test_stride_not_in_the_file(tmp_path):
    path = _write(tmp_path / "p.npz")
    with pytest.raises(PredictorFileError, match="p.npz: trained for stride 1; this run needs stride 2$"):
        make_predictor(str(path), SHAPE, 2)


TOKEN_NETS = [{"il": 0, "targets": [0], "metrics": {}}, {"il": 1, "targets": [1], "metrics": {}}]


def test_a_version_1_file_is_mode_layer_and_a_token_file_predicts_the_next_token(tmp_path):
    old = make_predictor(str(_write(tmp_path / "v1.npz")), SHAPE, 1)
    assert old.file.mode == "layer" and old.file.meta["version"] == 1 and not old.predicts_next
    path = _write(tmp_path / "t.npz", _meta(version=2, mode="token", nets=TOKEN_NETS))
    p = make_predictor(str(path), SHAPE, 2, mode="token")  # one token ahead, whatever the stride of the run
    assert p.predicts_next and p.strides() == [1] and p.graph_net(0) is None
    a = _arrays()
    h = np.array([0.3, -1.0, 2.0], np.float32)
    p.begin_token(5)
    p.observe(1, np.array([0, 1]), None, h)
    assert p.predict(1) is None and p.predict(2) is None  # nothing within the token
    assert p.predict_next(0) is None  # layer 0 was not the one just observed
    x = (h - a["net1.mean"]) / a["net1.std"]
    want = 1 / (1 + np.exp(-(a["net1.w2"] @ np.maximum(a["net1.w1"] @ x + a["net1.b1"], 0) + a["net1.b2"])))
    assert np.allclose(p.predict_next(1), want, atol=1e-6)


REFUSED = {  # (file meta, what the run needs) -> the one message
    "token file for the stride prefetcher": (dict(version=2, mode="token", nets=TOKEN_NETS), dict(stride=2),
                                            "trained for mode token, stride 1; this run needs mode layer, stride 2$"),
    "layer file for the planner": (dict(version=2, mode="layer"), dict(stride=1, mode="token"),
                                   "trained for mode layer, stride 1; this run needs mode token, stride 1$"),
    "other model and mode": (dict(version=2, mode="token", nets=TOKEN_NETS, model_fingerprint="ffffffffffffffff"),
                             dict(stride=1),
                             "trained for model ffffffffffffffff \\(m.gguf\\); mode token, stride 1; this run "
                             "needs model 00aa11bb22cc33dd; mode layer, stride 1$"),
    "strides": (dict(version=2, mode="layer", nets=[{"il": 0, "targets": [1, 2]}]), dict(stride=3),
                None),  # stride 3 does not exist in a 3-layer model: the predictor refuses it first
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_file_for_another_model_mode_or_stride_is_refused_in_one_message(tmp_path, case, monkeypatch):
    meta, need, message = REFUSED[case]
    path = _write(tmp_path / "x.npz", _meta(**meta))
    if message is None:
        with pytest.raises(UsageError, match="stride 3 needs at least 4 MoE layers"):
            make_predictor(str(path), SHAPE, **need)
        return
    import ggmoe.predict.mlp_file as mf

    read = []
    monkeypatch.setattr(mf, "_read_net", lambda *a: read.append(a))  # refused before any net is read
    with pytest.raises(PredictorFileError, match=f"^{path}: {message}") as e:
        make_predictor(str(path), SHAPE, **need)
    assert "\n" not in str(e.value) and not read


def test_layer_strides_of_a_multi_target_file_are_named(tmp_path):
    path = _write(tmp_path / "m.npz", _meta(version=2, mode="layer", nets=[{"il": 0, "targets": [1]},
                                                                        {"il": 0, "targets": [2]}]))
    from ggmoe.predict.mlp_file import PredictorNeed, read_predictor_file

    with pytest.raises(PredictorFileError, match="trained for mode layer, strides 1, 2; this run needs mode token$"):
        read_predictor_file(path, PredictorNeed(SHAPE, "token", None))
