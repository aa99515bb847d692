"""Bad-input suite: every case runs ggmoe as a user would and must end in one clean error line."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.badinput


@dataclass(frozen=True)
class Outcome:
    code: int  # exit status; negative: killed by that signal (a crash)
    stdout: str
    stderr: str


def run_ggmoe(*args: str, cwd: Path | None = None, timeout: float = 60, stdin: str | None = None) -> Outcome:
    """``ggmoe ARGS`` in a subprocess, so that an abort or a segfault is a result, not the end of the tests."""
    env = {**os.environ, "PYTHONFAULTHANDLER": ""}
    try:
        res = subprocess.run([sys.executable, "-m", "ggmoe", *args], cwd=cwd, capture_output=True, timeout=timeout,
                             env=env, input=stdin.encode() if stdin is not None else None, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ggmoe {' '.join(args)} hung for {timeout} s")
    return Outcome(res.returncode, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace"))


def assert_clean_error(out: Outcome, match: str | None = None, code: int = 2) -> None:
    """Exit ``code``, exactly one ``error:`` line on stderr, no traceback, no crash."""
    assert out.code >= 0, f"killed by signal {-out.code}: {out.stderr[-800:]}"
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.code == code, f"exit {out.code}: {out.stderr[-800:]}"
    assert len(errors) == 1, out.stderr[-2000:]
    if match is not None:
        assert match in errors[0], errors[0]
