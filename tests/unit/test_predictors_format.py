"""The predictor file format (ggmoe.predict.mlp_file): every class of bad file is refused with one clear
PredictorFileError line before any large allocation; the linear kind computes what it says; the writer is
atomic, refuses directories and device nodes, and never leaves a file the reader would refuse."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest

from ggmoe.base.errors import PredictorFileError, UsageError
from ggmoe.predict import ModelShape, make_predictor
from ggmoe.predict.mlp_file import (
    MAX_META_BYTES,
    check_predictor_output,
    read_predictor_file,
    write_predictor_file,
)

pytestmark = pytest.mark.unit

SHAPE = ModelShape(model_fingerprint="00aa11bb22cc33dd", layers=(0, 1, 2), n_expert=4, n_expert_used=2, n_embd=3)
H = 5


def _meta(kind: str = "mlp", **kw) -> dict:
    meta = {"format": "ggmoe-predictor", "version": 1, "kind": kind, "model_fingerprint": SHAPE.model_fingerprint,
            "model_name": "m.gguf", "layers": [0, 1, 2], "n_expert": 4, "n_expert_used": 2, "n_embd": 3,
            "dtype": "float32", "hidden": H if kind == "mlp" else 0,
            "nets": [{"il": 0, "targets": [1], "metrics": {}}, {"il": 1, "targets": [2], "metrics": {}}]}
    return meta | kw


def _arrays(kind: str = "mlp", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(2):
        if kind == "mlp":
            out |= {f"net{i}.w1": rng.standard_normal((H, 3)).astype(np.float32),
                    f"net{i}.b1": rng.standard_normal(H).astype(np.float32),
                    f"net{i}.w2": rng.standard_normal((4, H)).astype(np.float32),
                    f"net{i}.b2": rng.standard_normal(4).astype(np.float32)}
        else:
            out |= {f"net{i}.w": rng.standard_normal((4, 3)).astype(np.float32),
                    f"net{i}.b": rng.standard_normal(4).astype(np.float32)}
        out |= {f"net{i}.mean": rng.standard_normal(3).astype(np.float32),
                f"net{i}.std": rng.uniform(0.5, 2, 3).astype(np.float32)}
    return out


def _npy(a: np.ndarray, shape: tuple[int, ...] | None = None, data: bytes | None = None) -> bytes:
    """The .npy bytes of ``a``, with its header's shape (and the data) optionally replaced: a lying header."""
    buf = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(a)
    if shape is not None:
        d["shape"] = shape
    np.lib.format.write_array_header_1_0(buf, d)
    buf.write(a.tobytes() if data is None else data)
    return buf.getvalue()


