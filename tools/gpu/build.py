#!/usr/bin/env python3
"""Build (on the GPU machine) the patched engine with CUDA from gpu-pack/, and install it with ggmoe.

Everything goes under one prefix (default /tmp/ggmoe-gpu) that later calls on the same warm machine
reuse: the source, the wheel, and site/ with the engine and the packed wheels; ggmoe itself is used from
the working tree (PYTHONPATH). A build that cannot finish inside one 10-minute command runs detached:

    python3 tools/gpu/build.py --detach     # starts it in its own session (setsid), returns at once
    python3 tools/gpu/build.py --status     # later calls: running (progress) / failed (log tail) / ready
    python3 tools/gpu/build.py --wait 540   # polls until ready, failed, or 540 s have passed
    . /tmp/ggmoe-gpu/env.sh                 # then: PYTHONPATH with the engine and the working tree's ggmoe

The build: ``pip wheel --no-build-isolation --no-index`` of the packed source with CMAKE_ARGS from
gpu-pack/MANIFEST.json (``-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90`` ...) and
CMAKE_BUILD_PARALLEL_LEVEL = every core, then a check that the installed engine has ggmoe's patched C API
and (CUDA) sees a GPU. ``--cpu`` builds the same way without CUDA (to check the procedure on a machine
without a GPU). The build is keyed by the manifest: a new pack builds again.

Exit status of --status and --wait: 0 ready, 1 stale (built from another pack), 2 failed, 3 running,
4 never started.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "gpu-pack"
DEFAULT_PREFIX = Path(os.environ.get("GGMOE_GPU_PREFIX", "/tmp/ggmoe-gpu"))
READY, STALE, FAILED, RUNNING, NEVER = 0, 1, 2, 3, 4
_PROGRESS = re.compile(r"\[(\d+)/(\d+)\]")  # ninja's "[done/total]"

# Checks the installed engine from a fresh interpreter: the patched C API, and the GPU ggml sees.
_CHECK = ("import json; from ggmoe.engine import patch; patch.symbols(); "
          "from ggmoe.engine.loader import gpu_device_name; import llama_cpp; "
          "print(json.dumps({'gpu': gpu_device_name(), 'llama_cpp': llama_cpp.__file__}))")


class BuildFailed(Exception):
    pass


@dataclass(frozen=True)
class CudaLibs:
    """What CMake is told about cuBLAS and the driver library, and where the engine finds cuBLAS at run time."""

    args: tuple[str, ...]  # extra CMake flags
    lib_dirs: tuple[Path, ...]  # for LD_LIBRARY_PATH (a folder of links to cuBLAS alone)
    notes: tuple[str, ...]  # what was found where


TOOLKIT_LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib")
DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
               "/lib/x86_64-linux-gnu")
CUBLAS_HEADERS = ("cublas.h", "cublas_v2.h", "cublas_api.h", "cublasLt.h", "cublasXt.h")


def toolkit_root() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or where nvcc is (a wrapper script on PATH
    does not count): the first folder with include/cuda_runtime.h."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  str(Path(nvcc).resolve().parent.parent) if nvcc else None]
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime.h").exists():
            return Path(c).resolve()
    return None


def _first(dirs: list[Path], names: tuple[str, ...]) -> Path | None:
    for d in dirs:
        for n in names:
            if (d / n).exists():
                return d / n
    return None


def _ldconfig(name: str) -> Path | None:
    """A library the dynamic linker's cache knows, e.g. libcuda.so.1 (the driver's, outside the toolkit)."""
    if shutil.which("ldconfig") is None:
        return None
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(name + " ") and "x86-64" in line:
            return Path(line.rsplit("=>", 1)[1].strip())
    return None


def find_cuda_libs(dest: Path, sites: list[Path], root: Path | None = None,
                   driver_dirs: tuple[str, ...] = DRIVER_DIRS, ldconfig: bool = True) -> CudaLibs:
    """cuBLAS from the CUDA toolkit, else from a pip ``nvidia`` package (PyTorch's: ``nvidia/cu13``): a trimmed
    toolkit (nvcc and cudart alone) has none, and CMake's FindCUDAToolkit then fails. Links to the pip copy's
    headers and libraries alone go under ``dest`` (its other headers and libraries may be another CUDA's).
    The driver library (for ggml's VMM pool) from the toolkit's stubs or the driver's folders; without one,
    ``GGML_CUDA_NO_VMM=ON`` (ggml's legacy pool: no other difference)."""
    root = root or toolkit_root()
    if root is None:
        raise BuildFailed("no CUDA toolkit (include/cuda_runtime.h) at $CUDA_HOME, $CUDA_PATH, /usr/local/cuda "
                          "or beside nvcc")
    tk_libs = [root / d for d in TOOLKIT_LIB_DIRS]
    tk_inc = [root / "include", root / "targets/x86_64-linux/include"]
    args: list[str] = []
    lib_dirs: list[Path] = []
    notes = [f"CUDA toolkit {root}"]
    if _first(tk_inc, ("cublas_v2.h",)) and _first(tk_libs, ("libcublas.so",)):
        notes.append("cuBLAS: the toolkit's")
    else:
        found = None
        for site_dir in sites:
            for header in sorted(site_dir.glob("nvidia/*/include/cublas_v2.h")):
                lib = header.parent.parent / "lib"
                blas = sorted(p for p in lib.glob("libcublas.so*") if "Lt" not in p.name)
                blas_lt = sorted(lib.glob("libcublasLt.so*"))
                if blas and blas_lt:
                    found = (header.parent, blas[-1], blas_lt[-1])
                    break
            if found:
                break
        if found is None:
            raise BuildFailed(f"no cuBLAS: neither in the CUDA toolkit at {root} nor in a pip nvidia package "
                              f"under {', '.join(map(str, sites)) or '(no site folders)'}")
        inc, blas, blas_lt = found
        (dest / "include").mkdir(parents=True, exist_ok=True)
        (dest / "lib").mkdir(parents=True, exist_ok=True)
        for h in CUBLAS_HEADERS:
            if (inc / h).exists():
                _link(inc / h, dest / "include" / h)
        for lib in (blas, blas_lt):
            _link(lib, dest / "lib" / lib.name)  # the soname the engine will ask for (libcublas.so.13)
            _link(lib, dest / "lib" / lib.name.split(".so")[0].__add__(".so"))  # what the linker looks for
        args += [f"-DCUDA_cublas_LIBRARY={dest / 'lib' / 'libcublas.so'}",
                 f"-DCUDA_cublasLt_LIBRARY={dest / 'lib' / 'libcublasLt.so'}",
                 f"-DCMAKE_CUDA_FLAGS=-I{dest / 'include'}", f"-DCMAKE_CXX_FLAGS=-I{dest / 'include'}"]
        lib_dirs.append(dest / "lib")
        notes.append(f"cuBLAS: {blas} (pip), headers {inc}")
    driver = _first([root / d / "stubs" for d in TOOLKIT_LIB_DIRS] + [Path(d) for d in driver_dirs],
                    ("libcuda.so", "libcuda.so.1")) or (_ldconfig("libcuda.so.1") if ldconfig else None)
    if driver is not None:
        args.append(f"-DCUDA_cuda_driver_LIBRARY={driver}")
        notes.append(f"driver library: {driver}")
    else:
        args.append("-DGGML_CUDA_NO_VMM=ON")
        notes.append("no driver library to link: GGML_CUDA_NO_VMM=ON")
    return CudaLibs(tuple(args), tuple(lib_dirs), tuple(notes))


def _link(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    dst.symlink_to(src)


def python_sites() -> list[Path]:
    """This interpreter's site folders (PyTorch's nvidia packages live there on the GPU machine)."""
    dirs = [Path(p) for p in [*site.getsitepackages(), site.getusersitepackages(), *sys.path] if p]
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d not in seen:
            seen.append(d)
    return seen


def manifest(pack: Path) -> dict:
    path = pack / "MANIFEST.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: run tools/gpu/pack.py on the CPU machine and carry gpu-pack")
    return json.loads(path.read_text())


def key(m: dict, cpu: bool) -> str:
    """What a build is of: the engine, the patches, CUDA or not, and the Python its wheels are for."""
    return f"{m['llama_cpp_python']}-{m['patch_sha256']}-{'cpu' if cpu else 'cuda'}-py{m.get('python', '3.12')}"


def cmake_args(m: dict, cpu: bool) -> list[str]:
    """The manifest's CMake flags; without CUDA's for --cpu."""
    return [a for a in m["cmake_args"] if not (cpu and "CUDA" in a)]


def env_sh(site_dir: Path, lib_dirs: tuple[Path, ...] = ()) -> str:
    """PYTHONPATH: the engine and wheels, then the working tree the command runs in (its ggmoe and tools);
    LD_LIBRARY_PATH: cuBLAS when it came from a pip package."""
    out = f'export PYTHONPATH={site_dir}:"${{GGMOE_ROOT:-$PWD}}"${{PYTHONPATH:+:$PYTHONPATH}}\n'
    if lib_dirs:
        out += f"export LD_LIBRARY_PATH={':'.join(map(str, lib_dirs))}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n"
    return out


def sh(cmd: list[str], log, env: dict | None = None, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if rc != 0:
        raise BuildFailed(f"{' '.join(cmd[:4])} ... exited {rc}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build(pack: Path, prefix: Path, cpu: bool, jobs: int, cuda_sites: list[Path]) -> None:
    m = manifest(pack)
    prefix.mkdir(parents=True, exist_ok=True)
    done, failed, running = prefix / "DONE", prefix / "FAILED", prefix / "RUNNING"
    for f in (done, failed):
        f.unlink(missing_ok=True)
    running.write_text(str(os.getpid()))
    t0 = time.monotonic()
    with open(prefix / "build.log", "w") as log:
        try:
            site_dir = prefix / "site"
            shutil.rmtree(site_dir, ignore_errors=True)
            py = [sys.executable, "-m", "pip"]
            pip_quiet = ["--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--disable-pip-version-check"]
            sh([*py, "install", "-q", *pip_quiet, "--target", str(site_dir),
                *map(str, sorted((pack / "wheels").glob("*.whl")))], log)
            src = extract(pack, prefix)
            args = cmake_args(m, cpu)
            cuda = CudaLibs((), (), ())
            if not cpu:
                cuda = find_cuda_libs(prefix / "cuda", [*cuda_sites, *python_sites()])
                args += cuda.args
                log.write("".join(f"{n}\n" for n in cuda.notes))
            env = {**os.environ, "CMAKE_ARGS": " ".join(args), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
            log.write(f"CMAKE_ARGS={env['CMAKE_ARGS']}\nCMAKE_BUILD_PARALLEL_LEVEL={jobs}\n")
            wheel_dir = prefix / "wheel"
            shutil.rmtree(wheel_dir, ignore_errors=True)
            # -v: ninja's [done/total] lines reach the log, so --status can show progress
            sh([*py, "wheel", "-v", "--no-build-isolation", "--no-index", "--no-deps", "--no-cache-dir",
                "--disable-pip-version-check", "-w", str(wheel_dir), str(src)], log, env=env)
            t_build = time.monotonic() - t0
            sh([*py, "install", "-q", *pip_quiet, "--target", str(site_dir), *map(str, wheel_dir.glob("*.whl"))],
               log)
            (prefix / "env.sh").write_text(env_sh(site_dir, cuda.lib_dirs))
            ld = ":".join([*map(str, cuda.lib_dirs), os.environ.get("LD_LIBRARY_PATH", "")]).strip(":")
            check = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": f"{site_dir}:{ROOT}", "LD_LIBRARY_PATH": ld})
            if check.returncode != 0:
                raise BuildFailed(f"the installed engine does not load: {check.stderr.strip()[-2000:]}")
            info = json.loads(check.stdout.strip().splitlines()[-1])
            if not cpu and info["gpu"] is None:
                log.write("warning: the CUDA build sees no GPU here\n")
            secs = time.monotonic() - t0
            done.write_text(json.dumps({"key": key(m, cpu), "seconds": round(secs), "build_seconds": round(t_build),
                                        "jobs": jobs, "cmake_args": args, "cuda": list(cuda.notes), **info}))
            log.write(f"built in {secs:.0f} s (the wheel in {t_build:.0f} s)\n")
        except Exception as e:  # noqa: BLE001 - the marker and the log say what failed
            failed.write_text(f"{type(e).__name__}: {e}\n")
            log.write(f"FAILED: {e}\n")
            raise SystemExit(f"error: the build failed ({e}); see {prefix / 'build.log'}") from None
        finally:
            running.unlink(missing_ok=True)


def extract(pack: Path, prefix: Path) -> Path:
    """The packed source, fresh under prefix/src; returns its root."""
    src_root = prefix / "src"
    shutil.rmtree(src_root, ignore_errors=True)
    with tarfile.open(pack / "engine-src.tar.gz") as tf:
        tf.extractall(src_root, filter="data")
    return next(src_root.iterdir())


def configure(pack: Path, prefix: Path, cpu: bool, cuda_sites: list[Path]) -> int:
    """CMake's configure step alone on the packed source (seconds): the toolkit, cuBLAS and the flags are
    right. Leaves the build folder (Ninja) at prefix/configure for a look or a partial build."""
    m = manifest(pack)
    prefix.mkdir(parents=True, exist_ok=True)
    src = extract(pack, prefix)
    args = cmake_args(m, cpu)
    if not cpu:
        try:
            cuda = find_cuda_libs(prefix / "cuda", [*cuda_sites, *python_sites()])
        except BuildFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return FAILED
        args += cuda.args
        print("\n".join(cuda.notes))
    out = prefix / "configure"
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *args],
                       capture_output=True, text=True)
    print(f"cmake {' '.join(args)}: exit {r.returncode}")
    if r.returncode != 0:
        print("\n".join((r.stdout + r.stderr).splitlines()[-30:]), file=sys.stderr)
        return FAILED
    return READY


def _progress(log: Path) -> str:
    """The last ninja progress in the log, e.g. '[212/348]', or ''."""
    if not log.is_file():
        return ""
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - (2 << 20)))
        hits = _PROGRESS.findall(f.read().decode(errors="replace"))
    return f"[{hits[-1][0]}/{hits[-1][1]}]" if hits else ""


def _tail(log: Path, lines: int = 12, width: int = 240) -> str:
    """The log's last lines, each cut to ``width`` characters (compiler lines are long)."""
    if not log.is_file():
        return "(no log)"
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - (256 << 10)))
        text = f.read().decode(errors="replace")
    return "\n".join(line[:width] for line in text.splitlines()[-lines:])


def state(pack: Path, prefix: Path, cpu: bool) -> tuple[int, str]:
    done, failed, running, log = prefix / "DONE", prefix / "FAILED", prefix / "RUNNING", prefix / "build.log"
    tail = _tail(log)
    if running.is_file() and _pid_alive(int(running.read_text() or 0)):
        secs = time.time() - running.stat().st_mtime
        return RUNNING, f"running for {secs:.0f} s {_progress(log)}\n{tail}"
    if done.is_file():
        info = json.loads(done.read_text())
        if info["key"] == key(manifest(pack), cpu):
            return READY, (f"ready: built in {info['seconds']} s with {info['jobs']} jobs (GPU: {info['gpu']}); "
                           f". {prefix / 'env.sh'}")
        return STALE, f"stale: built for {info['key']}, the pack is {key(manifest(pack), cpu)}: build again"
    if failed.is_file():
        return FAILED, f"failed: {failed.read_text().strip()}\n{tail}"
    if running.is_file():
        return FAILED, f"failed: the build process {running.read_text()} is gone without a result\n{tail}"
    return NEVER, "never started"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    ap.add_argument("--pack", type=Path, default=PACK)
    ap.add_argument("--cpu", action="store_true", help="build without CUDA (checks the procedure)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--detach", action="store_true", help="start the build in its own session and return")
    g.add_argument("--status", action="store_true", help="say whether the build is running, failed or ready")
    g.add_argument("--wait", type=float, metavar="S", help="poll until the build ends or S seconds have passed")
    g.add_argument("--configure-only", action="store_true", help="run CMake's configure step alone (seconds)")
    g.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the detached build itself
    ap.add_argument("--cuda-site", type=Path, action="append", default=[],
                    help="a folder with pip nvidia packages (nvidia/*/include/cublas_v2.h) to take cuBLAS from, "
                         "before this Python's site folders")
    a = ap.parse_args(argv)
    pack, prefix = a.pack.resolve(), a.prefix.resolve()
    if a.configure_only:
        return configure(pack, prefix, a.cpu, a.cuda_site)
    if a.status or a.wait is not None:
        end = time.monotonic() + (a.wait or 0)
        code, msg = state(pack, prefix, a.cpu)
        while code == RUNNING and time.monotonic() < end:
            time.sleep(min(10.0, max(0.1, end - time.monotonic())))
            code, msg = state(pack, prefix, a.cpu)
        print(msg)
        return code
    code, msg = state(pack, prefix, a.cpu)
    if code in (READY, RUNNING) and not a.child:
        print(msg)
        return 0
    if a.detach:
        prefix.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--prefix", str(prefix), "--pack", str(pack),
               "--jobs", str(a.jobs), "--child", *(["--cpu"] if a.cpu else []),
               *[x for d in a.cuda_site for x in ("--cuda-site", str(d))]]
        with open(prefix / "detached.log", "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=ROOT)
        (prefix / "RUNNING").write_text(str(proc.pid))  # at once: a --status right after sees it running
        print(f"started (pid {proc.pid}); poll with: python3 tools/gpu/build.py --status{' --cpu' if a.cpu else ''}")
        return 0
    build(pack, prefix, a.cpu, a.jobs, a.cuda_site)
    code, msg = state(pack, prefix, a.cpu)
    print(msg)
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--status | head` ends quietly
    raise SystemExit(main())
