"""One rule for the bytes the cache holds (``ggmoe.inspect.names.is_cached_expert_tensor``: the expert weights,
not their biases or scales), used by every command: --vram of exactly N slots' bytes gives N slots in run,
simulate and plan; the engine's slots and copies count those bytes; inspect prints them."""

from __future__ import annotations

import json

from click.testing import CliRunner
from test_cache_engine import run_sequences

from ggmoe.cache import CacheConfig, slots_for_budget
from ggmoe.cli import main
from ggmoe.cli.simulate import sizes
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model


def test_vram_of_n_slots_gives_n_slots(arch_model, tmp_path):
    arch, path = arch_model
    facts = inspect_model(path)
    k, n = facts.n_expert_used, facts.n_expert
    bpe = {il: facts.bytes_per_expert(il) for il in facts.moe_layers}
    for n_slots in sorted({k, k + 1, n}):
        vram = facts.cache_bytes(n_slots)
        assert set(slots_for_budget(vram, bpe, n, k).values()) == {n_slots}
        assert set(sizes(facts, (), (), (str(vram),))[0][1].values()) == {n_slots}  # simulate --vram
        if n_slots > k:  # one byte less buys one slot less
            assert set(slots_for_budget(vram - 1, bpe, n, k).values()) == {n_slots - 1}
    vram = facts.cache_bytes(k + 1)
    stats = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["run", str(path), "-p", "abc", "-n", "2", "--vram", str(vram),
                                  "--stats-json", str(stats)])
    assert r.exit_code == 0, r.output
    assert set(json.loads(stats.read_text())["slots_per_layer"].values()) == {k + 1}, arch
    r = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    d = json.loads(r.output)
    assert d["expert_bytes_per_slot"] * (k + 1) == vram
    assert d["vram_bytes"]["n_expert"] == facts.dense_bytes + facts.expert_device_bytes + facts.cache_bytes(n)


def test_engine_slots_and_copies_count_the_weights(arch_model):
    """The slot tensors hold exactly the bytes ModelFacts counts per expert, and every copy moves that many."""
    arch, path = arch_model
    facts = inspect_model(path)
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                       run=RunConfig(CacheConfig(vram_bytes=facts.cache_bytes(facts.n_expert_used),
                                                 policy="lru")))
    with Engine(cfg) as eng:
        run_sequences(eng)
        held = eng.pipeline.runtime.slots.bytes_per_expert()
        stats = eng.cache_stats
    assert held == {il: facts.bytes_per_expert(il) for il in facts.moe_layers}, arch
    for il, s in stats.layers.items():
        copies = s.demand_copies + s.admission_copies + s.prefetch_issued + s.fills + s.preloaded
        assert copies > 0 and s.bytes_copied == copies * facts.bytes_per_expert(il), (arch, il)
