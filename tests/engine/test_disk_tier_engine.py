"""The disk tier on the CPU build: experts left in the GGUF, a host tier read from it, the GPU tier above.

Every fixture family, both decode modes and both CPU copy streams (the conftest's ``copy_stream``), with the
experts 4x the host budget: stock's logits, disk reads counted, and no expert read from disk while it sits in
the host tier. A file cut short or rewritten under a running engine stops the next decode with one clear
error, before any graph reads it.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.base.errors import DiskTierError, UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.tiers import TierConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model

pytestmark = pytest.mark.engine


def _engine(path, mode: str, host_slots: int, gpu_slots: int | None = None) -> Engine:
    facts = inspect_model(path)
    gpu = gpu_slots or facts.n_expert_used
    cache = RunConfig(CacheConfig(n_slots=gpu),
                      decode=DecodeConfig(mode=mode),
                      tiers=TierConfig(host_ram=host_slots * facts.expert_bytes_per_slot))
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=cache))


def _watch_reads(eng: Engine) -> list[tuple[int, int]]:
    """Record every disk read; one of an expert the host tier holds (readable, or read in flight) is a
    violation, recorded as (-1, -1)."""
    tier = eng._runtime.tier
    submit, log = tier.reader.submit, []

    def checked(il: int, expert: int, slot: int):
        held = tier.readable(il, expert) >= 0 or expert in tier.layers[il].pending
        log.append((-1, -1) if held else (il, expert))
        return submit(il, expert, slot)

    tier.reader.submit = checked
    return log


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_experts_four_times_the_host_ram_give_stock_logits(arch_model, stock_logits, mode):
    arch, path = arch_model
    facts = inspect_model(path)
    host = max(facts.n_expert // 4, facts.n_expert_used)
    with _engine(path, mode, host) as eng:
        assert eng._runtime.tier is not None, arch
        assert eng.decode_mode["decode_mode_in_effect"] == mode
        reads = _watch_reads(eng)
        got = run_sequences(eng)
        report = eng.report()["host_tier"]
    for a, b in zip(got, stock_logits(path), strict=True):
        assert np.abs(a - b).max() <= EXACT, (arch, mode)
    assert (-1, -1) not in reads, (arch, mode)
    assert report["host_slots_per_layer"] == host
    if mode == "async":  # the CPU build's graph fills its misses from the file's mapping: counted in place
        assert report["in_place"] > 0, (arch, report)
    if mode == "sync":  # every miss of the GPU tier goes through the host tier
        assert report["reads"] > 0 and report["bytes_read"] == report["reads"] * facts.bytes_per_expert(
            facts.moe_layers[0]), (arch, report)


def test_a_host_tier_above_the_gpu_tier_hits(qwen3moe_model):
    """With more host slots than GPU slots, an expert evicted from the GPU tier comes back from RAM."""
    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, "sync", facts.n_expert // 2, facts.n_expert_used) as eng:
        run_sequences(eng)
        t = eng.report()["host_tier"]
    assert t["hits"] > 0 and t["reads"] > 0, t
    assert t["reads"] <= facts.n_expert * len(facts.moe_layers) + t["hits"], t


def test_a_reconfigured_cache_leaves_no_observer_of_the_old_host_tier(qwen3moe_model):
    """Reconfiguring under a disk tier: the new cache's host tier sees the routing, the old one's view is gone."""
    facts = inspect_model(qwen3moe_model)
    host = max(facts.n_expert // 4, facts.n_expert_used)
    with _engine(qwen3moe_model, "sync", host) as eng:
        old = eng.pipeline.tier_uses
        assert old is not None and any(o is old for o in eng.observers.items)
        eng.reconfigure(eng.config.run)
        new = eng.pipeline.tier_uses
        assert new is not None and new is not old and new.tier is eng._runtime.tier
        assert [o for o in eng.observers.items if isinstance(o, type(old))] == [new]
        run_sequences(eng)
        assert eng.report()["host_tier"]["reads"] > 0


def _copy(src, tmp_path):
    dst = tmp_path / "model.gguf"
    shutil.copyfile(src, dst)
    return dst


@pytest.mark.parametrize("fault", ["truncate", "rewrite", "remove"])
def test_a_file_changed_under_the_engine_stops_the_next_decode(qwen3moe_model, tmp_path, fault):
    path = _copy(qwen3moe_model, tmp_path)
    facts = inspect_model(path)
    with _engine(path, "sync", facts.n_expert_used) as eng:
        ids = eng.tokenize("The quick brown fox")
        eng.decode(ids)
        if fault == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        elif fault == "rewrite":
            data = path.read_bytes()
            path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
            os.utime(path, ns=(1, 1))
        else:
            path.unlink()
        with pytest.raises(DiskTierError, match="model file"):
            eng.decode([ids[-1]])


def test_a_host_ram_below_one_token_is_refused_before_loading(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    with pytest.raises(UsageError, match="host slots per layer"):
        _engine(qwen3moe_model, "sync", facts.n_expert_used - 1)


def test_the_host_path_is_refused_under_a_disk_tier(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    cache = RunConfig(CacheConfig(n_slots=facts.n_expert_used),
                      decode=DecodeConfig(miss_policy="cpu", mode="sync"),
                      tiers=TierConfig(host_ram=facts.n_expert_used * facts.expert_bytes_per_slot))
    with pytest.raises(UsageError, match="--miss-policy cpu"):
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, run=cache))


def test_run_on_a_model_larger_than_the_host_ram_needs_no_cache_size(qwen3moe_model, tmp_path):
    """`ggmoe run MODEL --host-ram SIZE` below the experts' size: the disk tier, the sync decode under it (auto),
    the counters in --stats-json. On a CPU-only build the budget goes to the GPU tier's slots (host memory here)
    but 2 x n_expert_used host slots, which stage the reads."""
    from click.testing import CliRunner

    from ggmoe.cli.main import main

    facts = inspect_model(qwen3moe_model)
    stats = tmp_path / "stats.json"
    k = facts.n_expert_used
    host = (facts.n_expert - 2) * facts.expert_bytes_per_slot
    res = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox", "-n", "8",
                                    "--temp", "0", "--host-ram", str(host), "--stats-json", str(stats)])
    assert res.exit_code == 0, res.output
    assert "host tier:" in res.output and "decode mode: sync (a disk tier" in res.output
    import json

    report = json.loads(stats.read_text())
    staging = min(2 * k, facts.n_expert - 1)  # the host tier stages a token's reads and the predicted ones
    assert report["slots_per_layer"][str(facts.moe_layers[0])] == facts.n_expert - 2 - staging
    assert report["host_tier"]["host_slots_per_layer"] == staging
    assert report["host_tier"]["reads"] > 0


def test_a_cpu_budget_below_two_tokens_of_slots_is_refused(qwen3moe_model):
    from click.testing import CliRunner

    from ggmoe.cli.main import main

    facts = inspect_model(qwen3moe_model)
    host = (2 * facts.n_expert_used - 1) * facts.expert_bytes_per_slot
    res = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "hi", "-n", "2", "--host-ram", str(host)])
    assert res.exit_code != 0 and "to stage reads" in res.output and "Traceback" not in res.output


def test_a_host_ram_that_holds_every_expert_says_it_does_nothing(qwen3moe_model):
    from click.testing import CliRunner

    from ggmoe.cli.main import main

    res = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "hi", "-n", "2", "--host-ram", "1GiB"])
    assert res.exit_code != 0 and "holds every expert of this model" in res.output, res.output


def test_load_on_a_model_larger_than_the_host_ram(qwen3moe_model):
    """``ggmoe.load(host_ram=...)``: the ``llama_cpp.Llama`` path gives stock's greedy text over the disk tier."""
    import ggmoe

    facts = inspect_model(qwen3moe_model)
    kw = {"n_ctx": 256, "seed": 1}
    with ggmoe.load(qwen3moe_model, **kw) as llm:
        want = llm.create_completion("The quick brown fox", max_tokens=12, temperature=0)["choices"][0]["text"]
    with ggmoe.load(qwen3moe_model, host_ram=(facts.n_expert - 2) * facts.expert_bytes_per_slot, **kw) as llm:
        got = llm.create_completion("The quick brown fox", max_tokens=12, temperature=0)["choices"][0]["text"]
        tier = llm.stats()["cache"]["host_tier"]
    assert got == want
    assert tier["reads"] > 0
