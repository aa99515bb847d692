"""``ggmoe calibrate``: measures through the engine, writes a profile --hw reads, says what it could not measure."""

from __future__ import annotations

import json

import pytest
from cli_run import ggmoe

from ggmoe.cache.hardware import load_profile
from ggmoe.engine.loader import gpu_device_name


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "me.toml"
    r = ggmoe("calibrate", "-o", str(out), "--repeat", "3", "--tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_the_profile_loads_and_holds_the_measurements(calibrated):
    out, d = calibrated
    p = load_profile(out)
    m = d["measured"]
    assert p.name == "calibrated" and "measured by ggmoe calibrate" in p.description
    assert p.cpu_bytes_per_s == pytest.approx(m["cpu_bytes_per_s"], rel=1e-5)
    assert p.hook_s == pytest.approx(m["hook_s"], rel=1e-4)
    assert 0 < m["hook_s"] < 0.01 and m["token_host_s"] > 0 and m["cpu_bytes_per_s"] > 1e6
    assert len(m["copy_points"]) >= 2 and all(b > 0 and s > 0 for b, s in m["copy_points"])
    # the CPU rate is what a token reads over its time, by definition of the measurement
    assert m["cpu_bytes_per_s"] == pytest.approx(m["bytes_per_token"] / m["token_host_s"], rel=1e-6) \
        or m["gpu"] is not None


@pytest.mark.skipif(gpu_device_name() is not None, reason="CPU-only behaviour")
def test_cpu_only_says_what_it_could_not_measure(calibrated):
    out, d = calibrated
    text = out.read_text()
    assert d["measured"]["gpu"] is None and d["measured"]["token_device_s"] is None
    assert any("no GPU" in n for n in d["measured"]["notes"])
    base = load_profile("pcie4")
    p = load_profile(out)
    assert (p.copy_bytes_per_s, p.gpu_bytes_per_s, p.gpu_layer_s) == \
        (base.copy_bytes_per_s, base.gpu_bytes_per_s, base.gpu_layer_s)
    assert "from the base profile 'pcie4'" in text


def test_run_takes_the_profile(calibrated, tmp_path):
    out, _ = calibrated
    r = ggmoe("run", "-p", "hi", "-n", "4", "--cache-slots", "8", "--miss-policy", "auto", "--hw", str(out))
    assert r.returncode == 0, r.stderr


def test_printed_without_out():
    r = ggmoe("calibrate", "--repeat", "1", "--tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "[cpu]" in r.stdout and "route hook" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["-o", "profile.txt"], ".toml"),
    (["--base", "nope"], "unknown hardware profile"),
    (["--repeat", "0"], "--repeat"),
    (["missing.gguf"], "no such file"),
])
def test_bad_flags(args, message):
    r = ggmoe("calibrate", *args, ok=False)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
