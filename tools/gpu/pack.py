#!/usr/bin/env python3
"""Pack (here, on the CPU machine) what the GPU machine needs and lacks, into the ignored folder gpu-pack/.

The GPU machine has CUDA 13 (nvcc), cmake, ninja, scikit-build-core and Python 3.12 with numpy, jinja2,
pyyaml, tqdm, requests, click and typing-extensions, and nothing can be downloaded there. This writes:

    gpu-pack/engine-src.tar.gz   llama-cpp-python's sdist with patches/ applied, trimmed to what a CUDA
                                 build of the engine needs (no .git, models, docs, tests, examples, tools,
                                 nor the other GPU backends)
    gpu-pack/wheels/             wheels of the engine's and ggmoe's runtime dependencies beyond numpy, for
                                 CPython 3.12 on manylinux x86-64 (gguf and diskcache are missing there; the
                                 others are carried at the versions tested here, so the run does not depend
                                 on the image's)
    gpu-pack/trace.npz           a held-out, teacher-forced trace of the embedded model (trace-replay routing)
    gpu-pack/real-routing.npz    public real routing (ggmoe trace import of the per-layer files of --real-routing
                                 DIR..., default ../shared/real-routing/deepseek-v2-lite-esft/{intent,law} where
                                 present), deflated; the pipeline's trace rows replay it (matrix.py --trace maps
                                 it to each shape and names its source in every row)
    gpu-pack/MANIFEST.json       what is in it, with sizes and the engine build key

and fails if the pack is over 60 MiB, or over what the device tool's 64 MiB leaves beside the working
tree that travels with it (tracked and untracked-not-ignored files, ~18 MiB).

    python tools/gpu/pack.py [--out gpu-pack] [--no-trace] [--python-version 3.12]
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
sys.path.insert(0, str(ROOT))  # the repo root: tools.* when run as a file
from ggmoe.base.errors import GgmoeError  # noqa: E402
from tools import build_engine  # noqa: E402

MAX_PACK_BYTES = 60 << 20  # bytes: the pack alone
MAX_CARRY_BYTES = 62 << 20  # bytes: the pack and the working tree (the device tool's 64 MiB, less a margin)
# Runtime dependencies beyond numpy of llama-cpp-python (diskcache, jinja2 -> markupsafe, typing-extensions),
# gguf (pyyaml, tqdm; requests only for downloads, and it is there) and ggmoe (click, prometheus-client), and
# pytest for the GPU tier, pinned to the versions this project tests with.
WHEELS = ("gguf==0.19.0", "diskcache==5.6.3", "jinja2==3.1.6", "markupsafe==3.0.3", "typing-extensions==4.16.0",
          "click==8.5.1", "pyyaml==6.0.3", "tqdm==4.70.1", "prometheus-client==0.26.0",
          # the GPU tier (tests/gpu) runs there too
          "pytest==9.0.3", "pluggy==1.6.0", "iniconfig==2.3.0", "packaging==26.2", "pygments==2.20.0")
# The real routing the GPU matrix's trace rows replay by default (real-shape rows on real routing, not the
# embedded model's tiled trace): DeepSeek-V2-Lite on public prompts, two domains
REAL_ROUTING_DIR = ROOT.parent / "shared" / "real-routing" / "deepseek-v2-lite-esft"
DEFAULT_REAL_ROUTING = (REAL_ROUTING_DIR / "intent", REAL_ROUTING_DIR / "law")
# manylinux tags pip must be told one by one (the device README's recipe)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")

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


def download_wheels(dest: Path, python_version: str) -> None:
    """Binary wheels of WHEELS for CPython ``python_version`` on x86-64 Linux (pure-Python ones included)."""
    dest.mkdir(parents=True, exist_ok=True)
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    build_engine.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                      "--python-version", python_version, "--implementation", "cp", *plats, "-d", str(dest),
                      *WHEELS], "downloading the wheels for the GPU machine")
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in dest.glob("*.whl")}
    missing = {w.split("==")[0] for w in WHEELS} - names
    if missing:
        raise PackError(f"pip downloaded no wheel of {', '.join(sorted(missing))}")


def tree_bytes() -> int:
    """Bytes of the working tree that travels with a device call: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    files = {ROOT / f for f in out.decode().split("\0") if f}
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def make_real_routing(out: Path, dirs: list[Path]) -> None:
    """Public routing logs (per-layer files of DeepSeek-V2-Lite: 27 layers, 64 experts, top-6) as one trace."""
    from ggmoe.trace.data import merge_traces
    from ggmoe.trace.format import write_trace
    from ggmoe.trace.imports import RoutingShape, import_routing

    shape = RoutingShape(n_layer=27, n_expert=64, n_expert_used=6)
    write_trace(merge_traces([import_routing(d, shape, "layer-files") for d in dirs]), out, compress=True)


