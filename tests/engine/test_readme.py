"""The README's Python example runs as written (on the embedded model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ggmoe.models import default_model_path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.skipif(default_model_path() is None, reason="this install has no embedded model")
def test_readme_python_example_runs_as_written(tmp_path):
    blocks = _python_blocks()
    assert blocks, "README.md has no python example"
    for code in blocks:
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip(), "the example printed nothing"
