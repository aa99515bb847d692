"""--stats-out / --stats-in on the real engine: counts that continue, static pinning, a predictor kept warm."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from cli_run import ggmoe

from ggmoe.trace import load_trace
from ggmoe.trace.data import trace_counts
from ggmoe.trace.routing_stats import load_stats

PROMPT = "def fib(n):"



@pytest.fixture(scope="module")
def train_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    prompts = d / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["import os", "class A:", "def main():", "for i in range(10):"]) + "\n")
    ggmoe("trace", "--prompts", str(prompts), "-o", str(d / "t"), "--max-tokens", "12", "--stats-out",
          str(d / "trace-stats.npz"))
    return d / "t" / "trace.npz", d / "trace-stats.npz"


def test_trace_stats_count_exactly_the_traced_routing(train_trace):
    trace_path, stats_path = train_trace
    stats = load_stats(stats_path)
    counts = trace_counts(load_trace(trace_path, hidden=False))
    for j, il in enumerate(stats.layers):
        assert (stats.counts[j] == counts[il]).all(), il
    assert (stats.coact.diagonal(axis1=1, axis2=2) == stats.counts).all()


def test_counts_continue_across_runs(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    ggmoe("run", "-p", PROMPT, "-n", "12", "--stats-out", str(a))
    ggmoe("run", "-p", PROMPT, "-n", "12", "--stats-in", str(a), "--stats-out", str(b))
    sa, sb = load_stats(a), load_stats(b)
    assert sa.n_tokens.min() > 0
    assert (sb.n_tokens == 2 * sa.n_tokens).all()  # greedy: the second run routes exactly as the first
    assert (sb.counts == 2 * sa.counts).all() and (sb.coact == 2 * sa.coact).all()


def _run_stats(tmp_path, *args: str) -> dict:
    """``ggmoe run`` of PROMPT with 8 cache slots and ``args``; its --stats-json."""
    out = tmp_path / "cache.json"
    ggmoe("run", "-p", PROMPT, "--cache-slots", "8", *args, "--stats-json", str(out))
    return json.loads(out.read_text())


def test_static_pins_the_hottest_experts_of_the_saved_counts(tmp_path, train_trace):
    _, stats_path = train_trace
    d = _run_stats(tmp_path, "-n", "16", "--policy", "static", "--stats-in", str(stats_path))
    assert d["policy"] == "static"
    assert d["total"]["hits"] > 0


def test_a_data_driven_predictor_keeps_what_it_learnt(tmp_path, train_trace):
    trace_path, _ = train_trace
    a = tmp_path / "eam.npz"
    ggmoe("run", "-p", PROMPT, "-n", "12", "--cache-slots", "8", "--predictor", "eam", "--predictor-train",
          str(trace_path), "--stats-out", str(a))
    sa = load_stats(a)
    assert sa.predictor == "eam"
    n_train = load_trace(trace_path, hidden=False).n_prompts
    assert sa.predictor_state["ratio"].shape[0] == n_train + 1  # the trace's requests and this run's
    # restarted without training traces: the saved collection is enough, and it keeps growing
    b, stats_json = tmp_path / "eam2.npz", tmp_path / "s.json"
    ggmoe("run", "-p", "class B:", "-n", "12", "--cache-slots", "8", "--predictor", "eam", "--stats-in", str(a),
          "--stats-out", str(b), "--stats-json", str(stats_json))
    assert json.loads(stats_json.read_text())["total"]["prefetch_issued"] > 0
    sb = load_stats(b)
    assert sb.predictor_state["ratio"].shape[0] == n_train + 2
    assert np.array_equal(sb.predictor_state["ratio"][: n_train + 1], sa.predictor_state["ratio"])


def test_eam_without_training_or_state_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ggmoe", "run", "-p", "x", "--cache-slots", "8", "--predictor", "eam"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--stats-in" in r.stderr


def test_stats_of_another_model_are_refused(tmp_path, qwen3moe_model):
    a = tmp_path / "a.npz"
    ggmoe("run", "-p", PROMPT, "-n", "4", "--stats-out", str(a))
    r = subprocess.run([sys.executable, "-m", "ggmoe", "run", str(qwen3moe_model), "-p", "x", "--stats-in", str(a)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "another model" in r.stderr and "Traceback" not in r.stderr


def test_auto_weighs_the_decode_modes_with_the_saved_counts(tmp_path, train_trace):
    """--stats-in gives auto's weighing each layer's skew: the reason says the misses came from the counts."""
    _, stats_path = train_trace
    d = _run_stats(tmp_path, "-n", "8", "--predictor", "reuse", "--stats-in", str(stats_path))
    assert d["decode_mode_in_effect"] == "async", d["decode_mode_reason"]
    assert "routing statistics' counts" in d["decode_mode_reason"]
