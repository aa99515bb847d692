"""Hardware profiles: the built-ins load, their figures hold together, bad files get one clear line."""

from __future__ import annotations

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.hardware import DEFAULT_PROFILE, load_profile, profile_names

pytestmark = pytest.mark.unit

EXPERT = 2_000_000  # bytes of one expert, about a Qwen3-30B-A3B expert at Q4_K (3 tensors)


def test_builtins_load_and_default_is_pcie4():
    assert profile_names() == ["egpu", "h100", "h200", "pcie4"] and DEFAULT_PROFILE == "pcie4"
    for name in profile_names():
        p = load_profile(name)
        assert p.name == name and p.description


def test_the_figures_order_as_the_hardware_does():
    pcie4, h100, egpu = (load_profile(n) for n in ("pcie4", "h100", "egpu"))
    assert h100.copy_s(EXPERT, 3) < pcie4.copy_s(EXPERT, 3) < egpu.copy_s(EXPERT, 3)
    # on a slow link the CPU computes a missing expert sooner than the copy lands: the host path pays off
    assert egpu.cpu_expert_s(EXPERT) < egpu.copy_s(EXPERT, 3)
    for p in (pcie4, h100, egpu):
        assert p.gpu_expert_s(EXPERT) < p.cpu_expert_s(EXPERT)  # a resident expert is cheapest
    # by hand for pcie4: 3 x 10 us + 2e6 / 25e9 s = 30 + 80 = 110 us
    assert pcie4.copy_s(EXPERT, 3) == pytest.approx(110e-6)
    # auto's cost of a copy is what the link charges for one: a copy per tensor kind, each with its latency
    assert egpu.miss_costs().copy_s(EXPERT) == pytest.approx(egpu.copy_s(EXPERT, 3))
    assert egpu.miss_costs(1).copy_s(EXPERT) == pytest.approx(egpu.copy_s(EXPERT, 1))


