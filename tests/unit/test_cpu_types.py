"""The CPU's expert rate per ggml type in a hardware profile ([cpu.types]) and for a model's mix of types."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache.hardware import load_profile, render_profile

pytestmark = pytest.mark.unit

GB = 1e9


@pytest.mark.parametrize("types, mix, want_gbs", [
    ((), {"Q4_K": 2, "Q5_0": 1}, 45.0),  # no per-type figures: the profile's own rate
    ((("Q4_K", 30 * GB),), {"Q4_K": 100}, 30.0),
    ((("Q4_K", 30 * GB),), {"Q4_K": 100, "Q5_0": 50}, 150 / (100 / 30 + 50 / 45)),  # Q5_0 at the profile's rate
    ((("Q4_K", 30 * GB), ("Q5_0", 60 * GB)), {"Q4_K": 100, "Q5_0": 100}, 200 / (100 / 30 + 100 / 60)),
    ((("MXFP4", 44.5 * GB),), {}, 45.0),  # no expert bytes: left as it is
])
def test_the_cpu_rate_of_a_mix_of_expert_types(types, mix, want_gbs):
    base = dataclasses.replace(load_profile("pcie4"), cpu_bytes_per_s=45 * GB, cpu_type_bytes_per_s=types)
    assert base.for_expert_types(mix).cpu_bytes_per_s == pytest.approx(want_gbs * GB)


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_the_measured_profiles_carry_their_mxfp4_figure(name):
    p = load_profile(name)
    assert dict(p.cpu_type_bytes_per_s)["MXFP4"] == p.cpu_bytes_per_s  # the one type measured there


def test_cpu_types_survive_render_and_load(tmp_path: Path):
    p = dataclasses.replace(load_profile("h100"), cpu_type_bytes_per_s=(("MXFP4", 44.5 * GB), ("Q4_K", 31 * GB)))
    f = tmp_path / "p.toml"
    f.write_text(render_profile(p, {"cpu_type_bytes_per_s": "measured"}))
    assert load_profile(f).cpu_type_bytes_per_s == p.cpu_type_bytes_per_s


@pytest.mark.parametrize("table, message", [
    ('Q9_X = 1e9', "not a ggml type"),
    ('Q4_K = -1.0', "finite number"),
    ('Q4_K = "fast"', "finite number"),
])
def test_bad_cpu_types_are_refused(tmp_path: Path, table, message):
    text = (Path(__file__).parents[2] / "ggmoe/cache/profiles/pcie4.toml").read_text()
    f = tmp_path / "p.toml"
    f.write_text(text + f"\n[cpu.types]\n{table}\n")
    with pytest.raises(UsageError, match=message):
        load_profile(f)
