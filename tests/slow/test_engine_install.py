"""The engine from an installed package: ggmoe pip-installed from this clone into a clean virtual environment,
then ``ggmoe engine build --install`` (the cached wheel in ~/.cache/ggmoe/engine/ when there is one, else a
build of several minutes), then a working expert cache.

ggmoe goes in with ``--no-deps`` and its other dependencies beside it: pip would otherwise compile the stock
llama-cpp-python sdist (minutes) only for ``ggmoe engine build`` to replace it. The patch series must come
from the package's own copy (``ggmoe/_patches``), not from the clone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_DEPS = ["numpy>=1.24", "gguf==0.19.0", "click>=8.1", "prometheus-client>=0.17"]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout)


def test_pip_install_then_engine_build_gives_a_working_cache(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, ggmoe = str(venv / "bin" / "python"), str(venv / "bin" / "ggmoe")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CMAKE_ARGS", "GGMOE_CUDA", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    r = _run([py, "-m", "pip", "install", "-q", *RUNTIME_DEPS], env)
    assert r.returncode == 0, r.stderr
    # A copy of the clone outside it, so nothing can be found through the clone's paths.
    src = tmp_path / "src"
    src.mkdir()
    parts = ["ggmoe", "predictors", "patches", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md"]
    subprocess.run(["cp", "-r", *(str(ROOT / p) for p in parts), str(src)], check=True)
    r = _run([py, "-m", "pip", "install", "-q", "--no-deps", str(src)], env)
    assert r.returncode == 0, r.stderr

    before = _run([ggmoe, "engine", "status"], env)
    assert before.returncode == 1 and "ggmoe engine build --install" in before.stdout, before.stdout

    r = _run([ggmoe, "engine", "build", "--install"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "patched" in r.stdout

    status = _run([ggmoe, "engine", "status", "--json"], env)
    assert status.returncode == 0, status.stdout + status.stderr
    info = json.loads(status.stdout)
    assert info["patched"] and info["version"] == info["expected_version"]
    assert Path(info["patch_dir"]).parts[-2:] == ("ggmoe", "_patches") and "site-packages" in info["patch_dir"]
    assert info["patches_available"] == sorted(p.name for p in (ROOT / "patches").glob("*.patch"))

    check = ("import ggmoe\n"
             "with ggmoe.load(cache_slots=4, n_ctx=128) as llm:\n"
             "    out = llm.create_completion('The quick brown fox', max_tokens=8, temperature=0)\n"
             "    c = llm.stats()['cache']\n"
             "    print(out['usage']['completion_tokens'], c['total']['hits'] + c['total']['misses'])\n")
    r = _run([py, "-c", check], env, timeout=300)
    assert r.returncode == 0, r.stderr
    n_tokens, lookups = map(int, r.stdout.split())
    assert n_tokens > 0 and lookups > 0
