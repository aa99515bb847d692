"""ggmoe plan's parts: the greedy split by hand, static hit curves, plan files read back and refused."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.config import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.hardware import load_profile
from ggmoe.control.plan_file import read_plan, render_plan, write_plan
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.simulate.plan import allocate, analytic_tpot, static_curves


def test_allocate_gives_each_slot_to_the_best_gain_per_byte():
    bpe = {0: 100, 1: 100}
    curves = {0: {2: 0.5, 3: 0.9, 4: 0.95}, 1: {2: 0.5, 3: 0.6, 4: 0.99}}
    # base 2+2 slots = 400 B; 150 B more buys one slot: layer 0 (+0.4) beats layer 1 (+0.1)
    assert allocate(550, bpe, curves, k=2, n_expert=4) == {0: 3, 1: 2}
    # 200 B more: layer 0 (+0.4), then layer 1 from 2 to 3 (+0.1) beats layer 0 from 3 to 4 (+0.05)
    assert allocate(600, bpe, curves, k=2, n_expert=4) == {0: 3, 1: 3}
    assert allocate(10_000, bpe, curves, k=2, n_expert=4) == {0: 4, 1: 4}  # capped at n_expert


def test_allocate_weighs_bytes():
    curves = {0: {1: 0.0, 2: 0.5}, 1: {1: 0.0, 2: 0.4}}
    # layer 1's experts are half the size: 0.4 per 50 B beats 0.5 per 100 B
    assert allocate(150 + 50, {0: 100, 1: 50}, curves, k=1, n_expert=2) == {0: 1, 1: 2}


def test_allocate_refuses_a_budget_below_top_k():
    with pytest.raises(UsageError, match="below top-k"):
        allocate(100, {0: 100, 1: 100}, {}, k=1, n_expert=4)


def test_static_curves_are_cumulative_top_frequencies():
    freq = np.array([[0.1, 0.6, 0.3, 0.0]])
    c = static_curves(freq, (5,), k=1)[5]
    assert c == pytest.approx({1: 0.6, 2: 0.9, 3: 1.0, 4: 1.0})


def test_analytic_tpot_by_hand():
    p = load_profile("pcie4")
    t = analytic_tpot({0: 2}, {0: {2: 0.75}}, {0: 1000}, 2, p)
    want = p.hook_s + p.gpu_layer_s + 2 * p.gpu_expert_s(1000) + 0.25 * 2 * p.copy_s(1000, 3)
    assert t == pytest.approx(want)


def test_plan_file_round_trip(tmp_path):
    cfg = RunConfig(CacheConfig(layer_slots={0: 8, 3: 12}, policy="lcp"),
                    decode=DecodeConfig(miss_policy="auto", hw_profile="egpu"),
                    prefetch=PrefetchConfig(predictor="reuse", stride=1, n_prefetch=6))
    path = write_plan(tmp_path / "p.toml", cfg, {"tpot_s": 0.01}, comment="a\nb")
    back = read_plan(path)
    assert back == cfg
    assert back.cache.slots({0: 1, 3: 1}, 16, 4) == {0: 8, 3: 12}


BAD = [
    ("version = 2\n[cache.slots]\n\"0\" = 4\n", "version 2"),
    ("x = 1\n", "needs a [cache] table"),
    ("[cache]\npolicy = \"lru\"\n", "[cache.slots]"),
    ("[cache.slots]\n\"a\" = 4\n", "layers are numbers"),
    ("[cache.slots]\n\"0\" = -4\n", "positive"),
    ("[cache]\npolicy = \"nope\"\n[cache.slots]\n\"0\" = 4\n", "nope"),
    ("[cache]\nmiss_policy = \"maybe\"\n[cache.slots]\n\"0\" = 4\n", "unknown miss policy"),
    ("[cache]\nhw = \"egpu\"\n[cache.slots]\n\"0\" = 4\n", "hw is a profile"),
    ("[cache.slots]\n\"0\" = 4\n[prefetch]\nstride = 1\n", "predictor"),
    ("[cache.slots]\n\"0\" = 4\n[prefetch]\npredictor = \"reuse\"\nstride = 0\n", "stride"),
    ("not toml at all =", "not a valid TOML"),
]


@pytest.mark.parametrize("text,match", BAD)
def test_bad_plan_files(tmp_path, text, match):
    p = tmp_path / "p.toml"
    p.write_text(text)
    with pytest.raises(UsageError, match=match.replace("[", r"\[").replace("]", r"\]")):
        read_plan(p)


def test_plan_slots_must_name_the_models_layers():
    with pytest.raises(UsageError, match="MoE layers"):
        CacheConfig(layer_slots={0: 4}).slots({0: 1, 1: 1}, 8, 2)


def test_render_has_the_estimate():
    text = render_plan(RunConfig(CacheConfig(layer_slots={0: 4})), {"tpot_s": 0.5})
    assert "[estimate]" in text and "tpot_s = 0.5" in text
