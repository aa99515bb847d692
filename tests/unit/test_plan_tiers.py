"""Three tiers where a user looks: ``plan --gpu --ram`` for a model larger than RAM, ``inspect --vram --host-ram``,
and the stock ways' page faults by hand."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.cache.hardware import load_profile
from ggmoe.cli import main
from ggmoe.inspect import inspect_model
from ggmoe.simulate.advise import advise
from ggmoe.simulate.disk import FAULT_READ_BYTES, fault_bytes_per_s, page_cache_reads
from tools.gpu.realshape import write_model

pytestmark = pytest.mark.unit
GIB = 1 << 30


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """A header-only GGUF (sparse) of Qwen3-30B-A3B's shape: 48 MoE layers of 128 experts, 15.2 GiB of experts."""
    return write_model("qwen3-30b-a3b", tmp_path_factory.mktemp("m") / "q.gguf", header_only=True)[0]


@pytest.mark.parametrize("ram_gib,disk", [(16, True), (64, False)])
def test_plan_gpu_ram_plans_three_tiers_for_a_model_larger_than_ram(qwen, ram_gib, disk):
    r = CliRunner().invoke(main, ["plan", str(qwen), "--gpu", "rtx4060ti16", "--vram", "8GiB", "--ram",
                                  f"{ram_gib}GiB", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    t = d["tiers"]
    assert t["disk"] is disk and t["gpu_slots"] == d["slots_per_layer"] and t["n_expert"] == 128
    ways = {w["name"]: w for w in d["ways"]}
    assert all(w["decode_tok_s"] > 0 for n, w in ways.items() if n != "all experts in VRAM")
    serve = ways["ggmoe, async decode"]["run"]
    assert ("--host-ram" in serve) is disk
    assert "--decode-mode async --miss-policy auto" in serve  # its host part where the CPU beats the link
    assert any("do not fit the host tier" in n for n in d["notes"]) is disk
    if disk:  # 16 GiB less the 4 GiB margin: 12 GiB of host tier, 101 of 128 experts per layer
        assert t["host_ram"] == 12 * GIB and t["host_slots"] == 101
        assert "page faults from disk" in ways["llama.cpp -ot exps=CPU"]["detail"]
    text = CliRunner().invoke(main, ["plan", str(qwen), "--gpu", "rtx4060ti16", "--vram", "8GiB", "--ram",
                                     f"{ram_gib}GiB"]).output
    assert "tiers:" in text and ("only in the file" in text) is disk


def test_a_slower_disk_plans_a_slower_decode(qwen):
    facts = inspect_model(qwen)
    tok_s = {}
    for disk in ("nvme5", "nvme4", "sata"):
        a = advise(facts, "rtx4060ti16", 8 * GIB, 16 * GIB, disk=disk)
        tok_s[disk] = {w.name: w.decode_tok_s for w in a.ways}
    for way in ("ggmoe, async decode", "ggmoe, sync decode + host path", "llama.cpp -ot exps=CPU"):
        assert tok_s["nvme5"][way] >= tok_s["nvme4"][way] >= tok_s["sata"][way]


@pytest.mark.parametrize("args,gpu,host,disk", [
    (["--vram", "3MiB", "--host-ram", "7MiB"], 7, 17, 15),  # tiny-moe: 417,792 B a slot in every layer
    (["--host-ram", "7MiB"], 0, 17, 15),  # no --vram: no GPU slots
    (["--vram", "3MiB", "--host-ram", "100MiB"], 7, 32, 0),  # every expert fits: no disk tier
])
def test_inspect_shows_the_three_tiers(args, gpu, host, disk):
    r = CliRunner().invoke(main, ["inspect", *args, "--json"])
    assert r.exit_code == 0, r.output
    t = json.loads(r.output)["tiers"]
    assert (t["gpu_slots"], t["host_slots"], t["disk_experts"]) == (gpu, host, disk)
    text = CliRunner().invoke(main, ["inspect", *args]).output
    assert "three tiers" in text and f"host  {host:>4}/32 slots/layer" in text


def test_page_cache_reads_by_hand():
    # one layer, top-2, a page cache of 2 experts: 0 1 | 0 2 (evicts 1) | 1 2 (evicts 0) | 1 2
    ids = np.array([[[0, 1]], [[0, 2]], [[1, 2]], [[1, 2]]])
    assert page_cache_reads(ids, 2, [0]).tolist() == [2, 1, 1, 0]
    assert page_cache_reads(ids, 3, [0]).tolist() == [2, 1, 0, 0]
    assert page_cache_reads(ids, 2, []).tolist() == [0, 0, 0, 0]  # no layer read through mmap


def test_a_fault_reads_one_readahead_window_at_a_time():
    p = dataclasses.replace(load_profile("pcie4"), disk_bytes_per_s=1e9, disk_latency_s=1e-4)
    assert fault_bytes_per_s(p) == pytest.approx(FAULT_READ_BYTES / (FAULT_READ_BYTES / 1e9 + 1e-4))


@pytest.mark.parametrize("args,match", [
    (["inspect", "--host-ram", "abc"], "bad size 'abc'"),
    (["inspect", "--vram", "1KB", "--host-ram", "7MiB"], "gives 0 slots per layer"),
    (["inspect", "--host-ram", "400KiB"], "gives 0 host slots per layer; a model on disk needs at least"),
    (["plan", "--gpu", "rtx4090", "--vram", "1542MiB", "--host-ram", "1MiB"], "gives 2 host slots per layer"),
    (["plan", "--gpu", "rtx4090", "--host-ram", "-5"], "bad size '-5'"),
])
def test_bad_tier_flags_are_one_error_line(args, match):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and match in err[0], r.output
