#!/usr/bin/env python3
"""Pack (here, on the CPU machine) what the GPU machine needs and lacks, into the ignored folder gpu-pack/.

The GPU machine has CUDA 13 (nvcc), cmake, ninja, scikit-build-core and Python 3.12 with numpy, jinja2,
pyyaml, tqdm, requests, click and typing-extensions, and nothing can be downloaded there. This writes:

    gpu-pack/engine-src.tar.gz   llama-cpp-python's sdist with patches/ applied, trimmed to what a CUDA
                                 build of the engine needs (no .git, models, docs, tests, examples, tools,
                                 nor the other GPU backends)
    gpu-pack/wheels/             pure-Python wheels missing there (gguf, diskcache)
    gpu-pack/trace.npz           a held-out, teacher-forced trace of the embedded model (trace-replay routing)
    gpu-pack/MANIFEST.json       what is in it, with sizes and the engine build key

and fails if the whole is over the device tool's budget (64 MiB with the working tree; this keeps 40).

    python tools/gpu/pack.py [--out gpu-pack] [--no-trace]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_engine  # noqa: E402

MAX_PACK_BYTES = 40 << 20  # the device tool carries 64 MiB with the working tree (~18 MiB)
WHEELS = ("gguf==0.19.0", "diskcache==5.6.3")  # pure Python; everything else is there already

# Paths under the sdist's vendor/llama.cpp that a CUDA build of the bindings never reads.
TRIM_LLAMA = ("models", "docs", "tests", "examples", "tools", "benches", "media", "gguf-py", "scripts",
              "conversion", ".devops", ".github", "ci", "grammars", "prompts", "requirements", "pocs",
              "licenses", "poetry.lock", "flake.nix", "flake.lock")
TRIM_BACKENDS = ("ggml-cann", "ggml-hexagon", "ggml-metal", "ggml-musa", "ggml-opencl", "ggml-openvino",
                 "ggml-rpc", "ggml-sycl", "ggml-virtgpu", "ggml-vulkan", "ggml-webgpu", "ggml-zdnn",
                 "ggml-et", "ggml-hip", "ggml-kompute", "ggml-blas", "ggml-zendnn")
# Top-level folders of the sdist besides the package and vendor/ that the build does not need.
TRIM_TOP = (".git", "docs", "examples", "tests", ".github", "docker")


class PackError(Exception):
    pass


def _rm(path: Path) -> int:
    """Remove a file or tree; returns the bytes freed."""
    if not path.exists():
        return 0
    if path.is_dir():
        n = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path)
        return n
    n = path.stat().st_size
    path.unlink()
    return n


def trimmed_source(work: Path) -> Path:
    """The patched, trimmed source tree under ``work``."""
    sdist = build_engine.fetch_sdist()
    with tarfile.open(sdist) as tf:
        tf.extractall(work, filter="data")
    src = work / f"llama_cpp_python-{build_engine.LLAMA_CPP_PYTHON_VERSION}"
    build_engine.apply_patches(src)
    llama = src / build_engine.VENDOR
    freed = sum(_rm(llama / p) for p in TRIM_LLAMA)
    freed += sum(_rm(llama / "ggml" / "src" / b) for b in TRIM_BACKENDS)
    freed += sum(_rm(src / p) for p in TRIM_TOP)
    print(f"trimmed {freed / 2**20:.0f} MiB from the source", flush=True)
    return src


def write_source_tar(src: Path, out: Path) -> None:
    with tarfile.open(out, "w:gz", compresslevel=6) as tf:
        tf.add(src, arcname=src.name)


def download_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    build_engine.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                      "--python-version", "3.12", "--implementation", "py", "-d", str(dest), *WHEELS],
                     "downloading the wheels the GPU machine lacks")


def make_trace(out: Path, docs: int) -> None:
    """A held-out teacher-forced trace of the embedded model (tools/trace_corpus.py, code domain)."""
    with tempfile.TemporaryDirectory(prefix="ggmoe-pack-trace-") as tmp:
        build_engine.run([sys.executable, str(ROOT / "tools" / "trace_corpus.py"), "--docs", str(docs),
                          "--out", tmp, "--modes", "teacher", "--domains", "code", "--no-hidden"],
                         "tracing the embedded model")
        traces = sorted(Path(tmp).glob("*-teacher/trace.npz"))
        if not traces:
            raise PackError("tools/trace_corpus.py wrote no trace")
        shutil.copy(traces[0], out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-pack")
    ap.add_argument("--no-trace", action="store_true", help="skip the trace (trace routing then needs one)")
    ap.add_argument("--trace-docs", type=int, default=24, help="held-out documents traced")
    a = ap.parse_args(argv)
    out: Path = a.out
    try:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        with tempfile.TemporaryDirectory(prefix="ggmoe-pack-") as tmp:
            write_source_tar(trimmed_source(Path(tmp)), out / "engine-src.tar.gz")
        download_wheels(out / "wheels")
        if not a.no_trace:
            make_trace(out / "trace.npz", a.trace_docs)
        files = {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()}
        total = sum(files.values())
        cuda_args = build_engine.BASE_CMAKE_ARGS + ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                                                    "-DGGML_NATIVE=ON"]
        manifest = {"llama_cpp_python": build_engine.LLAMA_CPP_PYTHON_VERSION,
                    "patches": [p.name for p in build_engine.patch_files()],
                    "patch_sha256": hashlib.sha256(b"".join(p.read_bytes() for p in build_engine.patch_files()))
                    .hexdigest()[:16], "cmake_args": cuda_args, "files": files, "total_bytes": total}
        (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
        print(f"{out}: {total / 2**20:.1f} MiB in {len(files)} files", flush=True)
        if total > MAX_PACK_BYTES:
            raise PackError(f"the pack is {total / 2**20:.1f} MiB, over the {MAX_PACK_BYTES >> 20} MiB budget")
    except (PackError, build_engine.BuildError, subprocess.SubprocessError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
