"""The README's examples run as written: Python on the embedded model, curl and openai against a real server.

Only the port differs: the examples name 8080, the test server listens on a free port.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import start_server, stop_server

from ggmoe.models import default_model_path

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_PORT = "8080"

pytestmark = pytest.mark.skipif(default_model_path() is None, reason="this install has no embedded model")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def _curl_commands() -> list[str]:
    """The README's curl commands (backslash continuations joined, comments dropped)."""
    out = []
    for block in _blocks("sh"):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.strip()
            if cmd.startswith("curl "):
                out.append(shlex.split(cmd, comments=True))
    return out


@pytest.fixture(scope="module")
def example_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("readme"), "--n-ctx", "512")
    yield s
    assert stop_server(s) == 0


def _run(code: str, cwd: Path) -> str:
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip(), "the example printed nothing"
    return res.stdout


def test_readme_has_the_examples():
    assert any("ggmoe.load(" in b for b in _blocks("python"))
    assert any("from openai import OpenAI" in b for b in _blocks("python"))
    assert len(_curl_commands()) >= 2


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs_as_written(index, tmp_path, example_server):
    code = _blocks("python")[index]
    port = example_server.url.rsplit(":", 1)[1]
    _run(code.replace(f"127.0.0.1:{EXAMPLE_PORT}", f"127.0.0.1:{port}"), tmp_path)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
@pytest.mark.parametrize("index", range(len(_curl_commands())))
def test_curl_example_runs_as_written(index, example_server):
    port = example_server.url.rsplit(":", 1)[1]
    argv = [a.replace(f"127.0.0.1:{EXAMPLE_PORT}", f"127.0.0.1:{port}") for a in _curl_commands()[index]]
    res = subprocess.run([*argv, "--fail-with-body", "-sS"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip()
