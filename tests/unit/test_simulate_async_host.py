"""The simulator's async host part: with decode mode async and miss policy cpu or auto, the experts the cache
names (``ExpertCache.cpu_of``, ``async_cpu_masks``) are computed on the CPU beside the device part, never filled
nor read over the link, and a layer with a host part pays its graph split every token."""

from __future__ import annotations

import dataclasses

import pytest

from ggmoe.cache.miss import async_cpu_masks
from ggmoe.simulate.des import SimConfig, simulate
from tests.unit.test_simulate_hybrid import BPE, GPU, MS, PROFILE
from tests.unit.test_simulator import trace

pytestmark = pytest.mark.unit


def _token(ids: list[int]) -> object:
    """One decode token of one layer, top-4 of 16 experts, every expert a miss (nothing cached yet)."""
    return trace([[ids]], n_prefill=0, n_expert=16)


def _read_s(n: int) -> float:
    """``n`` experts read by the GPU over the link at the zero-copy rate, nothing else in flight."""
    return PROFILE.zero_copy_s(n * BPE)


def _odd(policy, costs, bpe, n_slots, n_expert, k, counts=None, keeps=True):
    """A host part of the odd experts of every layer (``auto`` flags all or none; the replay takes any mask)."""
    return {il: [e % 2 == 1 for e in range(n_expert)] for il in n_slots}


@pytest.mark.parametrize("ids, miss, fills, cpu_ms, hook_ms, odd, n_cpu, tpot_ms", [
    ([4, 5, 6, 7], "cpu", False, 4, 0, False, 4, 1 + 16),  # every miss on the CPU, none over the link
    ([4, 5, 6, 7], "cpu", True, 4, 0, False, 4, 1 + 16),  # none filled: a host-part expert's entry is 0
    ([4, 5, 6, 7], "cpu", False, 4, 1, False, 4, 1 + 1 + 16),  # the graph split before the CPU's experts
    # auto: a CPU sooner than the graph's read over the link (1 ms) takes the layer, a slower one none
    ([4, 5, 6, 7], "auto", False, 0.5, 0, False, 4, 1 + 2),
    ([4, 5, 6, 7], "auto", True, 4, 0, False, 0, 1 + _read_s(4) / MS + 4 * GPU / MS),  # filled, then computed
    ([4, 5, 6, 7], "cpu", True, 4, 0, True, 2, 1 + max(_read_s(2) / MS + 2 * GPU / MS, 8)),  # both at once
    # no flagged expert missed: the layer still pays its split (5 ms), longer than its 4 reads
    ([4, 6, 8, 10], "cpu", False, 4, 5, True, 0, 1 + max(_read_s(4) / MS, 5)),
    ([4, 5, 6, 7], "wait", False, 4, 5, False, 0, 1 + _read_s(4) / MS),  # no host part, no split
])
def test_the_async_host_part_computes_its_experts_beside_the_device_part(monkeypatch, ids, miss, fills, cpu_ms,
                                                                         hook_ms, odd, n_cpu, tpot_ms):
    import ggmoe.simulate.des as des

    if odd:
        monkeypatch.setattr(des, "async_cpu_masks", _odd)
    prof = dataclasses.replace(PROFILE, hook_s=hook_ms * MS, cpu_bytes_per_s=BPE / (cpu_ms * MS))
    r = simulate(_token(ids), SimConfig({0: 8}, miss_policy=miss, decode_mode="async", fills=fills), {0: BPE}, prof)
    total = r.stats["total"]
    assert (r.host_computed, total["host_reads"] + total["fills"]) == (n_cpu, 4 - n_cpu)
    assert r.tpot_s == pytest.approx(tpot_ms * MS)


def test_the_simulator_names_the_engines_experts():
    """The masks the replay sets are the pipeline's (one function): ``auto`` all or none of a layer's experts,
    ``cpu`` all."""
    costs = PROFILE.miss_costs(3)  # the graph reads an expert in 1 ms, the CPU computes it in 4
    assert async_cpu_masks("auto", costs, {0: BPE}, {0: 8}, 16, 4) == {}
    fast = dataclasses.replace(costs, cpu_bytes_per_s=BPE / (0.5 * MS))
    assert async_cpu_masks("auto", fast, {0: BPE}, {0: 8}, 16, 4) == {0: [True] * 16}
    assert async_cpu_masks("cpu", costs, {0: BPE}, {0: 8}, 16, 4) == {0: [True] * 16}
    assert async_cpu_masks("wait", costs, {0: BPE}, {0: 8}, 16, 4) == {}
    assert async_cpu_masks("cpu", costs, {0: BPE}, {0: 16}, 16, 4) == {}  # a slot for every expert


def test_the_host_parts_misses_are_admitted_after_the_token():
    """A CPU miss is counted as computed there and then admitted as the engine's controller does: the next
    token of the same experts hits (no profile: the copies land at once)."""
    r = simulate(trace([[[4, 5, 6, 7]], [[4, 5, 6, 7]]], n_prefill=0, n_expert=16),
                 SimConfig({0: 8}, miss_policy="cpu", decode_mode="async"), {0: BPE})
    assert r.host_computed == 4 and r.stats["total"]["hits"] == 4