def make_trace(out: Path, docs: int, prefill_tokens: int = 64, steps: int = 64) -> None:
    """A held-out, teacher-forced trace of the embedded model: ``docs`` code documents never used in training
    (tools/routing/trace_corpus.py's choice), their first ``prefill_tokens`` as the prefill, then ``steps`` tokens
    of their real continuation one per decode step; no hidden states (the GPU models' width differs).

    One thread: the model is tiny, and two threads on a busy 2-core machine are ten times slower."""
    from ggmoe.engine import Engine, EngineConfig
    from ggmoe.engine.record import RecordConfig, record_trace
    from ggmoe.models import default_model_path
    from tools.routing import trace_corpus

    model = default_model_path()
    if model is None:
        raise PackError("no embedded model to trace (ggmoe/models/tiny-moe.gguf)")
    cfg = RecordConfig(mode="teacher", max_tokens=steps, prefill_tokens=prefill_tokens, keep_hidden=False)
    with Engine(EngineConfig(model_path=model, n_ctx=max(prefill_tokens + steps + 8, 256), n_threads=1)) as eng:
        texts = trace_corpus.pick_documents(eng, "heldout", "code", docs, prefill_tokens + steps + 1, seed=0)
        record_trace(eng, texts, cfg, out)


def write_pack(out: Path, a: argparse.Namespace) -> None:
    """Everything the GPU machine needs, into ``out`` (a new folder), with its MANIFEST; PackError when over budget."""
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="ggmoe-pack-") as tmp:
        write_source_tar(trimmed_source(Path(tmp)), out / "engine-src.tar.gz")
    download_wheels(out / "wheels", a.python_version)
    if not a.no_trace:
        make_trace(out / "trace.npz", a.trace_docs)
    if a.real_routing:
        make_real_routing(out / "real-routing.npz", a.real_routing)
    files = {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()}
    total = sum(files.values())
    cuda_args = build_engine.BASE_CMAKE_ARGS + ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_NATIVE=ON"]
    manifest = {"llama_cpp_python": build_engine.LLAMA_CPP_PYTHON_VERSION, "python": a.python_version,
                "patches": [p.name for p in build_engine.patch_files()],
                "patch_sha256": hashlib.sha256(b"".join(p.read_bytes() for p in build_engine.patch_files()))
                .hexdigest()[:16], "cmake_args": cuda_args, "files": files, "total_bytes": total}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    tree = tree_bytes()
    print(f"{a.out}: {total / 2**20:.1f} MiB in {len(files)} files; with the working tree that travels "
          f"beside it ({tree / 2**20:.1f} MiB): {(total + tree) / 2**20:.1f} MiB", flush=True)
    if total > MAX_PACK_BYTES:
        raise PackError(f"the pack is {total / 2**20:.1f} MiB, over its {MAX_PACK_BYTES >> 20} MiB budget")
    if total + tree > MAX_CARRY_BYTES:
        raise PackError(f"the pack ({total / 2**20:.1f} MiB) and the working tree ({tree / 2**20:.1f} MiB) "
                        f"are over the {MAX_CARRY_BYTES >> 20} MiB a device call can carry")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-pack")
    ap.add_argument("--no-trace", action="store_true", help="skip the trace (trace routing then needs one)")
    ap.add_argument("--trace-docs", type=int, default=24, help="held-out documents traced (64 + 64 tokens each)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (wheel tags)")
    ap.add_argument("--real-routing", nargs="*", type=Path, default=None,
                    help="directories of per-layer routing files (DeepSeek-V2-Lite's: 64 experts, top-6) to pack; "
                         f"default: {', '.join(str(d) for d in DEFAULT_REAL_ROUTING)} where present; none: no files")
    a = ap.parse_args(argv)
    if a.real_routing is None:  # the shared real routing beside the checkout, as CI and sessions have it
        a.real_routing = [d for d in DEFAULT_REAL_ROUTING if d.is_dir()]
    missing = [d for d in a.real_routing if not d.is_dir()]
    if missing:  # said before minutes of work
        print(f"error: --real-routing {missing[0]}: no such directory", file=sys.stderr)
        return 2
    # built beside the old pack, which is replaced only once the new one is whole: a failed pack loses nothing
    partial = a.out.parent / f".{a.out.name}.partial"
    try:
        shutil.rmtree(partial, ignore_errors=True)
        write_pack(partial, a)
        shutil.rmtree(a.out, ignore_errors=True)
        partial.rename(a.out)
    except (PackError, build_engine.BuildError, subprocess.SubprocessError, OSError, GgmoeError) as e:
        shutil.rmtree(partial, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
