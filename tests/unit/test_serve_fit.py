"""``ggmoe serve --fit``: the plan of ``plan --gpu`` on this machine (ggmoe.cli.fit), with the driver's answers
and the host measurement given, so every branch runs without a GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.parts import load_parts
from ggmoe.cli import fit as F
from ggmoe.cli.options import CacheFlags, run_config
from ggmoe.inspect import inspect_model
from tools.gpu.realshape import write_model

pytestmark = pytest.mark.unit

KNOWN = sorted(load_parts()["gpu"])
GB = 1e9


def flags(**given) -> CacheFlags:
    """The serve command's cache flags, none given but ``given``."""
    return CacheFlags(**given)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A header-only GGUF of the toy real shape: 4 MoE layers, 32 experts, top-4, Q4_K."""
    return write_model("toy", tmp_path_factory.mktemp("m") / "toy.gguf", header_only=True)[0]


@pytest.mark.parametrize("name,part", [
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA GeForce RTX 4060 Ti", "rtx4060ti16"),
    ("NVIDIA GeForce RTX 5060 Ti", "rtx5060ti16"),
    ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA GeForce RTX 3090 Ti", None),  # another card: not the 3090's figures
    ("NVIDIA GeForce RTX 4070 SUPER", None),
    ("AMD Radeon RX 7900 XTX", None),
])
def test_the_driver_name_finds_the_part(name, part):
    assert F.gpu_part(name, KNOWN) == part


@pytest.mark.parametrize("text,expected", [
    ("NVIDIA GeForce RTX 4090, 24564, 23000, 4, 16\n", ("NVIDIA GeForce RTX 4090", 24564 << 20, 23000 << 20, 4, 16)),
    ("NVIDIA H100 80GB HBM3, 81559, 81000, [N/A], 16", ("NVIDIA H100 80GB HBM3", 81559 << 20, 81000 << 20, None, 16)),
    ("No devices were found\n", None),
    ("", None),
])
def test_nvidia_smi_answers_parse(text, expected):
    assert F.parse_nvidia_smi(text) == expected


def test_no_nvidia_smi_is_no_answer():
    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    assert F.read_nvidia_smi(missing) is None
    assert F.read_nvidia_smi(lambda *a, **k: subprocess.CompletedProcess(a, 9, "", "NVML error")) is None


def test_this_machine_takes_the_driver_link_and_free_vram_and_measures_the_cpu():
    smi = ("NVIDIA GeForce RTX 4090", 24 << 30, 20 << 30, 3, 8)
    m = F.this_machine("NVIDIA GeForce RTX 4090", None, 4, smi, lambda n: 40 * GB)
    assert (m.part, m.link, m.vram_bytes, m.cpu_bytes_per_s) == ("rtx4090", "pcie3x8", 20 << 30, 40 * GB)
    assert {k for k, _ in m.sources} == {"GPU", "link", "VRAM", "CPU"}
    m = F.this_machine("NVIDIA GeForce RTX 4090", None, 4, None, lambda n: 40 * GB)  # no nvidia-smi
    assert (m.link, m.vram_bytes) == ("pcie4x16", 24 << 30)
    m = F.this_machine("Some GPU", "rtx5060ti16/pcie4x16/ddr4-3200x2", 4, None, lambda n: 40 * GB)
    assert (m.part, m.link) == ("rtx5060ti16", "pcie4x16")


@pytest.mark.parametrize("name,hw,match", [
    ("AMD Radeon RX 7900 XTX", None, "not in the parts file"),
    ("NVIDIA GeForce RTX 4090", "rtx4090", "GPU/LINK/HOST"),
    ("NVIDIA GeForce RTX 4090", "rtx9999/pcie4x16/ddr5-5600x2", "unknown GPU 'rtx9999'"),
])
def test_a_machine_it_cannot_describe_is_one_clear_error(name, hw, match):
    with pytest.raises(UsageError, match=match):
        F.this_machine(name, hw, 4, None, lambda n: 40 * GB)


def test_cache_flags_with_fit_are_refused_before_anything_loads():
    with pytest.raises(UsageError, match="--fit chooses the cache: leave out --cache-slots, --decode-mode"):
        F.fit(None, flags(cache_slots=4, decode_mode="sync"), None, print, None, None)


def test_without_a_gpu_it_says_so_in_one_line_and_plans_nothing():
    lines: list[str] = []
    out = F.fit(None, flags(hw="rtx4090/pcie4x16/ddr5-5600x2"), None, lines.append, None, None)
    assert len(lines) == 1 and "no GPU" in lines[0]
    assert out == flags()  # no cache, no profile


@pytest.mark.parametrize("free_mib,way", [
    (24000, "all experts in VRAM"),  # the toy's experts all fit
    (1550, "ggmoe, "),  # a cache of some of them
    (1539, None),  # no cache fits: served from host memory
])
def test_fit_serves_the_fastest_way_it_can_run_and_labels_every_estimate(toy, free_mib, way):
    facts = inspect_model(toy)
    smi = ("NVIDIA GeForce RTX 4090", 24 << 30, free_mib << 20, 4, 16)
    lines: list[str] = []
    out = F.fit(facts, flags(), 2, lines.append, "NVIDIA GeForce RTX 4090", smi, lambda n: 40 * GB)
    estimates = [x for x in lines if "tok/s" in x]
    assert estimates and all("estimate" in x or "est." in x for x in estimates)
    if way is None:
        assert out == flags() and any("serving without a cache" in x for x in lines)
        return
    assert any(x.startswith(f"  serving: {way}") for x in lines)
    cfg = run_config(out.cache_slots, out.vram, out.policy, facts, out.miss_policy, None, out.hw,
                     None, out.decode_mode)  # what serve then builds: the flags are valid for the model
    # a cache that serves misses admits by use (tinylfu); one that holds every expert has nothing to filter
    assert cfg is not None and cfg.cache.policy == ("lru" if way == "all experts in VRAM" else "tinylfu")


def test_the_host_read_is_measured():
    assert F.measure_host_read(2, 8 << 20) > 1e8  # bytes/s: any machine reads 8 MiB faster than in 80 ms


def test_serve_refuses_fit_with_cache_flags_before_loading():
    from click.testing import CliRunner

    from ggmoe.cli import main

    r = CliRunner().invoke(main, ["serve", "--fit", "--vram", "4GiB", "--port", "1"])
    assert r.exit_code == 2 and "--fit chooses the cache: leave out --vram" in r.output
    assert "Traceback" not in r.output
