"""Gating from the architecture and hparams, and the numpy router's selection and weights per gating."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.inspect.gating import Gating, gating_from_kv, true_probs
from ggmoe.inspect.router import Router


def _kv(arch: str, **keys) -> dict:
    return {f"{arch}.{k}": v for k, v in keys.items()}


@pytest.mark.parametrize("arch, keys, want", [
    # hard-coded in the graph: the keys are not read
    ("gpt-oss", {"expert_gating_func": 2, "expert_weights_norm": True, "expert_weights_scale": 3.0},
     ("softmax_weight", False, 0.0)),
    ("qwen3moe", {"expert_weights_scale": 2.0}, ("softmax", True, 0.0)),
    ("qwen2moe", {}, ("softmax", False, 0.0)),
    ("llama", {}, ("softmax", True, 0.0)),
    ("llama4", {"expert_gating_func": 1}, ("sigmoid", False, 0.0)),
    # read from the keys, with the architecture's default
    ("deepseek2", {}, ("softmax", False, 0.0)),
    ("deepseek2", {"expert_gating_func": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5},
     ("sigmoid", True, 2.5)),
    ("glm4moe", {"expert_weights_norm": True, "expert_weights_scale": 1.0}, ("sigmoid", True, 1.0)),
    ("glm4moe", {"expert_gating_func": 1}, ("softmax", False, 0.0)),
    ("some-new-moe", {"expert_gating_func": 4}, ("sqrt_softplus", False, 0.0)),
])
def test_gating_from_arch_and_keys(arch, keys, want):
    g = gating_from_kv(arch, _kv(arch, **keys))
    assert (g.func, g.norm_w, g.w_scale) == want
    assert g.select_on_logits == (arch == "llama4")
    assert g.weight_before_ffn == (arch == "llama4")  # the mailbox hands the host its ids only
    assert g.hook_gives_logits == (want[0] == "softmax_weight")


def test_groups_read_only_when_grouped():
    assert gating_from_kv("deepseek2", _kv("deepseek2", expert_group_count=4, expert_group_used_count=2)
                          ).n_expert_groups == 4
    g = gating_from_kv("deepseek2", _kv("deepseek2", expert_group_count=1, expert_group_used_count=3))
    assert (g.n_expert_groups, g.n_group_used) == (1, 0)


def _router(func: str, logits_row: list[float], selection_bias=None, **kw) -> tuple[Router, np.ndarray]:
    """A router whose logits for the one-hot input are ``logits_row`` (weight = the row as a column)."""
    e = len(logits_row)
    gating = Gating(func=func, norm_w=kw.pop("norm_w", False), w_scale=kw.pop("w_scale", 0.0),
                    n_expert_groups=kw.pop("groups", 0), n_group_used=kw.pop("used", 0), **kw)
    weight = np.asarray(logits_row, np.float32).reshape(e, 1)
    sb = None if selection_bias is None else np.asarray(selection_bias, np.float32)
    return Router(il=0, weight=weight, bias=None, selection_bias=sb, gating=gating), np.ones((1, 1), np.float32)


# hand-worked: logits [2, 1, 0, -1]
L4 = [2.0, 1.0, 0.0, -1.0]


@pytest.mark.parametrize("func, kw, sb, ids, weights", [
    # softmax: probs of the selected (2 of 4), normalised when asked, then scaled
    ("softmax", {}, None, [0, 1], np.exp([2, 1]) / np.exp(L4).sum()),
    ("softmax", {"norm_w": True, "w_scale": 2.0}, None, [0, 1], 2 * np.exp([2, 1]) / np.exp([2, 1]).sum()),
    # gpt-oss: softmax over the selected logits only
    ("softmax_weight", {}, None, [0, 1], np.exp([2, 1]) / np.exp([2, 1]).sum()),
    # sigmoid with a selection bias: experts 2 and 3 chosen by the bias, weighted by their unbiased sigmoid
    ("sigmoid", {}, [0, 0, 5, 5], [2, 3], 1 / (1 + np.exp([0.0, 1.0]))),
    # llama4: chosen on the logits (the bias is ignored), weighted by the sigmoid
    ("sigmoid", {"select_on_logits": True}, [0, 0, 5, 5], [0, 1], 1 / (1 + np.exp([-2.0, -1.0]))),
])
def test_selection_and_weights(func, kw, sb, ids, weights):
    router, x = _router(func, L4, sb, **kw)
    got = router.topk(x, 2)
    assert got[0].tolist() == ids
    assert np.allclose(router.weights(x, got)[0], weights, rtol=1e-5)


def test_group_limited_selection():
    """4 groups of 2; groups scored by their best two: [9+0, 5+5, 8+8, 1+1] -> groups 2 and 1 with 2 used, so
    expert 0 (score 9) is not selectable though it scores highest."""
    router, x = _router("softmax_weight", [9, 0, 5, 5, 8, 8, 1, 1], groups=4, used=2)
    score = router.selection_scores(x)[0]
    assert np.isneginf(score[[0, 1, 6, 7]]).all() and np.isfinite(score[2:6]).all()
    assert sorted(router.topk(x, 3)[0].tolist()) in ([2, 4, 5], [3, 4, 5])


@pytest.mark.parametrize("func", ["softmax", "sigmoid", "sqrt_softplus", "softmax_weight"])
def test_true_probs_are_probabilities(func):
    """What the hook reports is never negative; gpt-oss's logits come back under their own name."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 8)) * 4).astype(np.float32)
    router, _ = _router(func, [0.0] * 8)
    graph = logits if func == "softmax_weight" else None
    probs, raw = true_probs(router.gating, graph if graph is not None else np.abs(logits))
    assert (probs >= 0).all()
    if func == "softmax_weight":
        assert np.array_equal(raw, logits) and np.allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    else:
        assert raw is None
