"""ggmoe.simulate.quality: windows, perplexity and the top-K KL divergence against a reference (issue 46)."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cli.quant import _pareto
from ggmoe.simulate.quality import Scorer, Windows, load_reference, log_softmax, make_windows, save_reference


def _full_kld(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    lp, lq = log_softmax(p_logits).astype(np.float64), log_softmax(q_logits).astype(np.float64)
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def _pass(logits: np.ndarray, targets: np.ndarray, top_k: int, ref=None):
    s = Scorer(top_k, ref)
    s.add(logits, targets)
    return s


@pytest.fixture
def data():
    rng = np.random.default_rng(1)
    p = (rng.normal(size=(150, 50)) * 3).astype(np.float32)
    q = p + (rng.normal(size=p.shape) * 0.5).astype(np.float32)
    return p, q, rng.integers(0, 50, 150)


def test_the_reference_scores_zero_and_the_full_vocabulary_is_exact(data):
    p, q, t = data
    windows = Windows(np.zeros((1, 152), np.int32), 1)
    for k in (5, 50):
        ref = _pass(p, t, k).reference(windows, {"n_vocab": 50})
        own = _pass(p, t, k, ref).result()
        assert own.kld_mean == own.kld_p99 == 0 and own.top_agreement == 1
        other = _pass(q, t, k, ref).result()
        full = _full_kld(p, q)
        if k == 50:  # every token kept: the divergence itself
            assert other.kld_mean == pytest.approx(full.mean(), rel=1e-4)
            assert other.kld_median == pytest.approx(np.median(full), rel=1e-3)
        else:  # coarsened to k + 1 outcomes: a lower bound
            assert 0 < other.kld_mean < full.mean()
        assert other.top_agreement == pytest.approx((p.argmax(1) == q.argmax(1)).mean())
    lp = log_softmax(p).astype(np.float64)
    assert own.ppl == pytest.approx(np.exp(-lp[np.arange(150), t].mean()), rel=1e-5)


def test_windows_score_the_second_half():
    w = make_windows(list(range(100, 130)), [1], 8)
    assert w.tokens.shape == (4, 8) and (w.tokens[:, 0] == 1).all() and w.first == 4 and w.n_scored == 12
    assert list(w.tokens[1, 1:]) == list(range(107, 114))
    assert make_windows(list(range(30)), [], 8, max_windows=2).tokens.shape == (2, 8)
    with pytest.raises(UsageError, match="fewer than one window of 7"):
        make_windows(list(range(6)), [1], 8)


def test_the_reference_file_round_trips_and_refuses_others(data, tmp_path):
    p, _, t = data
    windows = Windows(np.arange(304, dtype=np.int32).reshape(2, 152), 76)  # 2 x 75 scored rows = 150
    ref = _pass(p, t, 7).reference(windows, {"n_vocab": 50, "model": {"name": "m"}})
    save_reference(tmp_path / "r.npz", ref)
    back = load_reference(tmp_path / "r.npz")
    assert back.meta["top_k"] == 7 and back.first == 76
    assert all(np.array_equal(getattr(back, a), getattr(ref, a)) for a in ("tokens", "top_ids", "top_logp", "tail"))
    np.savez(tmp_path / "x.npz", a=np.zeros(3))
    with pytest.raises(UsageError, match="not a ggmoe compare-quants reference"):
        load_reference(tmp_path / "x.npz")


def test_pareto():
    assert _pareto([(1.0, 3.0), (2.0, 1.0), (3.0, 2.0), None, (1.0, 3.0)]) == [True, True, False, False, True]
