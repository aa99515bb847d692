"""The engine build: llama-cpp-python from its PyPI sdist with ggmoe's patch series applied, the wheel cached.

The wheel is cached under ``$GGMOE_CACHE/engine/<key>/`` where the key hashes
(llama-cpp-python version, every patch file, the CMake flags, and the CPU's
instruction-set flags when building with ``GGML_NATIVE``), so a rebuild happens
only when one of those changes. ``CMAKE_ARGS`` from the environment is added
after ggmoe's flags (so it wins), as llama-cpp-python's own install honours it.

The patch series is found beside the package in a clone (``patches/``) or, in an
installed package, in the copy the wheel build puts in ``ggmoe/_patches/``
(setup.py). ``ggmoe engine build`` / ``ggmoe engine status`` are the commands;
``tools/build_engine.py`` (``make engine``) runs this file before ggmoe is installed (it imports no other
module of ggmoe then: ``ggmoe/engine/__init__.py`` is lazy, and the file runs on its own).

Usage:
    ggmoe engine build --install            # build (or reuse) the wheel and pip install it
    ggmoe engine build --cuda --install     # with -DGGML_CUDA=ON (CMAKE_CUDA_ARCHITECTURES, default 90)
    python tools/build_engine.py --install  # the same from a clone, nothing installed yet

Only the standard library is used: this runs before anything is installed, and
it never imports llama_cpp in this process (it is about to be replaced).
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
VENDOR = "vendor/llama.cpp"  # where the sdist keeps llama.cpp, relative to its root
KEY_FILE = "GGMOE_ENGINE_KEY"  # written beside llama_cpp/__init__.py: which build is installed
INFO_FILE = "GGMOE_ENGINE_INFO"  # beside it too: version, patches, CMake flags of the installed build
COMMAND = "ggmoe engine build --install"  # what every "engine not patched" message names


def find_patch_dir() -> Path:
    """The patch series: a clone's ``patches/`` beside the package, else the copy packaged in the wheel."""
    package = Path(__file__).resolve().parents[1]  # ggmoe/ (this file is ggmoe/base/engine_build.py)
    clone = package.parent / "patches"
    if (clone / "README.md").is_file() and any(clone.glob("*.patch")):
        return clone
    return package / "_patches"


PATCH_DIR = find_patch_dir()

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


if __package__ == "ggmoe.base":  # in the package (``ggmoe engine build``): one of ggmoe's own errors
    from ggmoe.base.errors import EngineError as _BuildFailure
else:  # run as a file (tools/build_engine.py, before ggmoe is installed): the standard library only
    _BuildFailure = Exception  # type: ignore[misc,assignment]


class BuildError(_BuildFailure):
    """A step of the engine build failed; the message says which and why. In the package it is an
    ``EngineError``, which the CLI's edge prints (it is never raised again under another name)."""


def cache_dir() -> Path:
    return Path(os.environ.get("GGMOE_CACHE", Path.home() / ".cache" / "ggmoe"))


def patch_files() -> list[Path]:
    files = sorted(PATCH_DIR.glob("*.patch"))
    if not files:
        raise BuildError(f"no patch series found (looked in {PATCH_DIR}): reinstall ggmoe from a clone or "
                         "a wheel built from one")
    return files


def cmake_args(cuda: bool | None = None) -> list[str]:
    """ggmoe's CMake flags, then the environment's ``CMAKE_ARGS`` (later flags win in CMake)."""
    args = list(BASE_CMAKE_ARGS)
    if cuda is None:
        cuda = os.environ.get("GGMOE_CUDA", "0") not in ("", "0")
    if cuda:
        archs = os.environ.get("CMAKE_CUDA_ARCHITECTURES", "90")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    native = os.environ.get("GGMOE_NATIVE", "1") not in ("", "0")
    args.append(f"-DGGML_NATIVE={'ON' if native else 'OFF'}")
    if native and not amx_opted_in():
        args += no_amx_flags()
    args += os.environ.get("CMAKE_ARGS", "").split()
    return args


# ggml-cpu's AMX kernels (ggml-cpu/amx/, compiled in when the compiler defines __AMX_INT8__) crash in
# ggml_backend_amx_mul_mat on Sapphire Rapids and later (llama.cpp #20824, closed without a fix;
# stanfordnlp/dspy #10079). -march=native defines it on such a CPU, so a native build leaves AMX out
# unless GGMOE_AMX=1. An explicit -mno-amx-* wins over -march=native whatever their order (GCC, Clang).


def amx_opted_in() -> bool:
    return os.environ.get("GGMOE_AMX", "0") not in ("", "0")


