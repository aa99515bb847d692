#!/usr/bin/env python3
"""Build llama-cpp-python from its PyPI sdist with patches/ applied, cache the wheel.

The wheel is cached under ``$GGMOE_CACHE/engine/<key>/`` where the key hashes
(llama-cpp-python version, every patch file, the CMake flags, and the CPU's
instruction-set flags when building with ``GGML_NATIVE``), so a rebuild happens
only when one of those changes.

Usage:
    python tools/build_engine.py            # build (or reuse) and print the wheel path
    python tools/build_engine.py --install  # ... and pip install it
    GGMOE_CUDA=1 CMAKE_CUDA_ARCHITECTURES=90 python tools/build_engine.py --install

Only the standard library is used: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
VENDOR = "vendor/llama.cpp"
KEY_FILE = "GGMOE_ENGINE_KEY"  # written beside llama_cpp/__init__.py: which build is installed  # where the sdist keeps llama.cpp, relative to its root

# Everything llama-cpp-python's bindings do not need is off: fewer targets, shorter build.
BASE_CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_OPENMP=ON",
]


class BuildError(Exception):
    """A step of the engine build failed; the message says which and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("GGMOE_CACHE", Path.home() / ".cache" / "ggmoe"))


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def cmake_args() -> list[str]:
    args = list(BASE_CMAKE_ARGS)
    if os.environ.get("GGMOE_CUDA", "0") not in ("", "0"):
        archs = os.environ.get("CMAKE_CUDA_ARCHITECTURES", "90")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    native = os.environ.get("GGMOE_NATIVE", "1") not in ("", "0")
    args.append(f"-DGGML_NATIVE={'ON' if native else 'OFF'}")
    return args


def cpu_flags() -> str:
    """The CPU's instruction-set flags: a native build is only valid on the same ISA."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(args: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n".encode())
    h.update(f"python={sys.version_info.major}.{sys.version_info.minor}\n".encode())
    for p in patch_files():
        h.update(p.name.encode() + b"\n" + p.read_bytes())
    h.update(" ".join(args).encode())
    if "-DGGML_NATIVE=ON" in args:
        h.update(cpu_flags().encode())
    return h.hexdigest()[:16]


def run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc


def fetch_sdist() -> Path:
    dest = cache_dir() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    path = dest / name
    if not path.exists():
        print(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist ...", flush=True)
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)],
            "downloading the llama-cpp-python sdist")
    if not path.exists():
        raise BuildError(f"pip download did not produce {path}")
    return path


def apply_patches(src: Path, patches: list[Path] | None = None) -> None:
    """Check, then apply, each patch in file-name order on top of the ones before it.

    A patch may build on an earlier one; a failure names the patch and leaves
    only the throw-away extracted tree half patched.
    """
    for p in patch_files() if patches is None else patches:
        proc = subprocess.run(["git", "apply", "--check", "-p1", f"--directory={VENDOR}", str(p)],
                              cwd=src, text=True, capture_output=True)
        if proc.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to llama.cpp vendored in "
                             f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (after the patches before it):\n"
                             f"{proc.stderr.strip()}")
        run(["git", "apply", "-p1", f"--directory={VENDOR}", str(p)], f"applying {p.name}", cwd=src)
        print(f"applied {p.name}", flush=True)


def build_wheel(out: Path, args: list[str]) -> Path:
    sdist = fetch_sdist()
    with tempfile.TemporaryDirectory(prefix="ggmoe-engine-") as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
        apply_patches(src)
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(args)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        print(f"building llama-cpp-python wheel with CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
        print("(several minutes on 2 cores; the wheel is cached afterwards)", flush=True)
        t0 = time.monotonic()
        staging = Path(tmp) / "wheel"
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(staging), str(src)],
            "building the llama-cpp-python wheel", env=env)
        wheels = list(staging.glob("llama_cpp_python-*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"expected one wheel, found {wheels}")
        out.mkdir(parents=True, exist_ok=True)
        final = out / wheels[0].name
        shutil.move(str(wheels[0]), final)
        (out / "build-info.txt").write_text(
            f"version={LLAMA_CPP_PYTHON_VERSION}\ncmake_args={' '.join(args)}\n"
            f"patches={' '.join(p.name for p in patch_files())}\n"
            f"build_seconds={time.monotonic() - t0:.0f}\n")
        print(f"built in {time.monotonic() - t0:.0f} s", flush=True)
        return final


def installed_key() -> str | None:
    """The build key of the installed llama-cpp-python, if ggmoe installed it."""
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp, pathlib; "
                           "print(pathlib.Path(llama_cpp.__file__).with_name(KEY_FILE).read_text())"
                           .replace("KEY_FILE", repr(KEY_FILE))], text=True, capture_output=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def install(wheel: Path, key: str) -> None:
    if installed_key() == key:
        print(f"engine {key} already installed", flush=True)
        return
    # Force only this package (an unpatched 0.3.36 may be installed), then resolve its dependencies.
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        "installing the engine wheel")
    run([sys.executable, "-m", "pip", "install", "-q", str(wheel)], "installing the engine's dependencies")
    run([sys.executable, "-c", "import llama_cpp, pathlib; "
         f"pathlib.Path(llama_cpp.__file__).with_name({KEY_FILE!r}).write_text({key!r})"],
        "marking the installed engine")
    print(f"installed {wheel.name} (engine {key})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="pip install the wheel into this Python")
    ap.add_argument("--check-patches", action="store_true", help="only check that patches/ applies")
    ap.add_argument("--rebuild", action="store_true", help="ignore the cached wheel")
    opts = ap.parse_args()
    try:
        if opts.check_patches:
            sdist = fetch_sdist()
            with tempfile.TemporaryDirectory(prefix="ggmoe-check-") as tmp:
                with tarfile.open(sdist) as tf:
                    tf.extractall(tmp, filter="data")
                apply_patches(Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}")
            print(f"all {len(patch_files())} patches apply")
            return 0
        args = cmake_args()
        out = cache_dir() / "engine" / build_key(args)
        cached = sorted(out.glob("llama_cpp_python-*.whl"))
        if cached and not opts.rebuild:
            wheel = cached[0]
            print(f"using cached engine wheel {wheel}", flush=True)
        else:
            if opts.rebuild and out.exists():
                shutil.rmtree(out)
            wheel = build_wheel(out, args)
        if opts.install:
            install(wheel, out.name)
        print(wheel)
        return 0
    except BuildError as e:
        print(f"engine build error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
