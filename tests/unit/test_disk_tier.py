"""The simulator's disk tier: the disk's queue and the host tier by hand, copies that wait for their reads, whole
runs with a host tier smaller than the model, and disk prefetch from the routing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_simulator import BPE, CHUNK, PROFILE, trace  # the simulator's hand-made traces

from ggmoe.cache.clock import ManualClock
from ggmoe.cache.copy import Priority
from ggmoe.simulate.des import SimConfig, simulate
from ggmoe.simulate.disk import DiskLinkCopyBackend, DiskQueue, HostTierTimes, TierCounts

DISK = dataclasses.replace(PROFILE, disk_bytes_per_s=1e9, disk_latency_s=1e-4)
READ = 1e-4 + BPE / 1e9  # s to read one expert on an idle disk
GPU = 1e-3 + BPE / 1e12  # a layer and one expert on the GPU


def host_tier(slots: int, profile=DISK, n_prefetch: int = 0) -> tuple[ManualClock, HostTierTimes]:
    clock = ManualClock()
    disk = DiskQueue(clock, profile, TierCounts())
    return clock, HostTierTimes(slots, 8, [0, 1], {0: BPE, 1: BPE}, disk, n_prefetch=n_prefetch)


@pytest.mark.parametrize("reads,gaps,want", [
    ([BPE], [0.0], [READ]),  # an idle disk: latency, then the bytes
    ([BPE, BPE], [0.0, 0.0], [READ, READ + BPE / 1e9]),  # queued behind: the latency is hidden
    ([BPE, BPE], [0.0, 1.0], [READ, 1.0 + READ]),  # idle again: the latency counts again
])
def test_the_disk_queue_by_hand(reads, gaps, want):
    clock = ManualClock()
    disk = DiskQueue(clock, DISK, TierCounts())
    got = []
    for n, gap in zip(reads, gaps, strict=True):
        clock.advance(gap)
        got.append(disk.read(n))
    assert got == pytest.approx(want)


@pytest.mark.parametrize("slots,accesses,hits,misses", [
    (2, [0, 1, 0, 2, 0, 1], 2, 4),  # LRU: 2 evicts 1 (0 was used since), so 0 hits and 1 misses again
    (3, [0, 1, 0, 2, 0, 1], 3, 3),  # room for all three
    (1, [0, 0, 1, 0], 1, 3),
])
def test_the_host_tier_is_lru_and_reads_nothing_twice_while_resident(slots, accesses, hits, misses):
    clock, host = host_tier(slots)
    for e in accesses:
        clock.advance(1.0)  # every read has landed by the next access
        host.fetch(0, e)
    c = host.counts
    assert (c.host_hits, c.host_misses, c.host_late) == (hits, misses, 0)
    assert c.disk_reads == misses and c.disk_bytes == misses * BPE
    assert len(host.landed[0]) <= slots


def test_a_copy_waits_for_its_disk_read_and_a_resident_one_goes_first():
    slow = dataclasses.replace(DISK, disk_bytes_per_s=1e8)  # a read (10.1 ms) outlasts a copy (4 ms)
    clock, host = host_tier(2, slow)
    host.fetch(0, 1)
    clock.advance(1.0)  # expert 1 sits in the host tier
    link = DiskLinkCopyBackend(clock, {0: BPE, 1: BPE}, slow, 3, None, host)
    t0 = clock.now()
    far = link.submit(0, 5, 0, Priority.DEMAND)  # from disk: ready after its read
    near = link.submit(0, 1, 1, Priority.DEMAND)  # in the host tier: ready now
    link.wait([near])
    assert clock.now() - t0 == pytest.approx(3 * CHUNK)
    link.wait([far])
    assert clock.now() - t0 == pytest.approx(slow.disk_read_s(BPE) + 3 * CHUNK)
    assert link.demand_now(0, 1) is False


def test_one_layer_by_hand():
    # top-1, experts 0, 1, 0; 2 GPU slots, 1 host slot: both misses read the disk, then cross the link
    tr = trace([[[0]], [[1]], [[0]]])
    r = simulate(tr, SimConfig({0: 2}, host_slots=1), {0: BPE}, DISK)
    assert r.tpot_s == pytest.approx((READ + 3 * CHUNK + GPU + GPU) / 2)
    host = r.tiers["host"]
    assert (host["host_misses"], host["host_hits"], host["disk_reads"]) == (2, 0, 2)
    assert r.tiers["disk"]["bytes"] == 2 * BPE and r.tiers["gpu"]["hits"] == 1
    assert host["disk_bytes_per_token"] == pytest.approx(2 * BPE / 2)  # the prompt's read too, over 2 decoded


@pytest.mark.parametrize("host_slots", [None, 8, 100])
def test_every_expert_in_host_memory_is_no_disk_tier(host_slots):
    tr = trace([[[0], [1]], [[1], [2]], [[0], [3]], [[4], [1]]])
    base = simulate(tr, SimConfig({0: 2, 1: 2}), {0: BPE, 1: BPE}, DISK)
    r = simulate(tr, SimConfig({0: 2, 1: 2}, host_slots=host_slots), {0: BPE, 1: BPE}, DISK)
    assert r.tiers == {} and r.tpot_s == base.tpot_s


ROUTING = [[[(3 * t + j) % 8, (5 * t + 2 * j + 1) % 8] for j in range(3)] for t in range(24)]


@pytest.mark.parametrize("mode,fills", [("sync", False), ("async", False), ("async", True)])
def test_without_a_profile_the_disk_tier_changes_no_gpu_count(mode, fills):
    tr = trace(ROUTING, n_prefill=4)
    bpe = dict.fromkeys(range(3), BPE)
    base = simulate(tr, SimConfig(dict.fromkeys(range(3), 3), decode_mode=mode, fills=fills), bpe)
    r = simulate(tr, SimConfig(dict.fromkeys(range(3), 3), decode_mode=mode, fills=fills, host_slots=3), bpe)
    assert r.stats["total"]["hits"] == base.stats["total"]["hits"] > 0
    assert r.stats["total"]["misses"] == base.stats["total"]["misses"]
    host = r.tiers["host"]
    # no prefetch: every read is a miss's, or the prompt's layers streamed through (too wide for the slots)
    assert host["disk_reads"] == host["host_misses"] + host["streamed_reads"] and host["host_misses"] > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_slower_disk_or_fewer_host_slots_never_speed_a_run_up(mode):
    tr = trace(ROUTING, n_prefill=4)
    bpe = dict.fromkeys(range(3), BPE)

    def tpot(slots: int | None, disk_bps: float = 1e9) -> float:
        prof = dataclasses.replace(DISK, disk_bytes_per_s=disk_bps)
        return simulate(tr, SimConfig(dict.fromkeys(range(3), 3), decode_mode=mode, host_slots=slots), bpe,
                        prof).tpot_s

    assert tpot(None) <= tpot(6) <= tpot(3)
    assert tpot(3, 4e9) <= tpot(3, 1e9) <= tpot(3, 2.5e8)


def test_an_oracle_reads_the_disk_ahead_of_the_layers():
    tr = trace(ROUTING, n_prefill=4)
    bpe = dict.fromkeys(range(3), BPE)
    cfg = SimConfig(dict.fromkeys(range(3), 3), host_slots=4, predictor="oracle", stride=1)
    r = simulate(tr, cfg, bpe, DISK)
    host = r.tiers["host"]
    assert host["prefetch_reads"] > 0 and host["predicted_read_share"] > 0
    assert host["prefetch_used_bytes"] > 0
    assert host["disk_reads"] == host["host_misses"] + host["prefetch_reads"] + host["streamed_reads"]


@pytest.mark.parametrize("used,wasted,limit,want", [
    (BPE, 0, 2, 3),  # used bytes outrun the wasted: one more read per prediction, up to n_prefetch
    (BPE, 0, 4, 4),
    (0, BPE, 2, 1),  # wasted outrun the used: one fewer
    (0, 0, 2, 2),  # nothing judged: as it was
])
def test_disk_prefetch_is_judged_by_bytes(used, wasted, limit, want):
    _, host = host_tier(4, n_prefetch=4)
    host.limit = limit
    host.counts.prefetch_used_bytes, host.counts.prefetch_wasted_bytes = used, wasted
    host._judge()
    assert host.limit == want


def test_disk_prefetch_skips_what_is_resident_or_on_the_gpu():
    clock, host = host_tier(4, n_prefetch=4)
    host.fetch(0, 1)
    clock.advance(1.0)
    assert host.prefetch(0, [1, 2, 3, 4], skip=[3]) == 2  # 1 resident, 3 on the GPU
    assert host.counts.prefetch_reads == 2 and host.resident(0, 2) and host.resident(0, 4)


TINY = "ggmoe/models/tiny-moe.gguf"  # 8 MoE layers of 32 experts, top-4, 52,224 B per expert
TINY_SLOT = 8 * 52_224  # one host slot in every layer


def _tiny_trace(tmp_path) -> str:
    """An imported routing log of the tiny model's shape: 48 tokens, a skewed choice of experts (fixed seed)."""
    import json

    from click.testing import CliRunner

    from ggmoe.cli import main

    rng = np.random.default_rng(7)
    p = np.arange(32, 0, -1, dtype=float) ** 2
    recs = [{"seq": "a", "token": t, "layer": il, "topk_ids": rng.choice(32, 4, replace=False, p=p / p.sum()).tolist()}
            for t in range(48) for il in range(8)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "t"
    r = CliRunner().invoke(main, ["trace", "import", str(log), "-o", str(out), "--n-expert", "32", "--top-k", "4"])
    assert r.exit_code == 0, r.output
    return str(out)


@pytest.mark.parametrize("host_ram,host_slots", [(16 * TINY_SLOT, 16), (100 << 20, None)])
def test_simulate_host_ram_reports_each_tier(tmp_path, host_ram, host_slots):
    import json

    from click.testing import CliRunner

    from ggmoe.cli import main

    args = ["simulate", _tiny_trace(tmp_path), "--model", TINY, "--cache-slots", "8", "--host-ram", str(host_ram),
            "--hw", "rtx4090/pcie4x16/ddr5-5600x2/nvme3", "--jobs", "1"]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    tiers = json.loads(r.output[r.output.index("{"):])["results"][0]["tiers"]
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    if host_slots is None:
        assert tiers == {} and "none: every expert fits the host tier" in table.output
        return
    assert tiers["host"]["slots"] == host_slots and tiers["disk"]["bytes"] == tiers["disk"]["reads"] * 52_224 > 0
    assert "host hits" in table.output and "disk MiB/tok" in table.output
    assert f"host    {host_slots}/32 slots/layer" in table.output


@pytest.mark.parametrize("args,match", [
    (["--model", TINY, "--host-ram", str(2 * TINY_SLOT)], "needs at least n_expert_used = 4"),
    (["--model", TINY, "--host-ram", "abc"], "bad size 'abc'"),
    (["--hw", "none", "--host-ram", "1GiB"], "--host-ram needs the model's bytes per expert: give --model"),
])
def test_simulate_refuses_bad_host_ram_in_one_line(tmp_path, args, match):
    from click.testing import CliRunner

    from ggmoe.cli import main

    r = CliRunner().invoke(main, ["simulate", _tiny_trace(tmp_path), "--cache-slots", "8", *args])
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(err) == 1 and match in err[0], r.output


@pytest.mark.parametrize("touch,evicted", [(False, 0), (True, 1)])
def test_the_host_policy_ranks_by_every_use_gpu_hits_too(touch, evicted):
    # 2 host slots hold 0 and 1; the GPU then uses 0 again (a GPU hit: no host access); 2 misses both tiers
    clock, host = host_tier(2)
    for e in (0, 1):
        host.fetch(0, e)
        clock.advance(1.0)
    if touch:
        host.touch(0, [0, 5])  # the layer's routing: 0 used again (5 is not in the host tier: ignored)
    host.fetch(0, 2)
    assert not host.resident(0, evicted) and host.resident(0, 1 - evicted) and host.resident(0, 2)


def _tiny_recorded(tmp_path) -> str:
    """A hand-made trace of the tiny model, its fingerprint the model's (what plan --traces checks)."""
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.trace.format import write_trace

    rng = np.random.default_rng(3)
    p = np.arange(32, 0, -1, dtype=float) ** 2
    ids = [[rng.choice(32, 4, replace=False, p=p / p.sum()).tolist() for _ in range(8)] for _ in range(40)]
    tr = trace(ids, n_prefill=8, n_expert=32)
    tr = dataclasses.replace(tr, meta=dataclasses.replace(tr.meta, model_fingerprint=model_fingerprint(TINY)))
    return str(write_trace(tr, tmp_path / "trace.npz"))


def test_plan_traces_simulates_every_candidate_over_the_disk(tmp_path):
    import json

    from click.testing import CliRunner

    from ggmoe.cli import main

    args = ["plan", TINY, "--vram", str(8 * TINY_SLOT), "--traces", _tiny_recorded(tmp_path), "-o",
            str(tmp_path / "p.toml"), "--hw", "rtx4090/pcie4x16/ddr5-5600x2/sata"]
    plans = {}
    for host_ram in (16 * TINY_SLOT, 100 << 20):  # half the experts on a SATA disk; every expert in RAM
        r = CliRunner().invoke(main, [*args, "--host-ram", str(host_ram), "--json"])
        assert r.exit_code == 0, r.output
        plans[host_ram] = json.loads(r.output[r.output.index("{"):])
    disk, ram = plans[16 * TINY_SLOT], plans[100 << 20]
    assert (disk["host_slots"], ram["host_slots"]) == (16, None)
    assert disk["baseline_tpot_s_estimate"] > ram["baseline_tpot_s_estimate"]
    assert disk["tpot_s_estimate"] > ram["tpot_s_estimate"]
    text = CliRunner().invoke(main, [*args, "--host-ram", str(16 * TINY_SLOT)]).output
    assert "tiers (--vram spread evenly)" in text and "run it with --host-ram" in text


def test_plan_stats_refuses_a_disk_tier(tmp_path):
    from click.testing import CliRunner

    from ggmoe.cli import main

    r = CliRunner().invoke(main, ["plan", TINY, "--vram", str(8 * TINY_SLOT), "--stats", str(tmp_path / "s.npz"),
                                  "-o", str(tmp_path / "p.toml"), "--host-ram", str(16 * TINY_SLOT)])
    assert r.exit_code == 2 and "the disk tier is planned by simulating traces" in r.output, r.output