def no_amx_flags() -> list[str]:
    """C and C++ flags that keep ggml's AMX kernels out of a native x86 build; none elsewhere.

    One flag per define (CMAKE_ARGS is split on whitespace), the int8 one: ggml's AMX backend and
    ``ggml_cpu_has_amx_int8`` are compiled only under ``__AMX_INT8__``."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return []
    cc = os.environ.get("CC", "cc")
    try:
        ok = subprocess.run([cc, "-mno-amx-int8", "-E", "-x", "c", os.devnull], capture_output=True,
                            timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False  # no compiler to ask: the build reports that itself
    return ["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"] if ok else []


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
    if "-DGGML_NATIVE=ON" in args and "-DGGML_NATIVE=OFF" not in args:
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
    info = (wheel.parent / "build-info.txt").read_text() if (wheel.parent / "build-info.txt").is_file() else ""
    # Force only this package (an unpatched 0.3.36 may be installed), then resolve its dependencies.
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        "installing the engine wheel")
    run([sys.executable, "-m", "pip", "install", "-q", str(wheel)], "installing the engine's dependencies")
    run([sys.executable, "-c", "import llama_cpp, pathlib; "
         f"p = pathlib.Path(llama_cpp.__file__); p.with_name({KEY_FILE!r}).write_text({key!r}); "
         f"p.with_name({INFO_FILE!r}).write_text({info!r})"],
        "marking the installed engine")
    print(f"installed {wheel.name} (engine {key})", flush=True)


def build(install_it: bool = False, cuda: bool | None = None, rebuild: bool = False) -> Path:
    """Build (or reuse the cached) patched wheel; pip install it into this Python when asked."""
    args = cmake_args(cuda)
    out = cache_dir() / "engine" / build_key(args)
    cached = sorted(out.glob("llama_cpp_python-*.whl"))
    if cached and not rebuild:
        wheel = cached[0]
        print(f"using cached engine wheel {wheel}", flush=True)
    else:
        if rebuild and out.exists():
            shutil.rmtree(out)
        wheel = build_wheel(out, args)
    if install_it:
        install(wheel, out.name)
    return wheel


def check_patches() -> int:
    """Apply the series to a throw-away copy of the sdist; the number of patches."""
    sdist = fetch_sdist()
    with tempfile.TemporaryDirectory(prefix="ggmoe-check-") as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        apply_patches(Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}")
    return len(patch_files())


_STATUS_SCRIPT = """
import json, pathlib, sys
out = {"installed": False}
try:
    import llama_cpp
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out)); sys.exit(0)
p = pathlib.Path(llama_cpp.__file__)
out.update(installed=True, version=llama_cpp.__version__, path=str(p.parent))
for name, f in (("key", KEY), ("build_info", INFO)):
    q = p.with_name(f)
    out[name] = q.read_text().strip() if q.is_file() else None
try:
    from ggmoe.engine.patch import is_patched
    out["patched"] = is_patched()
except Exception as e:
    out["patched"] = False
    out["patch_error"] = f"{type(e).__name__}: {e}"
out["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
out["system_info"] = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
try:
    from ggmoe.engine.loader import gpu_device_name
    out["gpu"] = gpu_device_name()
except Exception as e:
    out["gpu"] = None
print(json.dumps(out))
"""


def status() -> dict:
    """What the installed engine is: installed, version, patched, build key and info, backends, GPU.

    Asked in a fresh Python (the engine's libraries are loaded there, not here)."""
    script = _STATUS_SCRIPT.replace("KEY", repr(KEY_FILE)).replace("INFO", repr(INFO_FILE))
    proc = subprocess.run([sys.executable, "-c", script], text=True, capture_output=True)
    lines = proc.stdout.strip().splitlines()
    try:
        info = json.loads(lines[-1]) if lines else {}
    except ValueError:
        info = {}
    if not info:
        info = {"installed": False, "error": (proc.stderr.strip().splitlines() or ["the check crashed"])[-1]}
    info["patches_available"] = [p.name for p in sorted(PATCH_DIR.glob("*.patch"))]
    try:  # what a build now would be keyed by (this machine's flags, the patch series as it is now)
        info["current_key"] = build_key(cmake_args())
    except BuildError:
        info["current_key"] = None
    info["patch_dir"] = str(PATCH_DIR)
    info["expected_version"] = LLAMA_CPP_PYTHON_VERSION
    info["cpu_features"] = cpu_features(info.get("system_info") or "")
    return info


def cpu_features(system_info: str) -> list[str]:
    """The CPU features the engine was built with, from llama.cpp's system info ("AVX2 = 1 | AMX_INT8 = 1 | ..."):
    ggml's ``ggml_cpu_has_*`` answer what the compiler defined, so this is the build, not the machine."""
    out = []
    for part in system_info.replace("\n", "|").split("|"):
        name, _, value = part.rpartition("=")
        name = name.strip().rsplit(":", 1)[-1].strip()
        if name and value.strip() == "1" and name.replace("_", "").isalnum() and name.isupper():
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="pip install the wheel into this Python")
    ap.add_argument("--cuda", action="store_true", help="build with -DGGML_CUDA=ON (as GGMOE_CUDA=1)")
    ap.add_argument("--check-patches", action="store_true", help="only check that patches/ applies")
    ap.add_argument("--rebuild", action="store_true", help="ignore the cached wheel")
    opts = ap.parse_args(argv)
    try:
        if opts.check_patches:
            print(f"all {check_patches()} patches apply")
            return 0
        print(build(opts.install, True if opts.cuda else None, opts.rebuild))
        return 0
    except BuildError as e:
        print(f"engine build error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