def _zip(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, raw in members.items():
            z.writestr(name, raw)
    return path


def _members(meta: dict | None = None, arrays: dict | None = None) -> dict[str, bytes]:
    meta_arr = np.frombuffer(json.dumps(_meta() if meta is None else meta).encode(), np.uint8)
    arrays = _arrays() if arrays is None else arrays
    return {"meta.npy": _npy(meta_arr)} | {f"{k}.npy": _npy(v) for k, v in arrays.items()}


def _meta_bytes(meta: object) -> bytes:
    return _npy(np.frombuffer(json.dumps(meta).encode(), np.uint8))


w1 = _arrays()["net0.w1"]
BAD = {  # case -> (zip members, message)
    "meta a JSON list": (_members() | {"meta.npy": _meta_bytes([1, 2])}, "metadata is a JSON list, not an object"),
    "meta a JSON string": (_members() | {"meta.npy": _meta_bytes("mlp")}, "metadata is a JSON str"),
    "version a bool": (_members(_meta(version=True)), "version True is not supported"),
    "fingerprint an int": (_members(_meta(model_fingerprint=7)), "model_fingerprint must be a string"),
    "n_expert_used 0": (_members(_meta(n_expert_used=0)), "n_expert_used must be a positive integer, not 0"),
    "n_expert_used > n_expert": (_members(_meta(n_expert_used=5)), "n_expert_used 5 exceeds n_expert 4"),
    "n_embd a float": (_members(_meta(n_embd=3.0)), "n_embd must be a positive integer, not 3.0"),
    "hidden huge": (_members(_meta(hidden=10**9)), "hidden must be a positive integer up to 65536"),
    "layers unordered": (_members(_meta(layers=[0, 2, 1])), "at least 2 ascending layer indices"),
    "layers not a list": (_members(_meta(layers="0,1,2")), "at least 2 ascending layer indices"),
    "dtype a list": (_members(_meta(dtype=["float32"])), "weight dtype \\['float32'\\]"),
    "nets not a list": (_members(_meta(nets={"il": 0})), "lists no nets"),
    "net entry not a dict": (_members(_meta(nets=[[0, 1]])), "net 0: bad entry"),
    "net il a string": (_members(_meta(nets=[{"il": "0", "targets": [1]}])), "net 0: bad entry"),
    "net targets repeated": (_members(_meta(nets=[{"il": 0, "targets": [1, 1]}])), "not later MoE layers"),
    "too many nets": (_members(_meta(nets=[{"il": 0, "targets": [1]}] * 10)), "lists 10 nets"),
    "kind unknown": (_members(_meta(kind="gru")), "kind 'gru' is not one of"),
    "linear with hidden units": (_members(_meta("linear", hidden=5), _arrays("linear")), "hidden must be 0"),
    "linear file with mlp arrays": (_members(_meta("linear")), "missing array net0.w"),
    "mlp file with linear arrays": (_members(_meta(), _arrays("linear")), "missing array net0.w1"),
    "other model": (_members(_meta(model_fingerprint="ffffffffffffffff")), "trained for model ffffffffffffffff"),
    "no meta": ({k: v for k, v in _members().items() if k != "meta.npy"}, "missing array meta"),
    "nan weights": (_members(arrays=_arrays() | {"net0.w2": np.full((4, H), np.nan, np.float32)}),
                    "net0.w2: contains NaN"),
    "infinite std": (_members(arrays=_arrays() | {"net1.std": np.full(3, np.inf, np.float32)}),
                     "net1.std: contains NaN or infinity"),
    "wrong weight dtype": (_members(arrays=_arrays() | {"net1.b2": np.zeros(4, np.int32)}), "net1.b2: dtype int32"),
    "huge declared shape": (_members() | {"net0.w1.npy": _npy(w1, shape=(10**12, 3))},
                            "net0.w1: shape \\(1000000000000, 3\\), expected \\(5, 3\\)"),
    "header larger than data": (_members() | {"net0.w1.npy": _npy(w1, data=w1.tobytes()[:12])},
                                "net0.w1: the header declares 60 data bytes, the member holds 12"),
    "header smaller than data": (_members() | {"net0.w1.npy": _npy(w1, data=w1.tobytes() * 2)},
                                 "the member holds 120"),
    "huge meta": (_members() | {"meta.npy": _npy(np.zeros(1, np.uint8), shape=(MAX_META_BYTES + 1,))},
                  f"meta: {MAX_META_BYTES + 1} bytes, more than"),
    "not an npy member": (_members() | {"net0.w1.npy": b"\x93NUMPY garbage"}, "net0.w1: not a valid .npy array"),
    "non-npy member": (_members() | {"README.txt": b"hello"}, "unexpected zip member 'README.txt'"),
    "directory member": (_members() | {"sub/": b""}, "unexpected zip member 'sub/'"),
    "string array": (_members(arrays=_arrays() | {"net0.b1": np.array(["a"] * H)}), "net0.b1: dtype <U1"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_are_refused_with_one_line(tmp_path, case):
    members, message = BAD[case]
    path = _zip(tmp_path / "bad.npz", members)
    with pytest.raises(PredictorFileError, match=message) as e:
        read_predictor_file(path, SHAPE)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")


def test_the_good_members_of_the_table_load(tmp_path):
    """The table's base files are valid: each bad case differs from a good file by its one defect."""
    for kind in ("mlp", "linear"):
        f = read_predictor_file(_zip(tmp_path / f"{kind}.npz", _members(_meta(kind), _arrays(kind))), SHAPE)
        assert f.kind == kind and [n.il for n in f.nets] == [0, 1]


def test_object_array_header_is_refused_without_pickle(tmp_path):
    raw = io.BytesIO()
    np.save(raw, np.array([{"a": 1}] * H, dtype=object), allow_pickle=True)
    path = _zip(tmp_path / "obj.npz", _members() | {"net0.b1.npy": raw.getvalue()})
    with pytest.raises(PredictorFileError, match="net0.b1 cannot be read without pickle"):
        read_predictor_file(path, SHAPE)


def test_npy_renamed_npz_and_other_non_zips(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(3))
    (tmp_path / "a.npy").rename(tmp_path / "renamed.npz")
    with pytest.raises(PredictorFileError, match="not an .npz archive: a single .npy array"):
        read_predictor_file(tmp_path / "renamed.npz", SHAPE)
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(PredictorFileError, match="no zip archive found"):
        read_predictor_file(tmp_path / "text.npz", SHAPE)
    (tmp_path / "dir.npz").mkdir()
    with pytest.raises(PredictorFileError, match="predictor file not found"):
        read_predictor_file(tmp_path / "dir.npz", SHAPE)


def test_compressed_and_fortran_order_files_load(tmp_path):
    a = _arrays()
    np.savez_compressed(tmp_path / "c.npz", meta=np.frombuffer(json.dumps(_meta()).encode(), np.uint8),
                        **a | {"net0.w1": np.asfortranarray(a["net0.w1"])})
    f = read_predictor_file(tmp_path / "c.npz", SHAPE)
    assert np.array_equal(f.nets[0].w1t, a["net0.w1"].T)


def test_linear_kind_computes_sigmoid_of_wx_plus_b(tmp_path):
    a = _arrays("linear")
    path = write_predictor_file(tmp_path / "lin.npz", _meta("linear"), a)
    p = make_predictor(str(path), SHAPE, 1)
    h = np.array([0.5, -2.0, 1.0], np.float32)
    p.begin_request()
    p.begin_token(3)
    p.observe(1, np.array([0, 1]), None, h)
    x = (h - a["net1.mean"]) / a["net1.std"]
    assert np.allclose(p.predict(2), 1 / (1 + np.exp(-(a["net1.w"] @ x + a["net1.b"]))), atol=1e-6)


# --- the writer --------------------------------------------------------------------------------


def test_writer_replaces_atomically_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "sub" / "p.npz"
    write_predictor_file(out, _meta(), _arrays(seed=1))
    first = out.read_bytes()
    write_predictor_file(out, _meta(), _arrays(seed=2))
    assert out.read_bytes() != first and os.listdir(out.parent) == ["p.npz"]
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask
    assert np.array_equal(read_predictor_file(out, SHAPE).nets[0].b2, _arrays(seed=2)["net0.b2"])


@pytest.mark.parametrize("meta, arrays, message", [
    (_meta(n_expert_used=0), _arrays(), "metadata n_expert_used must be a positive integer"),
    (_meta(), _arrays() | {"net0.w1": np.zeros((H, 4), np.float32)}, "net0.w1: shape \\(5, 4\\)"),
    (_meta(), _arrays() | {"net1.b1": np.full(H, np.nan, np.float32)}, "net1.b1: contains NaN"),
    (_meta(), {k: v for k, v in _arrays().items() if k != "net1.std"}, "missing array net1.std"),
])
def test_writer_refuses_what_the_reader_would_and_keeps_the_old_file(tmp_path, meta, arrays, message):
    out = write_predictor_file(tmp_path / "p.npz", _meta(), _arrays())
    before = out.read_bytes()
    with pytest.raises(PredictorFileError, match=f"p.npz \\(not written\\): {message}"):
        write_predictor_file(out, meta, arrays)
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["p.npz"]


def test_output_checks(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        write_predictor_file(tmp_path, _meta(), _arrays())
    if os.path.exists("/dev/null"):
        with pytest.raises(UsageError, match="predictor file /dev/null is a device"):
            check_predictor_output("/dev/null")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="(?i)not a directory"):
        check_predictor_output(tmp_path / "file" / "p.npz")
    assert check_predictor_output(tmp_path / "new" / "deeper" / "p.npz") == tmp_path / "new" / "deeper" / "p.npz"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(UsageError, match="cannot write in"):
            check_predictor_output(ro / "p.npz")


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_folded_nets_compute_the_same_logits(tmp_path, kind):
    """What the engine's graph computes (normalisation folded into the first layer) equals the file's nets."""
    path = write_predictor_file(tmp_path / f"{kind}.npz", _meta(kind), _arrays(kind, seed=3))
    hidden = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32) * 3
    for net in read_predictor_file(path, SHAPE).nets:
        f = net.folded()
        assert (f.w1 is None) == (kind == "linear") and f.w2.flags.c_contiguous
        assert f.w2.shape == (4, H if kind == "mlp" else 3)
        np.testing.assert_allclose(f.logits(hidden), net.logits(hidden), rtol=1e-5, atol=1e-5)
