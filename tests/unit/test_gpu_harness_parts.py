"""The GPU harness's pure parts: quant blocks with valid scales, trace tiling, the trace-replay cursor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tools.gpu.realshape import (
    PRESETS,
    Payload,
    mxfp4_blocks,
    plan_for,
    q4_k_blocks,
    q8_0_blocks,
    tensor_bytes,
    tensor_type,
)
from tools.gpu.trace_routing import TilingError, TraceRouting, expert_map, tile_ids

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("make,qtype", [(q8_0_blocks, Q.Q8_0), (q4_k_blocks, Q.Q4_K), (mxfp4_blocks, Q.MXFP4)])
@pytest.mark.parametrize("std", [0.02, 0.0625])
def test_blocks_dequantize_to_the_asked_spread(make, qtype, std):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = make(4096, std, Payload(np.random.default_rng(0), 1 << 20))
    assert b.shape == (4096, size) and b.dtype == np.uint8
    v = gguf.quants.dequantize(b.reshape(64, -1), qtype)
    assert v.shape == (64, 4096 * block // 64)
    assert np.isfinite(v).all()
    assert abs(float(v.mean())) < 0.1 * std
    # MXFP4's scale is a power of two: the spread is right within a factor sqrt(2)
    assert float(v.std()) == pytest.approx(std, rel=0.42 if qtype == Q.MXFP4 else 0.25)


def test_payload_is_fresh_per_take_and_random():
    p = Payload(np.random.default_rng(1), 1 << 16)
    a = p.take(100_000).copy()
    b = p.take(100_000)
    assert not np.array_equal(a, b)
    assert 100 < a.mean() < 155  # uniform bytes average 127.5


def test_quant_types_and_sizes_of_the_presets():
    for name, preset in PRESETS.items():
        plan, _ = plan_for(name)
        experts = [t for t in plan.tensors if "_exps" in t.name]
        want = {t.name: preset.down_type if preset.down_type and "ffn_down" in t.name else preset.expert_type
                for t in experts}
        assert experts and all(tensor_type(t, preset.expert_type, preset.down_type) == want[t.name] for t in experts)
        assert all(tensor_bytes(t, tensor_type(t, preset.expert_type, preset.down_type)) > 0 for t in plan.tensors)
    # gpt-oss-20b: 24 layers x 32 experts x 3 x 2880 x 2880 MXFP4 weights (17 bytes per 32)
    plan, preset = plan_for("gpt-oss-20b")
    total = sum(tensor_bytes(t, tensor_type(t, preset.expert_type)) for t in plan.tensors if "_exps" in t.name)
    assert total == 24 * 32 * 3 * 2880 * 2880 // 32 * 17


def test_rows_that_do_not_fit_the_block_are_refused():
    from tools.fixtures.make_fixtures import Role, TensorSpec

    with pytest.raises(ValueError, match="not a multiple"):
        tensor_bytes(TensorSpec("x", (2880, 16), Role.EXPERT), Q.Q4_K)


@pytest.mark.parametrize("n_e_t,k_t,n_e,k,want", [
    (32, 4, 32, 4, (1, 1)), (32, 4, 128, 8, (4, 2)), (8, 2, 64, 8, (8, 4)),
])
def test_expert_map(n_e_t, k_t, n_e, k, want):
    assert expert_map(n_e_t, k_t, n_e, k) == want


@pytest.mark.parametrize("args", [(32, 4, 100, 8), (32, 4, 128, 6), (32, 4, 64, 16)])
def test_expert_map_refuses(args):
    with pytest.raises(TilingError):
        expert_map(*args)


def test_tile_ids_by_hand():
    ids = np.array([[[0, 1], [2, 3]]], dtype=np.int16)  # one token, 2 trace layers, top-2 of 4 experts
    out = tile_ids(ids, n_layer=3, factor=4, reps=2)  # 16 experts, top-4
    # layer j replays trace layer j % 2; expert e -> 4e + ((j*2 + r) % 4)
    assert out[0, 0].tolist() == [0, 1, 4, 5]
    assert out[0, 1].tolist() == [8 + 2, 8 + 3, 12 + 2, 12 + 3]
    assert out[0, 2].tolist() == [0, 1, 4, 5]  # (2*2 + r) % 4 = r
    assert len(set(out[0, 1].tolist())) == 4


class _Trace:
    def __init__(self, ids, layers):
        self.ids = np.asarray(ids)
        self.layers = np.asarray(layers)


def test_trace_routing_cursor():
    # 3 tokens, layers il 0 and 5, top-1
    r = TraceRouting(_Trace([[[10], [20]], [[11], [21]], [[12], [22]]], [0, 5]))
    assert r(0, 2) == [10, 11]  # a two-token micro-batch
    assert r(5, 1) == [21]  # the last layer computes only the batch's last row
    assert r(0, 1) == [12]
    assert r(5, 1) == [22]
    assert r(0, 2) == [10, 11]  # wraps around the trace


# --------------------------------------------------------------------------- Q4_K blocks, by hand

def _q4_k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each block (ggml's get_scale_min_k4), [n, 8] each."""
    q = b[:, 4:16].astype(np.int32)
    sc = np.empty((len(b), 8), np.int32)
    mn = np.empty((len(b), 8), np.int32)
    sc[:, :4], mn[:, :4] = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


@pytest.mark.parametrize("std", [0.01, 1 / 48.0])
def test_q4_k_blocks_by_hand(std):
    b = q4_k_blocks(2048, std, Payload(np.random.default_rng(3), 1 << 20))
    assert b.shape == (2048, 144) and b.dtype == np.uint8
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).ravel()
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32).ravel()
    assert (d == np.float16(std / 258.0)).all() and (dmin == np.float16(7.5 * std / 258.0)).all()
    sc, mn = _q4_k_scales(b)
    assert sc.min() >= 0 and sc.max() <= 63 and mn.min() >= 0 and mn.max() <= 63
    assert len(np.unique(sc)) == 64 and len(np.unique(mn)) == 64  # the whole 6-bit range is used
    v = gguf.quants.dequantize(b, Q.Q4_K).reshape(2048, 256)
    # value = d * sc * q - dmin * m, q in [0, 15]: inside [-63 dmin, 945 d], and exact per sub-block
    assert v.min() >= -63 * dmin[0] - 1e-6 and v.max() <= 945 * d[0] + 1e-6
    q = np.stack([b[:, 16:144] & 0xF, b[:, 16:144] >> 4], axis=1)  # [n, 2, 128]: 32-byte groups, lo then hi
    q = q.reshape(2048, 2, 4, 32).transpose(0, 2, 1, 3).reshape(2048, 256).astype(np.float32)
    want = d[0] * np.repeat(sc, 32, axis=1) * q - dmin[0] * np.repeat(mn, 32, axis=1)
    np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- the matrix's pure parts

