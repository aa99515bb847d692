"""Hardware profiles composed from cited parts (``--hw GPU/LINK/HOST``), and bad parts files refused."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.hardware import PROFILES_DIR, compose_profile, gpu_vram, load_profile
from ggmoe.cache.parts import COPY_SHARE, CPU_SHARE, DISK_SHARE, GPU_SHARE, load_parts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec,copy_gbs,gpu_gbs,cpu_gbs", [
    ("rtx4090/pcie4x16/ddr5-5600x2", 16 * 1.969, 1008, 89.6),
    ("rtx3090/pcie3x16/ddr4-3200x2", 16 * 0.985, 936, 51.2),
    ("rtx5090/pcie5x16/ddr5-6000x2", 16 * 3.938, 1792, 96.0),
    ("rtx4060ti16/pcie5x16/ddr5-5600x2", 8 * 1.969, 288, 89.6),  # the card wires PCIe 4.0 x8
    ("rtx5060ti16/pcie4x16/ddr5-5600x2", 16 * 1.969, 448, 89.6),  # its 5.0 x8 is as fast as the slot's 4.0 x16
    ("rtx5060ti16/pcie4x8/ddr5-5600x2", 8 * 1.969, 448, 89.6),
    ("a6000/pcie4x4/epyc7742", 4 * 1.969, 768, 204.8),
    ("l40s/pcie4x16/epyc7742", 16 * 1.969, 864, 204.8),
    ("h100/pcie5x16/epyc7742", 16 * 3.938, 2000, 204.8),
])
def test_composed_profiles_follow_the_specifications(spec, copy_gbs, gpu_gbs, cpu_gbs):
    p = load_profile(spec)
    assert p.copy_bytes_per_s == pytest.approx(COPY_SHARE * copy_gbs * 1e9, rel=1e-3)
    assert p.gpu_bytes_per_s == pytest.approx(GPU_SHARE * gpu_gbs * 1e9)
    assert p.cpu_bytes_per_s == pytest.approx(CPU_SHARE * cpu_gbs * 1e9)


@pytest.mark.parametrize("link", ["tb3", "tb4"])
def test_thunderbolt_is_its_tunnel_not_its_port(link):
    p = load_profile(f"rtx4090/{link}/ddr5-5600x2")
    assert p.copy_bytes_per_s == pytest.approx(2.75e9) and p.copy_latency_s == pytest.approx(15e-6)


def test_every_figure_names_its_source():
    _, sources = compose_profile("rtx5090/tb5/ddr5-6000x2")
    assert len(sources) == 10 and all(s.strip() for s in sources.values())
    parts = load_parts()
    assert all(p.source for kind in parts.values() for p in kind.values())
    assert gpu_vram("rtx4060ti16") == 16 << 30


@pytest.mark.parametrize("spec,match", [
    ("rtx4080/pcie4x16/ddr5-5600x2", "unknown GPU 'rtx4080'; known: a6000"),
    ("rtx4090/pcie6x16/ddr5-5600x2", "unknown link 'pcie6x16'"),
    ("rtx4090/pcie4x16/ddr3", "unknown host 'ddr3'"),
    ("rtx4090/pcie4x16", "compose it as GPU/LINK/HOST"),
    ("rtx4090//ddr5-5600x2", "compose it as GPU/LINK/HOST"),
    ("rtx4090/pcie4x16/ddr5-5600x2/floppy", "unknown disk 'floppy'; known: nvme3, nvme4, nvme5, sata"),
    ("rtx4090/pcie4x16/ddr5-5600x2/nvme4/x", "compose it as GPU/LINK/HOST"),
])
def test_unknown_names_are_one_clear_error(spec, match):
    with pytest.raises(UsageError, match=match):
        load_profile(spec)


@pytest.mark.parametrize("spec,read_gbs,latency_us", [
    ("rtx4090/pcie4x16/ddr5-5600x2", 7.45, 50.0),  # no disk named: DEFAULT_DISK
    ("rtx4090/pcie4x16/ddr5-5600x2/nvme4", 7.45, 50.0),
    ("rtx4090/pcie4x16/ddr5-5600x2/nvme3", 3.5, 53.0),
    ("rtx5090/pcie5x16/ddr5-6000x2/nvme5", 12.4, 44.0),
    ("rtx3090/pcie3x16/ddr4-3200x2/sata", 0.56, 77.0),
])
def test_the_disk_is_the_fourth_part(spec, read_gbs, latency_us):
    p = load_profile(spec)
    assert p.disk_bytes_per_s == pytest.approx(DISK_SHARE * read_gbs * 1e9)
    assert p.disk_latency_s == pytest.approx(latency_us * 1e-6)
    # an expert's reads are in flight together: one latency, then the bytes at the expert rate
    assert p.disk_read_s(10**7) == pytest.approx(latency_us * 1e-6 + 10**7 / (DISK_SHARE * read_gbs * 1e9))


@pytest.mark.parametrize("name", ["pcie4", "h100"])
def test_a_profile_file_without_a_disk_gets_the_default(name):
    p = load_profile(name)
    assert p.disk_bytes_per_s == pytest.approx(DISK_SHARE * 7.45e9) and p.disk_latency_s == pytest.approx(50e-6)


def test_a_profile_file_names_its_disk_and_round_trips(tmp_path):
    from ggmoe.cache.hardware import render_profile

    text = (PROFILES_DIR / "pcie4.toml").read_text() + "\n[disk]\nbytes_per_s = 3.0e9\nlatency_s = 8.0e-5\n"
    (tmp_path / "p.toml").write_text(text)
    p = load_profile(tmp_path / "p.toml")
    assert (p.disk_bytes_per_s, p.disk_latency_s) == (3.0e9, 8.0e-5)
    (tmp_path / "q.toml").write_text(render_profile(p, {}))
    assert load_profile(tmp_path / "q.toml") == p
    (tmp_path / "r.toml").write_text(text.replace("3.0e9", "-1.0"))
    with pytest.raises(UsageError, match=r"\[disk\] bytes_per_s must be"):
        load_profile(tmp_path / "r.toml")


GOOD_GPU = ('[gpu.x]\nmemory_bytes_per_s = 1e12\nvram_bytes = 100\ninterface = "pcie4x16"\nsource = "s"\n')


@pytest.mark.parametrize("text,match", [
    (GOOD_GPU.replace("memory_bytes_per_s = 1e12\n", ""), r"\[gpu.x\] memory_bytes_per_s is missing"),
    (GOOD_GPU.replace("1e12", "-1e12"), r"\[gpu.x\] memory_bytes_per_s must be a finite number > 0"),
    (GOOD_GPU.replace("vram_bytes = 100", "vram_bytes = 0"), r"\[gpu.x\] vram_bytes must be a finite number > 0"),
    (GOOD_GPU.replace('source = "s"', 'source = ""'), r"\[gpu.x\] source must be a non-empty string"),
    (GOOD_GPU.replace('"pcie4x16"', '"pcie9x1"'), r"\[gpu.x\] interface 'pcie9x1'"),
    ('[link.y]\nbytes_per_s = 1e9\nlatency_s = -1e-6\nsource = "s"\n', r"\[link.y\] latency_s must be"),
    ('[host.z]\nsource = "s"\n', r"\[host.z\] memory_bytes_per_s is missing"),
    ('[ssd.z]\nsource = "s"\n', r"unknown table \[ssd\]"),
    ('[disk.z]\nread_bytes_per_s = 1e9\nlatency_s = 5e-5\nsource = "s"\n', r"\[disk.z\] random_4k_bytes_per_s is missing"),
    ("[gpu\n", "not a valid TOML"),
])
def test_a_parts_file_with_a_missing_or_negative_field_is_refused_naming_it(tmp_path, text, match):
    path = tmp_path / "parts.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=match):
        load_parts(path)
