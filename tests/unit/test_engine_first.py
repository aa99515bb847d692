"""``import ggmoe`` loads a CUDA build of llama-cpp-python before numpy (see ggmoe/__init__.py), and nothing else.

A fake ``llama_cpp`` package on PYTHONPATH stands in for the engine: its lib folder has a libggml-cuda file or
not, and its ``__init__`` records whether numpy was loaded when it ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# (case, a CUDA library in llama_cpp/lib, code run before `import ggmoe`, llama_cpp imported by ggmoe)
CASES = [
    ("cuda build", True, "", True),
    ("cpu build", False, "", False),
    ("numpy already imported", True, "import numpy", False),
]


def _fake_engine(root: Path, cuda: bool) -> Path:
    pkg = root / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "lib" / ("libggml-cuda.so" if cuda else "libggml-cpu.so")).write_bytes(b"")
    (pkg / "__init__.py").write_text("import sys\nNUMPY_FIRST = 'numpy' in sys.modules\n")
    return root


@pytest.mark.parametrize(("case", "cuda", "before", "expected"), CASES, ids=[c[0] for c in CASES])
def test_engine_loaded_before_numpy(tmp_path: Path, case: str, cuda: bool, before: str, expected: bool) -> None:
    site = _fake_engine(tmp_path, cuda)
    code = (f"{before}\nimport sys, ggmoe\nm = sys.modules.get('llama_cpp')\n"
            "print(m is not None, getattr(m, 'NUMPY_FIRST', None))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported, numpy_first = out.stdout.split()
    assert imported == str(expected)
    if expected:
        assert numpy_first == "False"  # the engine came first
