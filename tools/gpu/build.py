#!/usr/bin/env python3
"""Build (on the GPU machine) the patched engine with CUDA from gpu-pack/, and install it with ggmoe.

Everything goes under one prefix (default /tmp/ggmoe-gpu) that later calls on the same warm machine
reuse: the source, the wheel, and site/ with the engine and the packed wheels; ggmoe itself is used from
the working tree (PYTHONPATH). A build that cannot finish inside one 10-minute command runs detached:

    python3 tools/gpu/build.py --detach     # starts it (setsid), returns at once
    python3 tools/gpu/build.py --status     # later calls: running / failed (log tail) / ready
    . /tmp/ggmoe-gpu/env.sh                 # then: PYTHONPATH with the engine and ggmoe

``--cpu`` builds the same way without CUDA (to check the procedure on a machine without a GPU).
The build is keyed by gpu-pack/MANIFEST.json: a new pack rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "gpu-pack"
DEFAULT_PREFIX = Path(os.environ.get("GGMOE_GPU_PREFIX", "/tmp/ggmoe-gpu"))


def manifest() -> dict:
    path = PACK / "MANIFEST.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: run tools/gpu/pack.py on the CPU machine and carry gpu-pack")
    return json.loads(path.read_text())


def key(m: dict, cpu: bool) -> str:
    return f"{m['llama_cpp_python']}-{m['patch_sha256']}-{'cpu' if cpu else 'cuda'}"


def sh(cmd: list[str], log, env: dict | None = None, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} ... exited {rc}")


def build(prefix: Path, cpu: bool, jobs: int) -> None:
    m = manifest()
    prefix.mkdir(parents=True, exist_ok=True)
    done, failed = prefix / "DONE", prefix / "FAILED"
    for f in (done, failed):
        f.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(prefix / "build.log", "w") as log:
        try:
            site = prefix / "site"
            if site.exists():
                shutil.rmtree(site)
            py = [sys.executable, "-m", "pip"]
            sh([*py, "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site),
                *map(str, sorted((PACK / "wheels").glob("*.whl")))], log)
            src_root = prefix / "src"
            if src_root.exists():
                shutil.rmtree(src_root)
            with tarfile.open(PACK / "engine-src.tar.gz") as tf:
                tf.extractall(src_root, filter="data")
            src = next(src_root.iterdir())
            args = [a for a in m["cmake_args"] if not (cpu and ("CUDA" in a))]
            env = {**os.environ, "CMAKE_ARGS": " ".join(args), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
            log.write(f"CMAKE_ARGS={env['CMAKE_ARGS']}\n")
            wheel_dir = prefix / "wheel"
            if wheel_dir.exists():
                shutil.rmtree(wheel_dir)
            sh([*py, "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(wheel_dir), str(src)],
               log, env=env)
            sh([*py, "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site),
                *map(str, wheel_dir.glob("*.whl"))], log)
            (prefix / "env.sh").write_text(f"export PYTHONPATH={site}:{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}\n")
            secs = time.monotonic() - t0
            done.write_text(json.dumps({"key": key(m, cpu), "seconds": round(secs), "jobs": jobs,
                                        "cmake_args": args}))
            log.write(f"built in {secs:.0f} s\n")
        except Exception as e:  # noqa: BLE001 - the marker and the log say what failed
            failed.write_text(f"{type(e).__name__}: {e}\n")
            log.write(f"FAILED: {e}\n")
            raise SystemExit(f"error: the build failed ({e}); see {prefix / 'build.log'}") from None


def status(prefix: Path, cpu: bool) -> int:
    done, failed, log = prefix / "DONE", prefix / "FAILED", prefix / "build.log"
    if done.is_file():
        info = json.loads(done.read_text())
        if info["key"] == key(manifest(), cpu):
            print(f"ready: built in {info['seconds']} s with {info['jobs']} jobs; . {prefix / 'env.sh'}")
            return 0
        print(f"stale: built for {info['key']}, the pack is {key(manifest(), cpu)}: build again")
        return 1
    tail = "\n".join(log.read_text().splitlines()[-15:]) if log.is_file() else "(no log)"
    if failed.is_file():
        print(f"failed: {failed.read_text().strip()}\n{tail}")
        return 2
    print(f"running (or never started):\n{tail}")
    return 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    ap.add_argument("--cpu", action="store_true", help="build without CUDA (checks the procedure)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--detach", action="store_true", help="start the build in its own session and return")
    g.add_argument("--status", action="store_true", help="say whether the build is running, failed or ready")
    a = ap.parse_args(argv)
    if a.status:
        return status(a.prefix, a.cpu)
    if status(a.prefix, a.cpu) == 0:
        return 0
    if a.detach:
        a.prefix.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--prefix", str(a.prefix), "--jobs", str(a.jobs), *(["--cpu"] if a.cpu else [])]
        with open(a.prefix / "detached.log", "w") as out:
            subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"started; poll with: python3 tools/gpu/build.py --status{' --cpu' if a.cpu else ''}")
        return 0
    build(a.prefix, a.cpu, a.jobs)
    return status(a.prefix, a.cpu)


if __name__ == "__main__":
    raise SystemExit(main())