BAD = {
    "not toml": (b"[copy\nbytes = ", "not a valid TOML"),
    "not utf-8": (b"name = \"\xff\"", "not a valid TOML"),
    "missing table": (b'name = "x"\n', "[copy] bytes_per_s"),
    "string bandwidth": (b'[copy]\nbytes_per_s = "fast"\n', "[copy] bytes_per_s"),
    "negative latency": (b"[copy]\nbytes_per_s = 1e9\nlatency_s = -1\n", "[copy] latency_s"),
    "nan": (b"[copy]\nbytes_per_s = nan\n", "[copy] bytes_per_s"),
    "inf": (b"[copy]\nbytes_per_s = inf\n", "[copy] bytes_per_s"),
    "bool": (b"[copy]\nbytes_per_s = true\n", "[copy] bytes_per_s"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_profile_files(case, tmp_path):
    data, match = BAD[case]
    p = tmp_path / "hw.toml"
    p.write_bytes(data)
    with pytest.raises(UsageError, match=match.replace("[", r"\[").replace("]", r"\]")):
        load_profile(p)


def test_unknown_profile_lists_the_choices(tmp_path):
    with pytest.raises(UsageError, match="egpu, h100, h200, pcie4"):
        load_profile("pcie9")
    with pytest.raises(UsageError, match="unknown hardware profile"):
        load_profile(tmp_path)


def test_a_full_custom_profile_loads(tmp_path):
    text = (load_profile.__globals__["PROFILES_DIR"] / "pcie4.toml").read_text().replace('"pcie4"', '"mine"')
    p = tmp_path / "mine.toml"
    p.write_text(text)
    assert load_profile(p).name == "mine"


@pytest.mark.parametrize("name,description", [
    ("plain", "a machine"),
    ('quote"s and \\backslash', "tab\there, unicode é, newline\nnext"),
])
def test_render_profile_round_trips(tmp_path, name, description):
    import dataclasses

    from ggmoe.cache.hardware import render_profile

    p = dataclasses.replace(load_profile("h100"), name=name, description=description, hook_s=3.25e-6,
                            cpu_latency_s=0.0)
    out = tmp_path / "p.toml"
    out.write_text(render_profile(p, {"hook_s": "measured"}))
    back = load_profile(out)
    assert back == dataclasses.replace(p, name=name, description=description)


# (copy GB/s, copy latency us, CPU GB/s, expert bytes per layer, policy asked, policy in effect)
EFFECTIVE = [
    (54.7, 14.4, 44.5, [13_219_200], "auto", "wait"),  # the H100 measured: a copy beats the CPU
    (25.0, 10.0, 44.5, [13_219_200], "auto", "auto"),  # a PCIe 4 link: the CPU is sooner
    (54.7, 14.4, 44.5, [13_219_200, 1_000], "auto", "auto"),  # one layer where the CPU wins keeps the path
    (54.7, 14.4, 44.5, [13_219_200], "cpu", "cpu"),  # asked for: kept
    (54.7, 14.4, 44.5, [13_219_200], "wait", "wait"),
]


@pytest.mark.parametrize(("copy_gbs", "lat_us", "cpu_gbs", "sizes", "asked", "want"), EFFECTIVE)
def test_auto_drops_a_host_path_it_would_never_choose(copy_gbs, lat_us, cpu_gbs, sizes, asked, want):
    from ggmoe.cache.miss import MissCosts, effective_miss_policy

    costs = MissCosts(copy_bytes_per_s=copy_gbs * 1e9, copy_latency_s=lat_us * 1e-6, cpu_bytes_per_s=cpu_gbs * 1e9)
    got, note = effective_miss_policy(asked, costs, dict(enumerate(sizes)))
    assert got == want
    assert (note is not None) == (asked == "auto" and want == "wait")
    assert effective_miss_policy("auto", None, {0: 1})[0] == "auto"  # no cost model: the CPU path stays


# ``ggmoe calibrate`` on the H200 loan of 2026-11-26 (tools/gpu/matrix.py, gpt-oss-20b's shape), as recorded
H200_CALIBRATION = dict(gpu="CUDA0", cpu="Intel(R) Xeon(R) Processor", copy_points=((4406400, 1e-4), (13219200, 2.7e-4)),
                        copy_bytes_per_s=52974697230.26, copy_latency_s=2.1742e-05, token_host_s=0.02979,
                        token_device_s=0.003298, bytes_per_token=1787737008, expert_bytes_per_token=1269043200,
                        n_moe_layers=24, n_expert_used=4, bytes_per_expert=13219200, cpu_bytes_per_s=47902397247.0,
                        gpu_bytes_per_s=542011365359.66, hook_s=5.7815e-05)


@pytest.mark.parametrize("zero_copy", [None, (51.02e9, "measured by tools/gpu/zero_copy_probe.cu on NVIDIA H200")])
def test_a_calibrated_profile_takes_the_probes_zero_copy_rate(zero_copy, tmp_path):
    from ggmoe.engine.calibrate import Calibration
    from ggmoe.simulate.calibration import profile_from, render

    cal, base = Calibration(**H200_CALIBRATION), load_profile("h100")
    profile, src = profile_from(cal, base, "matrix", zero_copy)
    want = zero_copy[0] if zero_copy else base.zero_copy_bytes_per_s
    assert profile.zero_copy_bytes_per_s == want and profile.copy_bytes_per_s == cal.copy_bytes_per_s
    assert src["zero_copy_bytes_per_s"] == (zero_copy[1] if zero_copy else "from the base profile 'h100' (not measured here)")
    out = tmp_path / "m.toml"
    out.write_text(render(cal, base, "matrix", zero_copy))
    assert load_profile(out).zero_copy_bytes_per_s == pytest.approx(want)
    assert f"# {src['zero_copy_bytes_per_s']}" in out.read_text()
    # the disk is not measured: the base profile's, said so, and read back
    assert load_profile(out).disk_bytes_per_s == pytest.approx(base.disk_bytes_per_s)
    assert "# from the base profile 'h100' (not measured here)\nbytes_per_s" in out.read_text()


def test_the_calibration_seam_names_only_fields_of_a_calibration():
    """``simulate.calibration.Measured`` (a protocol: the simulator does not import the engine) reads only
    fields ``engine.calibrate.Calibration`` has."""
    import dataclasses

    from ggmoe.engine.calibrate import Calibration
    from ggmoe.simulate.calibration import Measured

    read = {n for n, v in vars(Measured).items() if isinstance(v, property)}
    assert "copy_bytes_per_s" in read and read <= {f.name for f in dataclasses.fields(Calibration)}
