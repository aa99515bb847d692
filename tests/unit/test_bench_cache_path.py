"""tools/bench/bench_cache_path.py runs and reports what it measured: both paths over the same routing, where copies
land at once, see the same hits (the async controller and the sync route decide alike)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench" / "bench_cache_path.py"


def test_the_cache_path_benchmark_reports_both_paths_on_the_same_decisions():
    out = subprocess.run([sys.executable, str(TOOL), "--tokens", "40", "--repeats", "1", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert set(got["us_per_token_median"]) == {"async", "sync"}
    assert all(v > 0 for v in got["us_per_token_median"].values())
    assert 0 < got["hit_rate"]["async"] == got["hit_rate"]["sync"] < 1
    assert got["shape"] == {"n_layer": 24, "n_expert": 32, "n_expert_used": 4, "n_slots": 16}


def test_a_bad_count_is_one_clear_error():
    out = subprocess.run([sys.executable, str(TOOL), "--tokens", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "at least 1" in out.stderr and "Traceback" not in out.stderr