from tools.gpu.matrix import (  # noqa: E402
    Cell,
    goals,
    hook_overhead_us,
    n_gpu_layers_for,
    n_slots_for,
    plan_cells,
)


def test_plan_cells_order_and_exclusions():
    plan = plan_cells(["random", "trace"], ["stock-vram", "stock-cpu", "n-cpu-moe", "lru", "prefetch",
                                            "prefetch-eam"], [0.5, 0.25])
    assert plan[:2] == [("random", "stock-vram", None), ("random", "stock-cpu", None)]
    assert plan[2:5] == [("random", "n-cpu-moe", 0.5), ("random", "lru", 0.5), ("random", "prefetch", 0.5)]
    assert ("random", "prefetch-eam", 0.5) not in plan  # eam learns from the trace
    trace = [p for p in plan if p[0] == "trace"]
    assert trace == [("trace", c, f) for f in (0.5, 0.25) for c in ("lru", "prefetch", "prefetch-eam")]
    assert len(plan) == len(set(plan)) == 2 + 3 * 2 + 3 * 2


@pytest.mark.parametrize("f,n_e,k,want", [(0.25, 32, 4, 8), (0.5, 128, 8, 64), (0.01, 32, 4, 4), (1.0, 32, 4, 32)])
def test_n_slots_for(f, n_e, k, want):
    assert n_slots_for(f, n_e, k) == want


@pytest.mark.parametrize("slots,layers,n_e,want", [(8, 24, 32, 6), (16, 24, 32, 12), (32, 48, 128, 12), (4, 4, 32, 0)])
def test_n_cpu_moe_layers_at_the_cache_vram(slots, layers, n_e, want):
    assert n_gpu_layers_for(slots, layers, n_e) == want


def _cell(routing, config, fraction, tps, prefill=100.0, sim=None, error=None):
    return Cell("m", routing, config, fraction, None, tps, (tps,), prefill, 0.1, None, None, None,
                tpot_sim_ms=sim, error=error)


# (config, the miss policy the cell ran with (None: not recorded), the one simulated)
SIM_MISS = [
    ("lru", None, "wait"), ("lru-host", None, "cpu"), ("lru-auto", None, "auto"), ("prefetch", None, "auto"),
    ("async", None, "wait"), ("prefetch-wait", None, "wait"),
    ("lru-auto", "wait", "wait"),  # the engine's auto dropped the host path: simulated without it too
    ("prefetch", "auto", "auto"),
    ("async-fill", None, "wait"), ("async-fill-host", None, "cpu"), ("async-fill-auto", None, "auto"),
    ("async-fill-auto", "wait", "wait"),
]


@pytest.mark.parametrize(("config", "ran", "want"), SIM_MISS)
def test_the_simulator_runs_the_miss_policy_the_cell_ran(config, ran, want):
    from dataclasses import replace

    from tools.gpu.matrix import sim_miss_policy

    assert sim_miss_policy(replace(_cell("random", config, 0.5, 10.0), miss_policy=ran)) == want


def test_goals_by_hand():
    tr = "trace-replay routing (benchmark only)"
    cells = [_cell("random", "stock-vram", None, 100.0), _cell("random", "stock-cpu", None, 20.0, prefill=50.0),
             _cell("random", "n-cpu-moe", 0.5, 40.0), _cell("random", "lru", 0.5, 60.0, sim=1e3 / 60 * 1.1),
             _cell("random", "prefetch", 0.5, 95.0, sim=1e3 / 95 * 0.8), _cell("random", "lru", 0.25, 30.0),
             _cell(tr, "lru", 0.5, 70.0, prefill=40.0), _cell(tr, "prefetch", 0.5, 0.0, error="OOM")]
    g = {(x["routing"], x["goal"].split(":")[0] + x["goal"].split("/")[-1]): x for x in goals(cells)}
    r = {k[1]: v for k, v in g.items() if k[0] == "random"}
    # issue 17's targets: 3x n-cpu-moe, 0.85x all-in-VRAM at 50 %
    assert r["decode at 50 % n-cpu-moe"]["value"] == pytest.approx(95 / 40)
    assert not r["decode at 50 % n-cpu-moe"]["met"]
    assert r["decode at 50 % lru"]["value"] == pytest.approx(95 / 60) and r["decode at 50 % lru"]["met"]
    assert r["decode at 50 % stock-vram"]["value"] == pytest.approx(0.95) and r["decode at 50 % stock-vram"]["met"]
    assert r["decode, every size stock-cpu"]["value"] == pytest.approx(30 / 20)
    assert r["prefill, every size stock-cpu"]["value"] == pytest.approx(2.0)
    t = {k[1]: v for k, v in g.items() if k[0] == "trace"}
    assert t["decode at 50 % n-cpu-moe"]["value"] == pytest.approx(70 / 40)  # stock rows stand for both
    assert t["decode at 50 % lru"]["value"] == pytest.approx(1.0) and not t["decode at 50 % lru"]["met"]
    assert not t["prefill, every size stock-cpu"]["met"]  # 40 < 50
    sim = [x for x in goals(cells) if x["routing"] == "both"]
    assert len(sim) == 1 and sim[0]["value"] == pytest.approx(0.2) and not sim[0]["met"]


