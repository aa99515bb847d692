"""Trace format: round trip, and every malformed file rejected with TraceFormatError."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from ggmoe.base.errors import TraceFormatError
from ggmoe.base.hook import RouteEvent, RouteRecorder
from ggmoe.trace import STAGE_DECODE, STAGE_PREFILL, TraceMeta, TraceWriter, load_trace

E, K, D, LAYERS = 8, 2, 16, (0, 2, 3)
META = TraceMeta(model_fingerprint="0" * 16, model_name="m.gguf", arch="qwen3moe", n_layer=4, n_expert=E,
                 n_expert_used=K, n_embd=D, mode="greedy", max_tokens=3, ggmoe_version="test")


def _events(rng: np.random.Generator, n: int) -> dict[int, RouteEvent]:
    out = {}
    for il in LAYERS:
        probs = rng.dirichlet(np.ones(E), size=n).astype(np.float32)
        ids = np.argsort(-probs, axis=1)[:, :K].astype(np.int32)
        out[il] = RouteEvent(il=il, ids=ids, probs=probs, hidden=rng.standard_normal((n, D)).astype(np.float32))
    return out


def _write(tmp_path, keep_hidden=True):
    rng = np.random.default_rng(0)
    w = TraceWriter(META, keep_hidden=keep_hidden)
    steps = []
    for _ in range(2):
        for n, stage in ((5, STAGE_PREFILL), (1, STAGE_DECODE), (1, STAGE_DECODE)):
            ev = _events(rng, n)
            toks = rng.integers(0, 100, n).tolist()
            w.add_step(toks, 0, stage, ev)
            steps.append((toks, ev))
        w.end_prompt()
    return w.save(tmp_path / "trace.npz"), steps


def test_round_trip(tmp_path):
    path, steps = _write(tmp_path)
    tr = load_trace(tmp_path)  # a directory resolves to DIR/trace.npz
    assert tr.meta == META
    assert tr.n_tokens == 14 and tr.n_prompts == 2
    assert tr.prompt_offsets.tolist() == [0, 7, 14]
    assert tr.layers.tolist() == list(LAYERS)
    assert tr.stage.tolist() == [0] * 5 + [1, 1] + [0] * 5 + [1, 1]
    toks = np.concatenate([np.asarray(t) for t, _ in steps])
    assert np.array_equal(tr.token_ids, toks)
    ids = np.concatenate([np.stack([ev[il].ids for il in LAYERS], 1) for _, ev in steps])
    assert np.array_equal(tr.ids, ids)
    probs = np.concatenate([np.stack([ev[il].probs for il in LAYERS], 1) for _, ev in steps])
    assert np.allclose(tr.probs, probs, atol=1e-3)
    assert tr.hidden.shape == (14, 3, D)
    assert tr.layer_index(2) == 1
    with pytest.raises(KeyError):
        tr.layer_index(1)


def test_without_hidden(tmp_path):
    _write(tmp_path, keep_hidden=False)
    assert load_trace(tmp_path / "trace.npz").hidden is None


def _rewrite(path, **changes):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)


def _meta_bytes(**kw):
    d = {**META.__dict__, **kw}
    return np.frombuffer(json.dumps(d).encode(), dtype=np.uint8)


@pytest.mark.parametrize("changes, message", [
    ({"ids": None}, "missing arrays"),
    ({"ids": np.zeros((14, 3, K), np.int64)}, "dtype"),
    ({"probs": np.zeros((14, 3, E + 1), np.float16)}, "shape"),
    ({"ids": np.full((14, 3, K), E, np.int16)}, "expert ids"),
    ({"prompt_offsets": np.array([0, 9, 7, 14], np.int64)}, "prompt_offsets"),
    ({"layers": np.array([0, 3, 2], np.int32)}, "layers"),
    ({"stage": np.full(14, 7, np.uint8)}, "stage"),
    ({"meta": _meta_bytes(format="other")}, "not a ggmoe trace"),
    ({"meta": _meta_bytes(version=99)}, "version"),
    ({"meta": np.frombuffer(b"{not json", np.uint8)}, "metadata"),
])
def test_rejects_malformed(tmp_path, changes, message):
    path, _ = _write(tmp_path)
    _rewrite(path, **changes)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04truncated"])
def test_rejects_non_npz(tmp_path, content):
    p = tmp_path / "trace.npz"
    p.write_bytes(content)
    with pytest.raises(TraceFormatError):
        load_trace(p)


def test_rejects_pickled_object_arrays(tmp_path):
    path, _ = _write(tmp_path)
    _rewrite(path, ids=np.array([object()], dtype=object))
    with pytest.raises(TraceFormatError):
        load_trace(path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceFormatError, match="not found"):
        load_trace(tmp_path / "nope.npz")


def test_writer_rejects_inconsistent_steps():
    rng = np.random.default_rng(1)
    w = TraceWriter(META, keep_hidden=True)
    w.add_step([1, 2], 0, STAGE_PREFILL, _events(rng, 2))
    ev = _events(rng, 1)
    del ev[3]
    with pytest.raises(TraceFormatError, match="layers changed"):
        w.add_step([3], 2, STAGE_DECODE, ev)
    with pytest.raises(TraceFormatError, match="rows"):
        w.add_step([3, 4], 2, STAGE_DECODE, _events(rng, 1))


def test_recorder_joins_micro_batches():
    rng = np.random.default_rng(2)
    rec = RouteRecorder()
    a, b = _events(rng, 3), _events(rng, 2)
    for ev in (a, b):
        for e in ev.values():
            rec.on_route(e)
    out = rec.take()
    assert sorted(out) == list(LAYERS)
    assert np.array_equal(out[2].ids, np.concatenate([a[2].ids, b[2].ids]))
    assert np.array_equal(out[0].hidden, np.concatenate([a[0].hidden, b[0].hidden]))
    assert rec.take() == {}
    one = replace(a[0], hidden=None)
    rec.on_route(one)
    rec.on_route(b[0])
    assert rec.take()[0].hidden is None


def _gptoss_events(rng: np.random.Generator, n: int) -> dict[int, RouteEvent]:
    """gpt-oss's hook: probabilities (softmax of the logits) and the raw logits under their own name."""
    out = {}
    for il in LAYERS:
        logits = (rng.standard_normal((n, E)) * 3).astype(np.float32)
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        ids = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
        out[il] = RouteEvent(il=il, ids=ids, probs=z / z.sum(axis=1, keepdims=True), hidden=None, logits=logits)
    return out


