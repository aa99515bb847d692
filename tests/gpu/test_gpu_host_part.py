"""GPU tier: the host path's CPU part on a worker beside the GPU's part (patch 0015).

The start op hands the CPU's experts to the worker, the layer waits for its copies in the wait hook, the
GPU's kernels run, and the join adds the two parts. Greedy tokens equal every expert in host memory with the
host part in the main graph (0 threads), on the worker at the default, and in both forced interleavings;
``auto`` with a CPU as fast as a copy splits a layer's misses between the link and the CPU (the hybrid row).
"""

from __future__ import annotations

import pytest

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.host_part import HOST_ORDER_ENV
from ggmoe.inspect import inspect_model
from tools.fixtures.make_fixtures import fixture_path

PROMPT = "The expert cache keeps the experts a model uses most on the device"


def _tokens(path, cache=None):
    with Engine(EngineConfig(model_path=path, n_ctx=256, run=cache)) as eng:
        got = eng.generate(PROMPT, 24).token_ids
        report = eng.pipeline.report() if cache is not None else {}
    return got, report


def _against_stock(decode: DecodeConfig, slots: str = "k+1", why: object = None) -> dict:
    """The qwen3moe fixture (q8_0 experts) run with ``decode`` on a cache of n_expert_used + 1 slots (``k+1``) or
    half the experts (``half``): its greedy tokens equal stock's; returns the pipeline's report."""
    path = fixture_path("qwen3moe", expert_type="q8_0")
    facts = inspect_model(path)
    n_slots = facts.n_expert_used + 1 if slots == "k+1" else facts.n_expert // 2
    want, _ = _tokens(path)
    got, report = _tokens(path, RunConfig(CacheConfig(n_slots=n_slots), decode=decode))
    assert got == want, why
    return report


@pytest.mark.parametrize("threads", [0, None], ids=["main-graph", "worker"])
@pytest.mark.parametrize("order", ["free", "device-first", "host-first"])
def test_gpu_host_part_tokens_equal_host_experts(threads, order, monkeypatch):
    if threads == 0 and order != "free":
        pytest.skip("the order is the worker's")
    monkeypatch.setenv(HOST_ORDER_ENV, order)
    report = _against_stock(DecodeConfig(miss_policy="cpu", mode="sync", host_threads=threads), why=(threads, order))
    part = report["host_part"]
    assert report["total"]["host_computed"] > 0
    assert (part["jobs"] > 0) == (threads is None)
    counter = {"device-first": "after_device", "host-first": "before_device"}.get(order)
    if counter is not None:
        assert part[counter] == part["jobs"]


def test_gpu_hybrid_splits_misses_between_link_and_cpu(even_profile):
    report = _against_stock(DecodeConfig(miss_policy="auto", mode="sync", hw_profile=even_profile), "half")
    total = report["total"]
    assert report["host_part"]["beside_link"]
    assert total["host_computed"] > 0 and total["demand_copies"] > 0 and total["deferred_waits"] > 0


@pytest.mark.parametrize("threads", [0, None], ids=["main-graph", "worker"])
def test_gpu_async_host_part_tokens_equal_host_experts(threads):
    """The async decode's host part (patch 0016): every expert no slot holds is computed on the CPU beside the
    GPU's table matmuls, whose 0 entries MMVQ skips; nothing is filled or read in place."""
    report = _against_stock(DecodeConfig(miss_policy="cpu", mode="async", host_threads=threads), why=threads)
    total = report["total"]
    assert report["decode_mode_in_effect"] == "async"
    assert total["host_computed"] > 0 and total["fills"] == 0


def test_gpu_async_fills_beside_the_host_part(monkeypatch):
    """Half of each layer's experts flagged for the CPU: the fill kernel takes only the others' misses (never a 0
    entry), MMVQ skips the flagged ones, and the host part computes them; the tokens are stock's."""
    import ggmoe.engine.pipeline as pipeline

    def half(policy, costs, bpe, n_slots, n_expert, k, counts=None, keeps=True):  # the odd experts of every layer
        return {il: [e % 2 == 1 for e in range(n_expert)] for il in n_slots}

    monkeypatch.setattr(pipeline, "async_cpu_masks", half)
    report = _against_stock(DecodeConfig(miss_policy="cpu", mode="async"))
    total = report["total"]
    assert total["host_computed"] > 0 and total["fills"] > 0