@pytest.mark.parametrize("hybrid_tps, met", [(90.0, True), (70.0, False)])
def test_the_hybrid_goal_by_hand(hybrid_tps, met):
    """Issue 42's goal: hybrid at 50 % against the better of sync LRU and the async decode (here async)."""
    cells = [_cell("random", "lru", 0.5, 60.0), _cell("random", "async", 0.5, 70.0),
             _cell("random", "hybrid", 0.5, hybrid_tps)]
    g = [x for x in goals(cells) if x["goal"].startswith("decode at 50 %: hybrid")]
    assert len(g) == 1 and "(async)" in g[0]["goal"]
    assert g[0]["value"] == pytest.approx(hybrid_tps / 70.0) and g[0]["met"] is met
    assert not [x for x in goals(cells[:2]) if "hybrid" in x["goal"]]  # no hybrid cell: no goal


@pytest.mark.parametrize(("spin_tps", "row"), [(95.0, "hybrid-spin"), (80.0, "hybrid")])
def test_the_hybrid_goal_takes_the_faster_hand_off(spin_tps, row):
    """hybrid-spin (the worker a core short, so its hand-off spins) stands in the hybrid goal where it is faster."""
    cells = [_cell("random", "lru", 0.5, 60.0), _cell("random", "async", 0.5, 70.0),
             _cell("random", "hybrid", 0.5, 90.0), _cell("random", "hybrid-spin", 0.5, spin_tps)]
    g = [x for x in goals(cells) if x["goal"].startswith("decode at 50 %: hybrid")]
    assert len(g) == 1 and g[0]["goal"].startswith(f"decode at 50 %: {row} /")
    assert g[0]["value"] == pytest.approx(max(90.0, spin_tps) / 70.0)


def test_hybrid_spin_leaves_the_main_thread_a_core(monkeypatch):
    from tools.gpu import matrix

    monkeypatch.setattr(matrix.os, "cpu_count", lambda: 16)
    assert matrix._host_threads("hybrid-spin") == 15 and matrix._host_threads("hybrid") is None
    assert matrix._host_threads("lru-host") == 0
    from ggmoe.engine.host_part import HOST_SPIN_US, host_spin_us

    monkeypatch.delenv("GGMOE_HOST_SPIN_US", raising=False)
    assert host_spin_us(16, matrix._host_threads("hybrid-spin"), True, 16) == HOST_SPIN_US


def test_the_host_path_free_goals_by_hand():
    """Every expert cached: a row with the host path asked for against the same row without it, >= 0.97x."""
    cells = [_cell("random", "lru", 1.0, 100.0), _cell("random", "lru-host", 1.0, 98.0),
             _cell("random", "hybrid", 1.0, 90.0), _cell("random", "async-fill", 1.0, 200.0),
             _cell("random", "async-fill-host", 0.5, 50.0)]  # not at 100 %: no goal
    g = {x["goal"]: x for x in goals(cells) if "host path unused" in x["goal"]}
    assert sorted(g) == ["decode, every expert cached: hybrid / lru (the host path unused)",
                         "decode, every expert cached: lru-host / lru (the host path unused)"]
    assert g["decode, every expert cached: lru-host / lru (the host path unused)"]["met"]
    hybrid = g["decode, every expert cached: hybrid / lru (the host path unused)"]
    assert hybrid["value"] == pytest.approx(0.9) and not hybrid["met"]


def test_bounds_and_the_async_goals_by_hand():
    from tools.gpu.matrix import bounds

    probe = {"zero_copy_gb_s": 25.0, "copy_engine_gb_s": 50.0}
    vram = _cell("random", "stock-vram", None, 100.0)  # 10 ms
    full = dataclasses.replace(_cell("random", "async", 1.0, 98.0), host_read_bytes_per_token=0.0,
                               copied_bytes_per_token=0.0)
    half = dataclasses.replace(_cell("random", "async", 0.5, 50.0), host_read_bytes_per_token=50e6,
                               copied_bytes_per_token=100e6)  # 2 ms of reads + 2 ms of copies
    host = dataclasses.replace(_cell("random", "lru-host", 0.5, 20.0), host_read_bytes_per_token=0.0,
                               copied_bytes_per_token=100e6, miss_policy="cpu")  # the CPU's time: no link bound
    out = {(c.config, c.fraction): c for c in bounds([vram, full, half, host], probe)}
    assert out[("async", 1.0)].bound_tpot_ms == pytest.approx(10.0)
    assert out[("async", 0.5)].bound_tpot_ms == pytest.approx(14.0)
    assert out[("lru-host", 0.5)].bound_tpot_ms is None
    assert bounds([vram, half], None)[1].bound_tpot_ms is None  # no probe, no bound
    g = {x["goal"]: x for x in goals(list(out.values())) if x["routing"] == "random"}
    assert g["decode, every expert cached: async / stock-vram"]["value"] == pytest.approx(0.98)
    worst = next(v for k, v in g.items() if k.startswith("TPOT within"))
    assert worst["value"] == pytest.approx(20.0 / 14.0) and not worst["met"]


def test_hook_overhead_per_layer():
    cells = [_cell("random", "stock-vram", None, 100.0), _cell("random", "lru", 1.0, 80.0)]
    assert hook_overhead_us(cells, 10) == pytest.approx((12.5 - 10.0) * 1e3 / 10)
    assert hook_overhead_us(cells[:1], 10) is None


def test_trace_routing_decode_fast_path_equals_the_batch_path():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 32, size=(50, 3, 4))
    one, many = TraceRouting(_Trace(ids, [0, 2, 4])), TraceRouting(_Trace(ids, [0, 2, 4]))
    for _ in range(60):
        a = [one(il, 1) for il in (0, 2, 4)]
        b = [many(il, 1)[:] for il in (0, 2, 4)]
        assert a == b and all(len(x) == 4 for x in a)
    assert one.calls == 180 and one.seconds > 0


# --------------------------------------------------------------------------- build and pack

from tools.gpu import build as gpu_build  # noqa: E402
from tools.gpu import pack as gpu_pack  # noqa: E402