GPTOSS = replace(META, arch="gpt-oss", gating="softmax_weight")


def test_logits_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    w = TraceWriter(GPTOSS, keep_hidden=False)
    ev = _gptoss_events(rng, 4)
    w.add_step([1, 2, 3, 4], 0, STAGE_PREFILL, ev)
    tr = load_trace(w.save(tmp_path / "t.npz"))
    assert tr.meta.version == 2 and tr.meta.gating == "softmax_weight"
    assert np.allclose(tr.logits[:, 0], ev[LAYERS[0]].logits, atol=1e-2)
    assert np.allclose(tr.probs.astype(np.float32).sum(axis=2), 1.0, atol=1e-2)


def _as_v1(path, probs):
    """Rewrite a trace as version 1 wrote it: no gating field, the graph's values under probs, no logits."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "logits"}
    d = json.loads(arrays["meta"].tobytes())
    del d["gating"]
    d["version"] = 1
    arrays["meta"] = np.frombuffer(json.dumps(d).encode(), dtype=np.uint8)
    arrays["probs"] = probs
    np.savez(path, **arrays)


@pytest.mark.parametrize("arch, gating, converts", [
    ("qwen3moe", "softmax", False),
    ("deepseek2", "softmax", False),
    ("gpt-oss", "softmax_weight", True),
])
def test_reads_version_1(tmp_path, arch, gating, converts):
    """Version 1 stored the graph's probs: gpt-oss's were logits, read back as logits and their softmax."""
    rng = np.random.default_rng(4)
    w = TraceWriter(replace(META, arch=arch), keep_hidden=False)
    w.add_step([1, 2, 3], 0, STAGE_PREFILL, _gptoss_events(rng, 3))
    path = w.save(tmp_path / "t.npz")
    stored = (rng.standard_normal((3, len(LAYERS), E)) * 3).astype(np.float16)
    _as_v1(path, stored)
    tr = load_trace(path)
    assert tr.meta.version == 2 and tr.meta.gating == gating
    if converts:
        assert np.array_equal(tr.logits, stored)
        assert np.allclose(tr.probs.astype(np.float32).sum(axis=2), 1.0, atol=1e-2) and tr.probs.min() >= 0
    else:
        assert tr.logits is None and np.array_equal(tr.probs, stored)


def test_refuses_logits_as_probs(tmp_path):
    """A version 2 trace whose probs are negative holds logits: refused, so no predictor normalises them."""
    path, _ = _write(tmp_path)
    _rewrite(path, probs=np.full((14, 3, E), -1.0, np.float16))
    with pytest.raises(TraceFormatError, match="not probabilities"):
        load_trace(path)
