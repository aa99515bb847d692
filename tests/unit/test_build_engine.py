"""The engine build's patch step: applied in order, a bad patch named clearly; cache key."""

from __future__ import annotations

import pytest

from tools import build_engine as be


def _tree(tmp_path):
    src = tmp_path / "sdist"
    (src / be.VENDOR / "src").mkdir(parents=True)
    (src / be.VENDOR / "src" / "a.cpp").write_text("one\ntwo\nthree\n")
    return src


def _patch(tmp_path, name, old, new):
    p = tmp_path / name
    p.write_text(f"--- a/src/a.cpp\n+++ b/src/a.cpp\n@@ -1,3 +1,3 @@\n {old[0]}\n-{old[1]}\n+{new}\n {old[2]}\n")
    return p


def test_patches_apply_in_sequence(tmp_path):
    src = _tree(tmp_path)
    first = _patch(tmp_path, "0001.patch", ("one", "two", "three"), "TWO")
    second = _patch(tmp_path, "0002.patch", ("one", "TWO", "three"), "2")  # builds on the first
    be.apply_patches(src, [first, second])
    assert (src / be.VENDOR / "src" / "a.cpp").read_text() == "one\n2\nthree\n"


def test_a_patch_that_does_not_apply_is_named(tmp_path):
    src = _tree(tmp_path)
    bad = _patch(tmp_path, "0001-bad.patch", ("one", "zwei", "three"), "x")
    with pytest.raises(be.BuildError, match="0001-bad.patch does not apply"):
        be.apply_patches(src, [bad])


def test_build_key_changes_with_flags_and_patches(monkeypatch, tmp_path):
    k1 = be.build_key(["-DGGML_NATIVE=OFF"])
    assert k1 == be.build_key(["-DGGML_NATIVE=OFF"])
    assert k1 != be.build_key(["-DGGML_NATIVE=OFF", "-DGGML_CUDA=ON"])
    (tmp_path / "0001-x.patch").write_text("x")
    monkeypatch.setattr(be, "PATCH_DIR", tmp_path)
    assert be.build_key(["-DGGML_NATIVE=OFF"]) != k1


def test_cuda_flags(monkeypatch):
    monkeypatch.setenv("GGMOE_CUDA", "1")
    monkeypatch.setenv("CMAKE_CUDA_ARCHITECTURES", "90")
    args = be.cmake_args()
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    monkeypatch.setenv("GGMOE_CUDA", "0")
    assert "-DGGML_CUDA=ON" not in be.cmake_args()


def test_cmake_args_from_the_environment_come_last_and_change_the_key(monkeypatch):
    monkeypatch.delenv("GGMOE_CUDA", raising=False)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    plain = be.cmake_args()
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_AVX512=OFF -DGGML_BLAS=ON")
    args = be.cmake_args()
    assert args[-2:] == ["-DGGML_AVX512=OFF", "-DGGML_BLAS=ON"] and args[:-2] == plain
    assert be.build_key(args) != be.build_key(plain)
    assert "-DGGML_CUDA=ON" in be.cmake_args(cuda=True)


def test_the_patch_series_is_found_in_a_clone_and_named_when_missing(monkeypatch, tmp_path):
    from pathlib import Path

    clone = Path(be.__file__).resolve().parents[2] / "patches"  # ggmoe/base/engine_build.py -> the clone
    assert be.find_patch_dir() == clone and be.patch_files()[0].name.startswith("0001-")
    monkeypatch.setattr(be, "PATCH_DIR", tmp_path)
    with pytest.raises(be.BuildError, match="no patch series found"):
        be.patch_files()



def test_a_failed_build_step_is_one_error_line_at_the_cli(monkeypatch, tmp_path):
    """In the package a BuildError is an EngineError: the CLI's edge prints it as it is (exit 2), with no
    second name and no traceback."""
    from click.testing import CliRunner

    from ggmoe.base import engine_build as build
    from ggmoe.base.errors import EngineError
    from ggmoe.cli import main

    assert issubclass(build.BuildError, EngineError)
    monkeypatch.setattr(build, "PATCH_DIR", tmp_path)
    r = CliRunner().invoke(main, ["engine", "build", "--check-patches"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.startswith(f"error: no patch series found (looked in {tmp_path})")


def test_the_build_in_the_package_loads_no_engine():
    """``ggmoe.base.engine_build`` replaces llama-cpp-python, so importing it (and the lazy ``ggmoe.engine``)
    loads nothing of the engine beyond what ``import ggmoe`` itself does (on a CUDA build it maps libllama
    first: ggmoe/__init__.py); ``Engine`` still comes from the package on first use."""
    import subprocess
    import sys

    heavy = "sorted(m for m in ('llama_cpp', 'numpy', 'ggmoe.engine.engine') if m in sys.modules)"
    code = (f"import sys, ggmoe; print({heavy}); import ggmoe.base.engine_build, ggmoe.engine; print({heavy}); "
            "from ggmoe.engine import Engine; print(Engine.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after, module = out.stdout.splitlines()
    assert after == before and "ggmoe.engine.engine" not in after
    assert module == "ggmoe.engine.engine"


def test_a_native_x86_build_leaves_amx_out_unless_opted_in(monkeypatch):
    """ggml's AMX kernels crash on Sapphire Rapids (llama.cpp #20824): a native build defines no __AMX_INT8__."""
    for var in ("GGMOE_CUDA", "CMAKE_ARGS", "GGMOE_AMX", "GGMOE_NATIVE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(be.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(be, "no_amx_flags", lambda: ["-DCMAKE_C_FLAGS=-mno-amx-int8"])
    assert "-DCMAKE_C_FLAGS=-mno-amx-int8" in be.cmake_args()
    monkeypatch.setenv("GGMOE_AMX", "1")
    assert not any("amx" in a for a in be.cmake_args())
    monkeypatch.setenv("GGMOE_AMX", "0")
    monkeypatch.setenv("GGMOE_NATIVE", "0")  # a portable build never enables AMX (ggml's GGML_AMX_* are off)
    assert not any("amx" in a for a in be.cmake_args())


def test_the_no_amx_flag_is_one_the_compiler_honours_against_march():
    """The flag the build passes, checked with the compiler the build uses: -march=sapphirerapids then
    -mno-amx-int8 in either order defines no __AMX_INT8__ (skipped where there is no x86 compiler)."""
    import os
    import shutil
    import subprocess

    import pytest

    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None or be.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("no x86 C compiler here")
    flags = be.no_amx_flags()
    assert flags, "the compiler here knows -mno-amx-int8, so the build must pass it"
    flag = flags[0].split("=", 1)[1]
    for order in ([flag, "-march=sapphirerapids"], ["-march=sapphirerapids", flag]):
        out = subprocess.run([cc, *order, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip("the compiler here does not know -march=sapphirerapids")
        assert "__AMX_INT8__" not in out.stdout, order
    ref = subprocess.run([cc, "-march=sapphirerapids", "-dM", "-E", "-x", "c", os.devnull],
                         capture_output=True, text=True)
    assert "__AMX_INT8__" in ref.stdout  # the check itself can fail


def test_cpu_features_read_from_the_system_info():
    info = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 |"
    assert be.cpu_features(info) == ["SSE3", "AVX2", "AMX_INT8", "OPENMP", "REPACK"]
    assert be.cpu_features("") == []