def test_build_cmake_args_and_env():
    m = {"cmake_args": ["-DGGML_OPENMP=ON", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_NATIVE=ON"]}
    assert gpu_build.cmake_args(m, cpu=False) == m["cmake_args"]
    assert gpu_build.cmake_args(m, cpu=True) == ["-DGGML_OPENMP=ON", "-DGGML_NATIVE=ON"]
    assert gpu_build.env_sh(Path("/p/site")).startswith("export PYTHONPATH=/p/site:")


def test_build_states(tmp_path):
    import json
    import os

    pack, prefix = tmp_path / "pack", tmp_path / "prefix"
    pack.mkdir()
    prefix.mkdir()
    m = {"llama_cpp_python": "0.3.36", "patch_sha256": "abc", "cmake_args": []}
    (pack / "MANIFEST.json").write_text(json.dumps(m))
    assert gpu_build.state(pack, prefix, cpu=True)[0] == gpu_build.NEVER
    (prefix / "RUNNING").write_text(str(os.getpid()))  # a live process
    (prefix / "build.log").write_text("  [12/141] g++ ...\n")
    code, msg = gpu_build.state(pack, prefix, cpu=True)
    assert code == gpu_build.RUNNING and "[12/141]" in msg
    (prefix / "RUNNING").write_text("999999999")  # gone without a marker
    assert gpu_build.state(pack, prefix, cpu=True)[0] == gpu_build.FAILED
    (prefix / "RUNNING").unlink()
    (prefix / "DONE").write_text(json.dumps({"key": gpu_build.key(m, True), "seconds": 5, "jobs": 2, "gpu": None}))
    assert gpu_build.state(pack, prefix, cpu=True)[0] == gpu_build.READY
    assert gpu_build.state(pack, prefix, cpu=False)[0] == gpu_build.STALE  # built without CUDA


def test_pack_carries_every_runtime_dependency():
    """Each non-optional requirement of the engine, gguf and ggmoe, beyond numpy (there) and requests (gguf's
    downloads only, and there), has a wheel in the pack, at the version tested here."""
    import importlib.metadata as md
    import re

    names = {w.split("==")[0] for w in gpu_pack.WHEELS}
    for dist in ("llama_cpp_python", "gguf", "diskcache", "jinja2"):
        for req in md.requires(dist) or []:
            if "extra ==" in req or "python_version" in req:
                continue
            name = re.split(r"[ <>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
            if name not in ("numpy", "requests"):
                assert name in names, f"{dist} needs {name}"
    for w in gpu_pack.WHEELS:
        name, version = w.split("==")
        assert md.version(name) == version, f"{name}: the pack pins {version}, {md.version(name)} is tested here"


def test_pack_trims_no_cuda_source():
    assert "ggml-cuda" not in gpu_pack.TRIM_BACKENDS and "ggml-cpu" not in gpu_pack.TRIM_BACKENDS
    assert {"ggml-vulkan", "ggml-metal", "ggml-sycl", "ggml-opencl", "ggml-cann", "ggml-musa", "ggml-hip"} <= set(
        gpu_pack.TRIM_BACKENDS)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_cuda_libs_from_a_trimmed_toolkit_and_pip(tmp_path):
    """A toolkit with nvcc and cudart alone (as on this machine): cuBLAS from PyTorch's pip package, linked
    alone into the prefix; no driver library: VMM off."""
    root = tmp_path / "cuda"
    _touch(root / "include" / "cuda_runtime.h")
    site_dir = tmp_path / "site"
    _touch(site_dir / "nvidia" / "cu13" / "include" / "cublas_v2.h")
    _touch(site_dir / "nvidia" / "cu13" / "include" / "cuda_runtime_api.h")  # another CUDA's: not linked
    _touch(site_dir / "nvidia" / "cu13" / "lib" / "libcublas.so.13")
    _touch(site_dir / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13")
    _touch(site_dir / "nvidia" / "cu13" / "lib" / "libcudart.so.13")  # not linked either
    dest = tmp_path / "prefix" / "cuda"
    libs = gpu_build.find_cuda_libs(dest, [tmp_path / "empty", site_dir], root=root, driver_dirs=(), ldconfig=False)
    assert f"-DCUDA_cublas_LIBRARY={dest / 'lib' / 'libcublas.so'}" in libs.args
    assert f"-DCUDA_cublasLt_LIBRARY={dest / 'lib' / 'libcublasLt.so'}" in libs.args
    assert f"-DCMAKE_CUDA_FLAGS=-I{dest / 'include'}" in libs.args and "-DGGML_CUDA_NO_VMM=ON" in libs.args
    assert sorted(p.name for p in (dest / "lib").iterdir()) == ["libcublas.so", "libcublas.so.13", "libcublasLt.so",
                                                                "libcublasLt.so.13"]
    assert (dest / "lib" / "libcublas.so.13").resolve() == site_dir / "nvidia" / "cu13" / "lib" / "libcublas.so.13"
    assert sorted(p.name for p in (dest / "include").iterdir()) == ["cublas_v2.h"]
    assert libs.lib_dirs == (dest / "lib",)
    assert "LD_LIBRARY_PATH=" in gpu_build.env_sh(Path("/p/site"), libs.lib_dirs)


def test_cuda_libs_of_a_full_toolkit(tmp_path):
    root = tmp_path / "cuda"
    _touch(root / "include" / "cuda_runtime.h")
    _touch(root / "include" / "cublas_v2.h")
    _touch(root / "lib64" / "libcublas.so")
    stub = _touch(root / "lib64" / "stubs" / "libcuda.so")
    libs = gpu_build.find_cuda_libs(tmp_path / "dest", [], root=root, driver_dirs=(), ldconfig=False)
    assert libs.args == (f"-DCUDA_cuda_driver_LIBRARY={stub}",) and libs.lib_dirs == ()


def test_cuda_libs_refused_without_cublas(tmp_path):
    root = tmp_path / "cuda"
    _touch(root / "include" / "cuda_runtime.h")
    with pytest.raises(gpu_build.BuildFailed, match="no cuBLAS"):
        gpu_build.find_cuda_libs(tmp_path / "dest", [tmp_path], root=root, driver_dirs=(), ldconfig=False)


# --------------------------------------------------------------------------- the pipeline's bookkeeping

from tools.gpu import pipeline as gpu_pipeline  # noqa: E402


def test_pipeline_states_and_collect(tmp_path):
    import os

    res, prefix, out = tmp_path / "res", tmp_path / "prefix", tmp_path / "OUT"
    res.mkdir()
    prefix.mkdir()
    assert gpu_pipeline.state(res)[0] == gpu_pipeline.NEVER
    (res / "PID").write_text(str(os.getpid()))
    assert gpu_pipeline.state(res)[0] == gpu_pipeline.RUNNING
    (res / "PID").write_text("999999999")
    assert gpu_pipeline.state(res)[0] == gpu_pipeline.FAILED  # gone without EXIT
    (res / "EXIT").write_text("0")
    assert gpu_pipeline.state(res)[0] == gpu_pipeline.FINISHED
    for model in ("gpt-oss-20b", "qwen3-30b-a3b"):
        (res / model).mkdir()
        (res / model / "matrix.json").write_text("{}")
        (res / model / "matrix.md").write_text("#")
    (res / "steps.json").write_text('{"build": {"seconds": 1, "exit": 0}}')
    (res / "modes.json").write_text('{"modes": {}}')
    (res / "gpu-tests.log").write_text("==> tests/gpu/test_a.py\nPASSED tests/gpu/test_a.py::t\n")
    (res / "pipeline.log").write_text("log")
    (prefix / "build.log").write_text("x" * 1000 + "\n[5/9] nvcc\n")
    copied = gpu_pipeline.collect(res, prefix, out)
    assert sorted(copied) == sorted(p.name for p in out.iterdir())
    assert set(copied) == {"gpt-oss-20b.json", "gpt-oss-20b.md", "qwen3-30b-a3b.json", "qwen3-30b-a3b.md",
                           "loan.json", "pipeline.log", "build-tail.log"}
    assert len(copied) <= 8  # what the device tool brings back
    loan = json.loads((out / "loan.json").read_text())
    assert loan["steps"]["build"]["exit"] == 0 and loan["modes"] == {"modes": {}} and "PASSED tests/gpu/test_a.py::t" in loan["gpu_tests"]


@pytest.mark.parametrize(("files", "want"), [
    (["trace.npz", "real-routing.npz"], "real-routing.npz"),  # public real routing first (issue 27)
    (["trace.npz"], "trace.npz"),  # a pack made without ../shared
])
def test_the_trace_rows_replay_real_routing_when_packed(tmp_path, files, want):
    for f in files:
        (tmp_path / f).write_bytes(b"x")
    assert gpu_pipeline.default_trace(tmp_path) == tmp_path / want


# (a CPU run, libstdc++ found, LD_PRELOAD of every engine run)
PRELOADS = [
    (False, True, "/lib/libstdc++.so.6"),  # a GPU machine: both loans segfaulted loading a model without it
    (False, False, None),
    (True, True, None),  # the CPU smoke run: nothing preloaded
]


@pytest.mark.parametrize(("cpu", "found", "kept"), PRELOADS)
def test_engine_runs_preload_libstdcxx_on_a_gpu_machine(tmp_path, monkeypatch, cpu, found, kept):
    monkeypatch.setattr(gpu_pipeline, "find_libstdcxx", lambda: "/lib/libstdc++.so.6" if found else None)
    p = gpu_pipeline.Pipeline(tmp_path, tmp_path / "prefix", tmp_path / "pack", ["toy"], cpu, tmp_path / "t.npz",
                              tmp_path, [], [])
    calls = []
    monkeypatch.setattr(p, "run", lambda name, cmd, env=None: calls.append(env.get("LD_PRELOAD")) or 0)
    assert p.engine_check(tmp_path / "m.gguf") == 0
    assert calls == [kept] and p.engine_env().get("LD_PRELOAD") == kept


def test_tests_digest_keeps_outcomes_and_an_aborts_cause(tmp_path):
    log = tmp_path / "gpu-tests.log"
    log.write_text("==> tests/gpu/test_a.py\nllama_model_load: noise\nPASSED tests/gpu/test_a.py::t[x]\n"
                   "FAILED tests/gpu/test_a.py::t[y] - AssertionError\nE   assert 0 > 0\n<== test_a.py: exit 1\n"
                   "==> tests/gpu/test_b.py\nllama.cpp: CUDA error: an illegal memory access was encountered\n"
                   "llama.cpp aborted the process: ggml-cuda.cu:90: CUDA error\nFatal Python error: Aborted\n"
                   "  File \"x.py\", line 3\n<== test_b.py: exit -6\n")
    got = gpu_pipeline.tests_digest(log).splitlines()
    assert got == ["==> tests/gpu/test_a.py", "PASSED tests/gpu/test_a.py::t[x]",
                   "FAILED tests/gpu/test_a.py::t[y] - AssertionError", "E   assert 0 > 0", "<== test_a.py: exit 1",
                   "==> tests/gpu/test_b.py", "llama.cpp: CUDA error: an illegal memory access was encountered",
                   "llama.cpp aborted the process: ggml-cuda.cu:90: CUDA error", "Fatal Python error: Aborted",
                   "<== test_b.py: exit -6"]


from tools.gpu import modes as gpu_modes  # noqa: E402

_R = {"hits": 5, "misses": 3}
# (mode, its tokens, its hits, its prompt drift, ok, why): stock's tokens are [1, 2, 3]
VERDICTS = [
    ("sync", [1, 2, 3], 5, 0.0, True, None),
    ("sync", [1, 2, 4], 5, 0.0, False, "tokens differ from stock's from token 2"),
    ("async", [1, 2, 3], 0, 0.0, False, "the async decode never hit its cache"),
    ("host", [1, 9, 9], 5, 0.001, True, None),  # the CPU's kernels round otherwise: tokens part, logits stay
    ("host", [1, 9, 9], 5, 0.4, False, "its prompt's logits differ from stock's by 0.400 of their size (> 0.05)"),
    ("host", [1, 2, 3], 0, 0.0, False, "the host decode never hit its cache"),
]


@pytest.mark.parametrize(("mode", "tokens", "hits", "drift", "ok", "why"), VERDICTS)
def test_mode_verdicts(mode, tokens, hits, drift, ok, why):
    got = gpu_modes.verdicts({"tokens": [1, 2, 3]}, {mode: {**_R, "tokens": tokens, "hits": hits}},
                             {mode: drift})[mode]
    assert got["ok"] == ok and got.get("why") == why
    assert got["same_as_stock"] == next((i for i, t in enumerate(tokens) if t != i + 1), 3)
    assert got["prompt_drift"] == drift


# (host's drift, the CPU-experts floor's (None: not run), ok): host is judged against the larger of 5 % and
# what stock drifts with every expert on the CPU
FLOOR = [(0.075, None, False), (0.075, 0.09, True), (0.075, 0.06, False), (0.04, 0.01, True)]


@pytest.mark.parametrize(("host", "floor", "ok"), FLOOR)
def test_host_is_judged_against_the_cpus_rounding_floor(host, floor, ok):
    drift = {"host": host, **({gpu_modes.FLOOR: floor} if floor is not None else {})}
    got = gpu_modes.verdicts({"tokens": [1, 2, 3]}, {"host": {**_R, "tokens": [1, 9, 9], "hits": 5}}, drift)["host"]
    assert got["ok"] is ok
    assert ok or ("rounding floor" in got["why"]) is (floor is not None)


def test_prompt_drift_reads_the_children_logits(tmp_path):
    import numpy as np

    np.save(gpu_modes.logits_path(tmp_path, "stock"), np.array([2.0, -4.0, 1.0], dtype=np.float32))
    np.save(gpu_modes.logits_path(tmp_path, "host"), np.array([2.0, -3.0, 1.0], dtype=np.float32))
    np.save(gpu_modes.logits_path(tmp_path, "sync"), np.array([2.0, -4.0, 1.0], dtype=np.float32))
    assert gpu_modes.prompt_drift(tmp_path, ["host", "sync", "async"]) == {"host": 0.25, "sync": 0.0}
    assert gpu_modes.prompt_drift(tmp_path / "none", ["host"]) == {}


def test_mode_verdicts_carry_a_failed_run():
    got = gpu_modes.verdicts({"tokens": [1]}, {"split": {"error": "killed by signal 11: x", "seconds": 1.0}})["split"]
    assert not got["ok"] and got["why"] == "killed by signal 11: x" and "same_as_stock" not in got


# --------------------------------------------------------------------------- MoEpic's split rows (issue 18)

from tools.gpu import estimate as gpu_estimate  # noqa: E402


def test_split_rows_are_planned_below_100_percent_and_by_default():
    from tools.gpu.matrix import DEFAULT_CONFIGS, GGMOE, SPLIT

    assert set(SPLIT) <= set(DEFAULT_CONFIGS) and set(SPLIT) <= set(GGMOE)  # the pipeline runs the defaults
    plan = plan_cells(["random", "trace"], ["lru", "async", "split", "split-async"], [0.5, 0.25, 1.0])
    assert [p for p in plan if p[0] == "random" and p[2] == 1.0] == [("random", "lru", 1.0), ("random", "async", 1.0)]
    assert ("trace", "split-async", 0.25) in plan and ("trace", "split", 1.0) not in plan
    assert len(plan) == 2 * (4 + 4 + 2)


@pytest.mark.parametrize("preset,want,n_top", [
    ("qwen3-30b-a3b", "1/2", 512),  # 768 neurons in Q4_K blocks of 256: 2/3 is the smallest >= 1/2
    ("qwen3-30b-a3b", "0.3", 256),
    ("qwen3-30b-a3b", "3/4", None),  # rounds up to the whole expert
    ("gpt-oss-20b", "0.5", 1440),  # 2880 in MXFP4 blocks of 32
    ("gpt-oss-20b", "3/4", 2176),  # 67.5 blocks -> 68
    ("toy", "0.5", 256),
])
def test_split_theta_rounds_up_to_the_down_tensors_blocks(preset, want, n_top):
    from ggmoe.cache.split import layer_split
    from tools.gpu.matrix import split_theta

    layer = gpu_estimate.preset_layer(preset)
    assert layer.bytes_per_expert == gpu_estimate.expert_bytes(preset)
    t = split_theta(layer, want)
    if n_top is None:
        assert t is None
        return
    s = layer_split(layer, t)
    assert s.n_top == n_top and s.top_bytes + s.bottom_bytes == s.expert_bytes
    assert s.top_bytes == pytest.approx(s.expert_bytes * n_top / s.n_ff)


def test_split_slots_fit_the_whole_experts_bytes():
    from ggmoe.cache.split import layer_split
    from tools.gpu.matrix import split_slots

    layer = gpu_estimate.preset_layer("qwen3-30b-a3b")
    s = layer_split(layer, 2 / 3)
    bpe = {0: layer.bytes_per_expert, 1: layer.bytes_per_expert}
    assert split_slots(32, {0: s, 1: s}, bpe, 128) == {0: 48, 1: 48}  # 25 %: 32 whole experts' bytes, 48 tops
    assert split_slots(64, {0: s}, bpe, 128) == {0: 96}
    assert split_slots(100, {0: s}, bpe, 128) == {0: 128}  # at most every expert
    g = layer_split(gpu_estimate.preset_layer("gpt-oss-20b"), 0.5)
    assert split_slots(16, {0: g}, {0: gpu_estimate.expert_bytes("gpt-oss-20b")}, 32) == {0: 32}


def test_the_split_goal_and_table():
    from tools.gpu.matrix import table

    cells = [_cell("random", "lru", 0.25, 50.0), _cell("random", "async", 0.25, 40.0),
             dataclasses.replace(_cell("random", "split", 0.25, 60.0), theta=2 / 3, top_hit_rate=0.7, slots=48,
                                 hit_rate=0.0, cache_bytes=2 * 10**9, decode_mode="sync"),
             _cell("random", "split-async", 0.25, 55.0)]
    g = [x for x in goals(cells) if "25 %" in x["goal"]]
    assert len(g) == 1 and g[0]["value"] == pytest.approx(60 / 50) and g[0]["met"]
    assert "best split (split)" in g[0]["goal"] and "best whole-expert LRU (lru)" in g[0]["goal"]
    g = [x for x in goals(cells[:2] + [_cell("random", "split", 0.25, 45.0)]) if "25 %" in x["goal"]]
    assert g[0]["value"] == pytest.approx(45 / 50) and not g[0]["met"]
    md = table(cells)
    assert "| 48 tops (θ 0.67) | 2 |" in md and "0.0% (top 70.0%)" in md
    assert all(line.count("|") == md.splitlines()[0].count("|") for line in md.splitlines())


def _tiny_trace(path, n_prompts=3, n_prefill=8, n_decode=24, seed=0):
    """A trace shaped like the embedded model's (8 layers, 32 experts, top-4), with some locality."""
    from ggmoe.trace.format import STAGE_DECODE, STAGE_PREFILL, Trace, TraceMeta, write_trace

    rng = np.random.default_rng(seed)
    t = n_prompts * (n_prefill + n_decode)
    hot = rng.permutation(32)[:12]
    ids = np.empty((t, 8, 4), dtype=np.int16)
    for i in range(t):
        for j in range(8):
            pool = hot if rng.random() < 0.7 else np.arange(32)
            ids[i, j] = rng.choice(pool, size=4, replace=False)
    probs = np.zeros((t, 8, 32), dtype=np.float16)
    for i in range(t):
        for j in range(8):
            probs[i, j, ids[i, j]] = 0.25
    stage = np.tile(np.array([STAGE_PREFILL] * n_prefill + [STAGE_DECODE] * n_decode, dtype=np.uint8), n_prompts)
    meta = TraceMeta(model_fingerprint="fp", model_name="tiny", arch="qwen3moe", n_layer=8, n_expert=32,
                     n_expert_used=4, n_embd=4, mode="teacher", max_tokens=n_decode, ggmoe_version="test",
                     n_ubatch=512)
    per = n_prefill + n_decode
    write_trace(Trace(meta=meta, token_ids=np.arange(t, dtype=np.int32), positions=np.arange(t, dtype=np.int32) % per,
                      stage=stage, prompt_offsets=np.arange(0, t + 1, per, dtype=np.int64),
                      layers=np.arange(8, dtype=np.int32), ids=ids, probs=probs, hidden=None), path)
    return path


def test_estimate_split_rows_on_the_toy_shape(tmp_path):
    path = _tiny_trace(tmp_path / "t.npz")
    e = gpu_estimate.estimate("toy", path, "h100", [0.25], ["1/3", "1/2", "2/3"], [0.25])
    assert set(e["tpot_ms_estimate"]) == {"stock-vram", "stock-cpu", "n-cpu-moe 25%", "lru 25%", "async 25%"}
    geo = e["split"]["geometry"]
    assert [g["n_top"] for g in geo] == [256]  # 1/3, 1/2 and 2/3 of 512 in blocks of 256: only 256 below 512
    rows = e["split"]["rows"]
    assert [(r["config"], r["mode"]) for r in rows] == [("lru", "sync"), ("split", "sync"), ("async", "async"),
                                                       ("split-async", "async")]
    whole, split = rows[0], rows[1]
    assert whole["tpot_ms"] == pytest.approx(e["tpot_ms_estimate"]["lru 25%"])
    assert split["slots"] == 2 * whole["slots"] and split["vram_bytes"] == whole["vram_bytes"]  # the same bytes
    assert split["theta"] == 0.5 and split["x_whole_lru"] == pytest.approx(whole["tpot_ms"] / split["tpot_ms"])
    assert split["hit_rate"] == 0.0 < split["top_hit_rate"]  # no predictor: no bottom is ever on the device
    assert split["top_hit_rate"] > whole["hit_rate"]  # twice the tops
    assert split["read_mb_per_token"] > 0 and whole["read_mb_per_token"] == 0.0  # sync LRU waits for copies
    lines = gpu_estimate.split_table(e)
    assert len(lines) == 2 + len(rows) and "ESTIMATES" in lines[0]


# --------------------------------------------------------------------------- a child that dies in teardown

def _completed(rc: int, stdout: str = "", stderr: str = ""):
    import subprocess

    return subprocess.CompletedProcess([], rc, stdout, stderr)


ABORT = "llama.cpp aborted the process: ggml-backend.cpp:426: GGML_ASSERT(backend) failed"
MODE_CHILD = [  # (exit, stdout, what the parent keeps: tokens, error's start or None)
    (0, '{"tokens": [1, 2], "hits": 3}\n', [1, 2], None),
    (-6, 'noise\n{"tokens": [1, 2], "hits": 3}\n', [1, 2], "decoded, then died in teardown: killed by signal 6"),
    (-6, "", None, "killed by signal 6"),
    (1, "not json\n", None, "exit 1"),
]


@pytest.mark.parametrize(("rc", "stdout", "tokens", "error"), MODE_CHILD)
def test_a_mode_that_dies_in_teardown_keeps_what_it_decoded(rc, stdout, tokens, error, monkeypatch, tmp_path):
    """The fourth loan: every cached mode decoded, then aborted closing the engine, and its tokens were lost."""
    import argparse

    from tools.gpu import modes

    monkeypatch.setattr(modes.subprocess, "run", lambda *a, **k: _completed(rc, stdout, ABORT))
    a = argparse.Namespace(model=tmp_path / "m.gguf", out=tmp_path, fraction=0.5, tokens=2, cpu=True, timeout=5.0)
    got = modes.run_mode(a, "sync")
    assert got.get("tokens") == tokens
    assert (got.get("error") or None) is None if error is None else got["error"].startswith(error)
    if error is not None:
        assert modes.verdicts({"tokens": [1, 2]}, {"sync": got})["sync"]["ok"] is False


@pytest.mark.parametrize(("rc", "written", "teardown"), [(0, True, False), (-6, True, True), (-6, False, False)])
def test_a_matrix_cell_measured_before_its_process_died_keeps_its_figures(rc, written, teardown, monkeypatch,
                                                                         tmp_path):
    import argparse

    from tools.gpu import matrix

    measured = _cell("random", "lru", 0.5, 42.0)

    def child(cmd, **kw):
        if written:
            Path(cmd[cmd.index("--cell-json") + 1]).write_text(json.dumps(dataclasses.asdict(measured)))
        return _completed(rc, "", ABORT)

    monkeypatch.setattr(matrix.subprocess, "run", child)
    a = argparse.Namespace(model=tmp_path / "m.gguf", cell_timeout=5.0)
    cell = matrix.cell_in_process(a, [], "random", "lru", 0.5, None, None)
    assert (cell.decode_tps == 42.0) is written
    assert (cell.teardown_error is not None) is teardown
    assert (cell.error is None) is written
    table = matrix.table([cell])
    assert ("†" in table) is teardown and ("failed:" in table) is (not written)


# the fourth loan's engine check, as its child printed it (faulthandler on)
LOAN4_STDERR = """llama.cpp aborted the process: /tmp/ggmoe-gpu/src/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-backend.cpp:426: GGML_ASSERT(backend) failed
Fatal Python error: Aborted

Current thread 0x00007f941b68cb80 (most recent call first):
  File "/work/main/ggmoe/engine/streams.py", line 142 in synchronize
  File "/work/main/ggmoe/engine/runtime.py", line 187 in quiesce
  File "/work/main/ggmoe/engine/pipeline.py", line 489 in detach
  File "/usr/lib/python3.12/contextlib.py", line 478 in _exit_wrapper
  File "/work/main/ggmoe/engine/engine.py", line 332 in close
  File "<string>", line 1 in <module>

Extension modules: markupsafe._speedups, numpy._core._multiarray_umath (total: 2)
"""
CAUSES = [
    (LOAN4_STDERR, "GGML_ASSERT(backend) failed | at engine/streams.py:142 synchronize < engine/runtime.py:187 "
                   "quiesce < engine/pipeline.py:489 detach"),
    ("a\nb\nc\nd\n", "b | c | d"),  # nothing recognised: the last three lines
    ("Traceback:\n  File \"/x/ggmoe/cli/run.py\", line 3 in main\nValueError: no\n", "ValueError: no | at cli/run.py:3 main"),
]


@pytest.mark.parametrize(("stderr", "want"), CAUSES)
def test_a_dead_childs_cause_names_the_abort_and_where_python_was(stderr, want):
    from tools.gpu.faults import cause

    got = cause(stderr)
    assert got.endswith(want) and (got == want or "GGML_ASSERT" in want)


def test_cpu_us_per_expert_by_hand():
    """Issue 42's comparison: TPOT less stock-vram's over the experts the CPU computed per token."""
    from tools.gpu.matrix import cpu_experts_per_token, cpu_us_per_expert, table

    assert cpu_experts_per_token("stock-cpu", None, 48, 8, None, 100) == 384
    assert cpu_experts_per_token("n-cpu-moe", 36, 48, 8, None, 100) == 96  # 12 layers left on the CPU
    assert cpu_experts_per_token("lru-host", 64, 48, 8, 500, 100) == 5.0
    assert cpu_experts_per_token("lru", 64, 48, 8, 0, 100) is None
    vram = _cell("random", "stock-vram", None, 200.0)  # 5 ms
    cpu = dataclasses.replace(_cell("random", "n-cpu-moe", 0.5, 100.0), cpu_experts_per_token=96.0)  # 10 ms
    assert cpu_us_per_expert(cpu, vram.tpot_ms) == pytest.approx(5e3 / 96)
    assert cpu_us_per_expert(_cell("random", "lru", 0.5, 150.0), vram.tpot_ms) is None
    md = table([vram, cpu, _cell("random", "lru", 0.5, 0.0, error="OOM")])
    assert f"| {5e3 / 96:.0f} |" in md
    assert all(line.count("|") == md.splitlines()[0].count("|") for line in md.splitlines())


@pytest.mark.parametrize("config, miss", [("async-fill", "wait"), ("async-fill-host", "cpu"),
                                          ("async-fill-auto", "auto"), ("async", "wait")])
def test_the_async_rows_name_their_miss_policy(config, miss):
    """The async rows run the engine's async decode with fills (all but ``async``), and the host part's rows
    name the miss policy that turns it on; the other async rows run without a host part."""
    from types import SimpleNamespace

    from tools.gpu.matrix import engine_config

    facts = SimpleNamespace(n_expert=32, n_expert_used=4, moe_layers=[0, 1])
    cfg, slots = engine_config(Path("m.gguf"), config, 0.5, facts, 2, 256, None)
    decode = cfg.run.decode
    assert (decode.mode, decode.miss_policy, decode.fills, slots) == ("async", miss, config != "async", 16)
    assert decode.identity == (config != "async")  # async measures the tables with every expert cached


def test_the_cpu_beside_the_link_and_the_full_cache_goals_by_hand():
    """At 50 %: the fastest CPU-beside-the-link row against the fastest without the CPU, async-fill included.
    Every expert cached: async-fill (identity) against stock-vram, and against the tables (async)."""
    cells = [_cell("random", "lru", 0.5, 60.0), _cell("random", "async", 0.5, 70.0),
             _cell("random", "async-fill", 0.5, 100.0), _cell("random", "hybrid", 0.5, 90.0),
             _cell("random", "async-fill-host", 0.5, 130.0), _cell("random", "stock-vram", None, 200.0),
             _cell("random", "async-fill", 1.0, 196.0), _cell("random", "async", 1.0, 180.0)]
    g = {x["goal"]: x for x in goals(cells) if x["routing"] == "random"}
    beside = g["decode at 50 %: the CPU beside the link (async-fill-host) / the best without it (async-fill)"]
    assert beside["value"] == pytest.approx(1.3) and beside["met"]
    assert g["decode, every expert cached: async-fill / stock-vram"]["value"] == pytest.approx(0.98)
    identity = g["decode, every expert cached: identity (async-fill) / the tables (async)"]
    assert identity["value"] == pytest.approx(196 / 180) and identity["met"]
    assert not [x for x in goals(cells[:3]) if "CPU beside" in x["goal"]]  # no CPU row: no goal
