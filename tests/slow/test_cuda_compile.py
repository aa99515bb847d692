"""The CUDA sources ggmoe's patches change compile with the nvcc installed here (sm_90, ``-c`` only)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_patched_cuda_files_are_listed():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "checks" / "cuda_compile_check.py"), "--list"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) >= {"ggml/src/ggml-cuda/mmvq.cu", "ggml/src/ggml-cuda/ggml-cuda.cu"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_patched_cuda_files_compile_for_sm_90():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "checks" / "cuda_compile_check.py")],
                       capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok     nvcc -c") >= 2, r.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_zero_copy_probe_compiles(tmp_path):
    r = subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(tmp_path / "probe"),
                        str(ROOT / "tools" / "gpu" / "zero_copy_probe.cu")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
