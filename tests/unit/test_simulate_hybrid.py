"""The simulator's hybrid decode: a layer's misses split between the link and the CPU, both running at once."""

from __future__ import annotations

import dataclasses

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.hardware import load_profile
from ggmoe.cli.simulate import _mode_runs
from ggmoe.simulate.des import SimConfig, simulate
from tests.unit.test_simulator import trace

pytestmark = pytest.mark.unit

BPE = 1_000_000  # bytes per expert
MS = 1e-3
# round numbers: an expert's copy is 3 chunks of 1 ms + 1/3 ms (4 ms), the GPU computes one in 1 us
PROFILE = dataclasses.replace(load_profile("pcie4"), copy_bytes_per_s=1e9, copy_latency_s=1 * MS,
                              gpu_bytes_per_s=1e12, gpu_launch_s=0.0, gpu_layer_s=1 * MS,
                              cpu_bytes_per_s=BPE / (4 * MS), cpu_latency_s=0.0, hook_s=0.0)
GPU = BPE / 1e12  # s per expert on the GPU


def _one_token() -> object:
    """One decode token of one layer, top-4, every expert a miss."""
    return trace([[[4, 5, 6, 7]]], n_prefill=0, n_expert=16)


@pytest.mark.parametrize("cpu_ms, hook_ms, n_cpu, tpot_ms", [
    # equal servers: two misses each; the link's two copies (8 ms) end as the CPU's two experts do
    (4, 0, 2, 1 + 8 + 2 * GPU / MS),
    # a CPU twice as fast: three there (6 ms) beside one copy (4 ms), then the GPU waits for the CPU
    (2, 0, 3, 1 + 4 + 2),
    # a graph split of 1 ms on the CPU's side (and the route op's): two each still, the CPU ends 1 ms later
    (4, 1, 2, 1 + 1 + 8 + 1),
    # a CPU 25 times slower: every miss waits for its copy (auto runs as wait)
    (100, 0, 0, 1 + 16 + 4 * GPU / MS),
])
def test_hybrid_splits_a_layers_misses_between_the_link_and_the_cpu(cpu_ms, hook_ms, n_cpu, tpot_ms):
    prof = dataclasses.replace(PROFILE, cpu_bytes_per_s=BPE / (cpu_ms * MS), hook_s=hook_ms * MS)
    r = simulate(_one_token(), SimConfig({0: 8}, miss_policy="auto", hybrid=True), {0: BPE}, prof)
    assert r.decode_mode == "hybrid"
    assert r.host_computed == n_cpu
    assert r.tpot_s == pytest.approx(tpot_ms * MS)


@pytest.mark.parametrize("miss, hybrid, n_cpu, tpot_ms", [
    ("auto", False, 0, 1 + 16 + 4 * GPU / MS),  # in turn: the CPU is not sooner for any one miss
    ("cpu", False, 4, 1 + 16),  # every miss on the CPU, one after another
    ("auto", True, 2, 1 + 8 + 2 * GPU / MS),  # beside each other: half the time
])
def test_hybrid_against_the_sync_decode(miss, hybrid, n_cpu, tpot_ms):
    r = simulate(_one_token(), SimConfig({0: 8}, miss_policy=miss, hybrid=hybrid), {0: BPE}, PROFILE)
    assert (r.host_computed, r.tpot_s) == (n_cpu, pytest.approx(tpot_ms * MS))


@pytest.mark.parametrize("config", [
    SimConfig({0: 8}, miss_policy="wait", hybrid=True),
    SimConfig({0: 8}, miss_policy="cpu", hybrid=True),
    SimConfig({0: 8}, miss_policy="auto", hybrid=True, decode_mode="async"),
])
def test_hybrid_is_the_sync_decode_with_auto(config):
    with pytest.raises(UsageError, match="hybrid"):
        simulate(_one_token(), config, {0: BPE}, PROFILE)


@pytest.mark.parametrize("mode, miss, runs", [
    ("sync", "wait", True), ("sync", "auto", True), ("sync", "cpu", True),
    ("async", "wait", True), ("async", "auto", True), ("async-fill", "cpu", True),  # async: its host part
    ("hybrid", "auto", True), ("hybrid", "wait", False), ("hybrid", "cpu", False),
])
def test_which_rows_simulate_runs(mode, miss, runs):
    assert _mode_runs(mode, miss) == runs
