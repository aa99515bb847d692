"""Compile the CUDA sources ggmoe's patches change, with nvcc, for sm_90: ``nvcc -c`` only, no link.

The development machines and CI have nvcc (CUDA 13) but no GPU, so this is how a change to ggml-cuda is
checked before a GPU is lent: the pinned llama-cpp-python sdist (cached by ``tools/build_engine.py``) is
unpacked, every patch applied, and each ``.cu`` file that some patch touches compiled on its own with the
flags ggml-cuda's CMake uses. The CUDA toolkit here has no cuBLAS headers (ggml-cuda includes
``cublas_v2.h``): they come from the toolkit when it has them, else from NVIDIA's ``nvidia-cublas`` wheel on
PyPI, unpacked once into ``$GGMOE_CACHE/cublas`` (headers only).

    python tools/checks/cuda_compile_check.py            # every patched .cu file
    python tools/checks/cuda_compile_check.py --list     # which files, without compiling
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from tools import build_engine  # noqa: E402 - the sdist, its version and the patch list

ARCH = "sm_90"
# what ggml-cuda's CMakeLists.txt defines for a default build (the values only size tables)
DEFINES = ("-DGGML_CUDA_USE_GRAPHS", "-DGGML_SCHED_MAX_COPIES=4", "-DGGML_CUDA_PEER_MAX_BATCH_SIZE=128",
           "-DNDEBUG", "-D_GNU_SOURCE", "-D_XOPEN_SOURCE=600")


def patched_cuda_files(patches: list[Path]) -> list[str]:
    """Paths (relative to llama.cpp's root) of the .cu files any patch changes."""
    out: set[str] = set()
    for p in patches:
        out |= set(re.findall(r"^\+\+\+ b/(ggml/src/ggml-cuda/\S+\.cu)$", p.read_text(), flags=re.M))
    return sorted(out)


def cublas_include() -> Path:
    """A directory with cublas_v2.h: the toolkit's, or NVIDIA's wheel's headers unpacked into the cache."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             str(Path(nvcc).resolve().parent.parent) if nvcc else None]
    for r in filter(None, roots):
        if (Path(r) / "include" / "cublas_v2.h").is_file():
            return Path(r) / "include"
    cache = build_engine.cache_dir() / "cublas"
    found = sorted(cache.glob("nvidia/*/include/cublas_v2.h"))
    if found:
        return found[-1].parent
    with tempfile.TemporaryDirectory(prefix="ggmoe-cublas-") as tmp:
        print("the CUDA toolkit has no cuBLAS headers: fetching them from the nvidia-cublas wheel", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, "nvidia-cublas"],
                       check=True)
        wheel = next(Path(tmp).glob("nvidia_cublas-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if "/include/" in name:
                    z.extract(name, cache)
    return sorted(cache.glob("nvidia/*/include/cublas_v2.h"))[-1].parent


def compile_one(root: Path, rel: str, blas: Path) -> subprocess.CompletedProcess:
    cmd = ["nvcc", "-c", "-o", os.devnull, f"-arch={ARCH}", "-std=c++17", "--extended-lambda",
           "-use_fast_math", "-O1", *DEFINES,
           "-I", str(root / "ggml/include"), "-I", str(root / "ggml/src"), "-I", str(root / "ggml/src/ggml-cuda"),
           "-I", str(blas), str(root / rel)]
    return subprocess.run(cmd, capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the patched .cu files and exit")
    opts = ap.parse_args()
    files = patched_cuda_files(build_engine.patch_files())
    if opts.list or not files:
        print("\n".join(files) if files else "no patch changes a .cu file")
        return 0
    if shutil.which("nvcc") is None:
        print("error: nvcc is not on PATH", file=sys.stderr)
        return 2
    blas = cublas_include()
    sdist = build_engine.fetch_sdist()
    with tempfile.TemporaryDirectory(prefix="ggmoe-cuda-check-") as tmp:
        import tarfile

        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{build_engine.LLAMA_CPP_PYTHON_VERSION}"
        build_engine.apply_patches(src)
        root = src / "vendor" / "llama.cpp"
        failed = 0
        for rel in files:
            r = compile_one(root, rel, blas)
            print(f"{'ok    ' if r.returncode == 0 else 'FAILED'} nvcc -c -arch={ARCH} {rel}", flush=True)
            if r.returncode != 0:
                failed += 1
                print(r.stderr[-4000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
