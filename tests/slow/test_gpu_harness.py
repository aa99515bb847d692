"""The GPU harness runs end to end at toy size here (pack, real-shape writer, matrix with both routings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "gpu"


def test_gpu_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(TOOLS / "smoke.py"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    manifest = json.loads((tmp_path / "gpu-pack" / "MANIFEST.json").read_text())
    assert manifest["total_bytes"] < 40 << 20
    assert {"engine-src.tar.gz", "trace.npz"} <= set(manifest["files"])
    result = json.loads((tmp_path / "matrix" / "matrix.json").read_text())
    cells = result["cells"]
    configs = {(c["routing"] == "random", c["config"]) for c in cells}
    assert {(True, "stock-vram"), (True, "stock-cpu"), (True, "n-cpu-moe"), (True, "lru"), (True, "prefetch"),
            (False, "lru"), (False, "prefetch"), (False, "prefetch-eam")} <= configs
    assert all(c["decode_tps"] > 0 and c["prefill_tps"] > 0 for c in cells)
    # trace-replay rows say so, and real routing reuses experts far more than random routing
    trace_rows = [c for c in cells if c["routing"] != "random"]
    assert all("benchmark only" in c["routing"] for c in trace_rows)
    lru = {(c["routing"] == "random", c["fraction"]): c["hit_rate"] for c in cells if c["config"] == "lru"}
    assert lru[(False, 0.25)] > lru[(True, 0.25)]
    assert "trace-replay routing" in (tmp_path / "matrix" / "matrix.md").read_text()
