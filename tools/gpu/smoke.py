#!/usr/bin/env python3
"""The GPU harness end to end at toy size, on any machine: pack, a real-shape toy model, the matrix.

The same steps a GPU machine runs (docs/benchmarks.md, "GPU harness"). By default the matrix runs on the
engine installed here (`make gpu-smoke`, CI: seconds); ``--build`` runs the GPU machine's own pipeline
(tools/gpu/pipeline.py --cpu: the engine built from the pack into OUT/prefix, minutes, then the toy model
and both routings on that build, with PYTHONPATH as the GPU machine has it). Fails (exit 1) if a step fails, a cell could not run, or the table is missing.

    python tools/gpu/smoke.py [--out DIR] [--build]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def step(*cmd: str) -> float:
    """Run one step with this interpreter; returns its seconds. The CPU build's copies land as a GPU's do
    (GGMOE_COPY_STREAM=deferred, unless the caller chose a stream): the dry run proves the GPU's path."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    env = {**os.environ, "GGMOE_COPY_STREAM": os.environ.get("GGMOE_COPY_STREAM", "deferred")}
    subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT, env=env)
    secs = time.monotonic() - t0
    print(f"  ({secs:.0f} s)", flush=True)
    return secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--build", action="store_true", help="also build the engine from the pack (--cpu) and use it")
    a = ap.parse_args(argv)
    out = (a.out or Path(tempfile.mkdtemp(prefix="ggmoe-gpu-smoke-"))).resolve()
    pack = out / "gpu-pack"
    # --build installs the pack's wheels here: for this Python (the GPU machine's is 3.12)
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    times = {"pack": step(str(HERE / "pack.py"), "--out", str(pack), "--trace-docs", "6", "--python-version", pyver)}
    # one thread: the toy's matmuls are tiny, and spare threads only spin on a busy machine
    matrix_args = ["--runs", "2", "--decode-tokens", "16", "--prefill-tokens", "64", "--n-ctx", "256", "--fractions",
                   "0.5,0.25,1.0", "--threads", "1"]
    if a.build:  # the GPU machine's pipeline, on the CPU: build from the pack, the toy model, both routings
        common = ["--cpu", "--pack", str(pack), "--prefix", str(out / "prefix"), "--results", str(out / "results")]
        step(str(HERE / "pipeline.py"), "--detach", *common, "--models", "toy", "--model-dir", str(out),
             "--matrix-args", " ".join(matrix_args))
        t0 = time.monotonic()
        subprocess.run([sys.executable, str(HERE / "pipeline.py"), "--wait", "3000", *common, "--out",
                        str(out / "OUT")], check=True, cwd=ROOT)
        times["pipeline"] = time.monotonic() - t0
        steps = json.loads((out / "results" / "steps.json").read_text())
        times.update({name: s["seconds"] for name, s in steps.items()})
        (out / "matrix").mkdir(exist_ok=True)
        shutil.copy(out / "OUT" / "toy.json", out / "matrix" / "matrix.json")
        shutil.copy(out / "OUT" / "toy.md", out / "matrix" / "matrix.md")
    else:
        times["model"] = step(str(HERE / "realshape.py"), "--preset", "toy", "-o", str(out / "toy.gguf"))
        times["modes"] = step(str(HERE / "modes.py"), "--model", str(out / "toy.gguf"), "--out", str(out), "--cpu",
                              "--tokens", "12")
        times["matrix"] = step(str(HERE / "matrix.py"), "--model", str(out / "toy.gguf"), "--trace",
                               str(pack / "trace.npz"), "--out", str(out / "matrix"), *matrix_args)
    result = json.loads((out / "matrix" / "matrix.json").read_text())
    bad = [c for c in result["cells"] if c["error"]]
    if bad:
        print(f"error: {len(bad)} cells failed, e.g. {bad[0]['config']}: {bad[0]['error']}", file=sys.stderr)
        return 1
    if not (out / "matrix" / "matrix.md").is_file():
        print("error: the matrix wrote no table", file=sys.stderr)
        return 1
    if a.build and not result["machine"]["engine"].startswith(str(out / "prefix")):
        print(f"error: the matrix ran on {result['machine']['engine']}, not the build", file=sys.stderr)
        return 1
    (out / "smoke.json").write_text(json.dumps({"seconds": times}, indent=2))
    print(f"gpu-smoke: {len(result['cells'])} cells in {out / 'matrix'}; seconds: "
          + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
