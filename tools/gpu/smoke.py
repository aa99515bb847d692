#!/usr/bin/env python3
"""The GPU harness end to end at toy size, on any machine: pack, a real-shape toy model, the matrix.

The same steps a GPU machine runs (docs/benchmarks.md, "GPU harness"), minus the CUDA build: it uses the
engine installed here. Fails (exit 1) if a step fails or the matrix has a cell that could not run.

    python tools/gpu/smoke.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def step(*cmd: str) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run([sys.executable, *cmd], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="ggmoe-gpu-smoke-"))
    pack = out / "gpu-pack"
    step(str(HERE / "pack.py"), "--out", str(pack), "--trace-docs", "6")
    step(str(HERE / "realshape.py"), "--preset", "toy", "-o", str(out / "toy.gguf"))
    step(str(HERE / "matrix.py"), "--model", str(out / "toy.gguf"), "--trace", str(pack / "trace.npz"),
         "--out", str(out / "matrix"), "--runs", "2", "--decode-tokens", "16", "--prefill-tokens", "64",
         "--n-ctx", "256", "--fractions", "0.25,0.5")
    result = json.loads((out / "matrix" / "matrix.json").read_text())
    bad = [c for c in result["cells"] if c["error"]]
    if bad:
        print(f"error: {len(bad)} cells failed, e.g. {bad[0]['config']}: {bad[0]['error']}", file=sys.stderr)
        return 1
    print(f"gpu-smoke: {len(result['cells'])} cells in {out / 'matrix'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
