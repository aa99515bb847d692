"""The GPU harness runs end to end at toy size here (pack, real-shape writer, matrix with both routings)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "gpu"


def lru_hit_rate(ids: np.ndarray, n_slots: int) -> float:
    """Hit rate of an LRU of ``n_slots`` per layer over consecutive rows of ids [T, L, k]."""
    hits = misses = 0
    caches = [OrderedDict() for _ in range(ids.shape[1])]
    for row in ids:
        for cache, sel in zip(caches, row, strict=True):
            for e in set(sel.tolist()):
                if e in cache:
                    hits += 1
                    cache.move_to_end(e)
                else:
                    misses += 1
                    cache[e] = True
                    if len(cache) > n_slots:
                        cache.popitem(last=False)
    return hits / (hits + misses)


def _check_pack(pack: Path) -> None:
    manifest = json.loads((pack / "MANIFEST.json").read_text())
    assert manifest["total_bytes"] < 60 << 20
    assert {"engine-src.tar.gz", "trace.npz"} <= set(manifest["files"])
    # the shared real routing beside the checkout is packed by default: the loan's trace rows replay it
    from tools.gpu import pack as gpu_pack

    assert ("real-routing.npz" in manifest["files"]) == all(d.is_dir() for d in gpu_pack.DEFAULT_REAL_ROUTING)
    assert any(f.startswith("wheels/gguf-") for f in manifest["files"])


def test_gpu_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(TOOLS / "smoke.py"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_pack(tmp_path / "gpu-pack")
    result = json.loads((tmp_path / "matrix" / "matrix.json").read_text())
    cells = result["cells"]
    configs = {(c["routing"] == "random", c["config"]) for c in cells}
    assert {(True, "stock-vram"), (True, "stock-cpu"), (True, "n-cpu-moe"), (True, "lru"), (True, "async"),
            (True, "prefetch"), (True, "prefetch-mlp"), (False, "lru"), (False, "async"), (False, "prefetch"),
            (False, "prefetch-eam"), (False, "prefetch-mlp")} <= configs
    assert {(r, c) for r in (True, False) for c in ("split", "split-async")} <= configs
    assert {(r, "async-prefetch") for r in (True, False)} <= configs
    assert {(r, "async-tinylfu") for r in (True, False)} <= configs
    assert {(r, c) for r in (True, False) for c in ("async-fill", "async-fill-prefetch", "async-fill-tinylfu")} <= configs
    assert {(r, c) for r in (True, False) for c in ("hybrid", "async-fill-host")} <= configs
    assert len(cells) == 2 + 3 * 12 + 3 * 12 + 2 * 2 * 2  # 3 fractions; the split rows at 50 and 25 % only
    # the async rows ran the async decode (trace rows through the forced routing), the lru rows the sync one
    assert all(c["decode_mode"] == "async" for c in cells if c["config"] in (
        "async", "async-prefetch", "split-async", "async-tinylfu", "async-fill", "async-fill-prefetch",
        "async-fill-tinylfu", "async-fill-host"))
    assert all(c["decode_mode"] == "sync" for c in cells if c["config"] in ("lru", "split", "hybrid"))
    # MoEpic's split (θ 1/2 of the toy's 512 neurons): twice the slots in the lru row's VRAM, the bottoms read
    # from host memory, tops found
    by_key = {(c["routing"], c["config"], c["fraction"]): c for c in cells}
    for c in cells:
        if c["config"] in ("split", "split-async"):
            lru = by_key[(c["routing"], "lru", c["fraction"])]
            assert c["theta"] == 0.5 and c["slots"] == 2 * lru["slots"] and c["cache_bytes"] == lru["cache_bytes"]
            assert c["top_hit_rate"] > 0 and c["host_read_bytes_per_token"] > 0, c
    assert "MoEpic's split at θ 256/512" in result["split_note"]
    assert all(c["host_read_bytes_per_token"] > 0 for c in cells if c["config"] == "async" and c["fraction"] < 1)
    assert all(c["decode_tps"] > 0 and c["prefill_tps"] > 0 and c["error"] is None for c in cells)
    # a predictor's rows: their prefetches' outcomes; on the mailbox, how often its reader was behind
    for c in cells:
        if "prefetch" in c["config"]:
            assert c["prefetch_issued"] is not None and c["prefetch_used"] >= 0, c  # (used: of any window)
            on_mailbox = c["decode_mode"] == "async"
            assert (c["reader_targeted"] is not None) is on_mailbox, c
            assert not on_mailbox or 0 <= c["reader_behind"] <= c["reader_targeted"], c
        else:
            assert c["prefetch_issued"] is None, c
    # trace-replay rows say so; every cell has the simulator's estimate beside it; the goals are checked
    trace_rows = [c for c in cells if c["routing"] != "random"]
    assert all("benchmark only" in c["routing"] and c["override_us"] > 0 for c in trace_rows)
    # the random-weight mlp's predictions are not modelled: no estimate for that row
    assert all(c["tpot_sim_ms"] > 0 for c in cells if c["config"] != "prefetch-mlp")
    assert all(c["tpot_sim_ms"] is None for c in cells if c["config"] == "prefetch-mlp")
    assert result["calibration"]["copy_bytes_per_s"] > 0 and "[copy]" in result["profile_toml"]
    assert {g["routing"] for g in result["goals"]} == {"random", "trace", "both"}
    md = (tmp_path / "matrix" / "matrix.md").read_text()
    assert "trace-replay routing" in md and "| goal |" in md
    # the replay follows the trace: LRU hit rates as over the held-out trace's consecutive rows
    from ggmoe.inspect import inspect_model
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.trace import load_trace
    from tools.gpu.trace_routing import split_tiled

    facts = inspect_model(tmp_path / "toy.gguf")
    _, held = split_tiled(tmp_path / "gpu-pack" / "trace.npz", tuple(facts.moe_layers), facts.n_expert,
                          facts.n_expert_used, model_fingerprint(tmp_path / "toy.gguf"), tmp_path / "tiled")
    ids = load_trace(held, hidden=False).ids
    for c in trace_rows:
        if c["config"] == "lru":
            assert abs(c["hit_rate"] - lru_hit_rate(ids, c["slots"])) < 0.1, c
    times = json.loads((tmp_path / "smoke.json").read_text())["seconds"]
    assert set(times) == {"pack", "model", "modes", "matrix"}
    # every decode mode's greedy tokens equal stock's on the deferred copy stream (the GPU's semantics)
    modes = json.loads((tmp_path / "modes.json").read_text())["modes"]
    assert set(modes) == {"sync", "async", "host", "prefetch", "async-prefetch", "split", "split-async"}
    assert modes["async-prefetch"]["decode_mode"] == "async"  # the predictor reads the mailbox, no sync
    assert all(m["ok"] and m["copy_stream"] == "deferred" for m in modes.values()), modes
    assert modes["async"]["hits"] > 0
