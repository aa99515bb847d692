"""The installed engine's CPU features: a native build leaves ggml's AMX kernels out (llama.cpp #20824).

Checked on the built library itself (``llama_print_system_info``: ggml's ``ggml_cpu_has_*`` report what the
compiler defined), so a CI machine of any CPU catches a build that would compile them in on an AMX one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def _status() -> dict:
    out = subprocess.run([sys.executable, "-m", "ggmoe", "engine", "status", "--json"], capture_output=True,
                         text=True, timeout=120)
    return json.loads(out.stdout)


def test_the_built_engine_has_no_amx_unless_asked_for():
    info = _status()
    assert info["installed"] and info["patched"]
    assert info["cpu_features"], info.get("system_info")  # the features are read at all
    build = info.get("build_info") or ""
    if "-DGGML_NATIVE=ON" in build and "-mno-amx-int8" not in build:
        pytest.skip("this engine was built with GGMOE_AMX=1")
    assert not [f for f in info["cpu_features"] if f.startswith("AMX")], info["system_info"]


def test_engine_status_names_the_features_and_amx():
    out = subprocess.run([sys.executable, "-m", "ggmoe", "engine", "status"], capture_output=True, text=True,
                         timeout=120)
    assert "cpu features built in:" in out.stdout and "amx:" in out.stdout, out.stdout
