"""Three tiers' sizes: host slots from a host budget, the disk tier when they fall short, auto's margin."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache import tiers
from ggmoe.cache.tiers import HOST_MARGIN_BYTES, auto_host_ram, host_ram_for, tier_sizes
from ggmoe.inspect.facts import ExpertTensor, ModelFacts, MoeLayer
from ggmoe.inspect.gating import Gating

SOFTMAX = Gating(func="softmax", norm_w=False, w_scale=0.0, n_expert_groups=0, n_group_used=0)


def fake_facts(n_layers: int = 4, n_expert: int = 16, k: int = 2, kind_bytes: int = 1000) -> ModelFacts:
    """A model's header facts with gate, up and down of ``kind_bytes`` per expert in every MoE layer."""
    def layer(il: int) -> MoeLayer:
        return MoeLayer(il, tuple(
            ExpertTensor(f"blk.{il}.{kind}", kind, "Q8_0", (8, 8, n_expert), kind_bytes * n_expert, kind_bytes,
                         "x.gguf", 0)
            for kind in ("ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight")))

    layers = tuple(layer(il) for il in range(n_layers))
    experts = sum(t.nbytes for m in layers for t in m.tensors)
    return ModelFacts(path="x.gguf", arch="qwen3moe", name="x", file_bytes=experts + 100, n_layer=n_layers,
                      n_expert=n_expert, n_expert_used=k, n_expert_shared=0, n_embd=8, n_ff_exp=8,
                      moe_layers=tuple(range(n_layers)), dense_layers=(), layers=layers, expert_bytes=experts,
                      dense_bytes=100, n_tensors=3 * n_layers, ggml_types=(("Q8_0", 3 * n_layers),),
                      gating=SOFTMAX)


# one slot in every layer: 4 layers x 3 kinds x 1000 B = 12,000 B
@pytest.mark.parametrize("host_ram,host_slots,disk,disk_experts", [
    (16 * 12_000, 16, False, 0),  # exactly every expert: no disk tier
    (100 * 12_000, 16, False, 0),  # more than every expert: capped at n_expert
    (8 * 12_000 + 11_999, 8, True, 8),  # a partial slot buys nothing
    (2 * 12_000, 2, True, 14),  # n_expert_used: the least a disk tier runs with
])
def test_host_slots_from_the_budget(host_ram, host_slots, disk, disk_experts):
    t = tier_sizes(fake_facts(), 4, host_ram)
    assert (t.host_slots, t.disk, t.disk_experts) == (host_slots, disk, disk_experts)
    assert (t.gpu_slots, t.n_expert, t.layers, t.expert_bytes, t.slot_bytes) == (4, 16, 4, 3000, 12_000)
    assert (t.gpu_bytes, t.host_bytes, t.disk_bytes) == (4 * 12_000, host_slots * 12_000, disk_experts * 12_000)
    assert t.host_bytes + t.disk_bytes == t.model_bytes
    assert t.to_dict()["disk"] is disk and len(t.render_lines()) == 3


@pytest.mark.parametrize("gpu_slots,host_ram,match", [
    (17, 10**9, "0..16"),
    (-1, 10**9, "0..16"),
    (4, 12_000, "n_expert_used"),  # one host slot per layer, top-2
    (4, -1, ">= 0"),
])
def test_refused(gpu_slots, host_ram, match):
    with pytest.raises(UsageError, match=match):
        tier_sizes(fake_facts(), gpu_slots, host_ram)


GIB = 1 << 30


@pytest.mark.parametrize("total_gib,available_gib,want", [
    (64, 60, 60 * GIB - int(0.1 * 64 * GIB)),  # a tenth of 64 GiB is more than the 4 GiB floor
    (16, 14, 14 * GIB - HOST_MARGIN_BYTES),  # the 4 GiB floor
    (8, 3, 0),  # less available than the margin: nothing to pin
])
def test_auto_host_ram_leaves_a_margin(total_gib, available_gib, want):
    meminfo = f"MemTotal: {total_gib * 1024 * 1024} kB\nMemFree: 1 kB\nMemAvailable: {available_gib * 1024 * 1024} kB\n"
    assert auto_host_ram(meminfo) == want


def test_none_is_auto(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * 1024 * 1024} kB\nMemAvailable: {32 * 1024 * 1024} kB\n")
    monkeypatch.setattr(tiers, "MEMINFO", meminfo)
    assert tier_sizes(fake_facts(), 2, None).host_ram == 32 * GIB - int(0.1 * 64 * GIB)


@pytest.mark.parametrize("ram_gib,want", [(64, 64 * GIB - int(0.1 * 64 * GIB)), (24, 20 * GIB), (2, 0)])
def test_host_ram_for_a_machine(ram_gib, want):
    assert host_ram_for(ram_gib * GIB) == want
