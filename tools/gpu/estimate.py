#!/usr/bin/env python3
"""The simulator's estimate of the GPU matrix, without a GPU: the real shapes on a hardware profile.

For each real-shape preset (tools/gpu/realshape.py's gpt-oss-20b and qwen3-30b-a3b), the held-out trace of
the embedded model is tiled over the preset's layers and experts exactly as trace-replay routing does on the
GPU (trace_routing.tile_trace), the bytes per expert come from the preset's quant type, and the simulator
replays the routing through ggmoe's own cache and controller on the profile (default h100: the first loan's
measured link, CPU and route hook; the zero-copy rate quoted from nvbandwidth until the probe measures it):

    stock-vram, stock-cpu, n-cpu-moe (at the cache's VRAM), lru (sync), async

at each fraction of experts cacheable. Every figure printed is an ESTIMATE of the cost model, labelled so;
tools/gpu/matrix.py measures the same rows on a GPU.

    python tools/gpu/estimate.py --trace gpu-pack/trace.npz [--presets gpt-oss-20b,qwen3-30b-a3b] [--hw h100]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realshape import PRESETS  # noqa: E402
from trace_routing import ROUTING_NAME, tile_trace  # noqa: E402

from ggmoe.cache.hardware import load_profile  # noqa: E402
from ggmoe.simulate.des import SimConfig, baseline, simulate  # noqa: E402
from ggmoe.trace import load_traces  # noqa: E402


def expert_bytes(preset: str) -> int:
    """Bytes of one expert of the preset: up, gate and down, n_embd x n_ff_exp each, in its quant type."""
    p = PRESETS[preset]
    block, size = gguf.GGML_QUANT_SIZES[p.expert_type]  # weights per block, bytes per block
    return 3 * p.shape.n_embd * p.shape.n_ff_exp // block * size


def estimate(preset: str, trace_path: Path, hw: str, fractions: list[float]) -> dict:
    p = PRESETS[preset]
    layers = tuple(range(p.shape.n_layer))
    trace = tile_trace(load_traces([str(trace_path)]), layers, p.shape.n_expert, p.shape.n_expert_used, preset)
    bpe = dict.fromkeys(layers, expert_bytes(preset))
    profile = load_profile(hw)
    rows: dict[str, float] = {}
    for kind in ("stock-vram", "stock-cpu"):
        rows[kind] = baseline(trace, kind, bpe, profile).tpot_s
    for f in fractions:
        n = max(p.shape.n_expert_used, min(p.shape.n_expert, round(f * p.shape.n_expert)))
        budget = n * sum(bpe.values())
        rows[f"n-cpu-moe {f:.0%}"] = baseline(trace, "n-cpu-moe", bpe, profile, budget).tpot_s
        for mode, name in (("sync", "lru"), ("async", "async")):
            r = simulate(trace, SimConfig(dict.fromkeys(layers, n), decode_mode=mode), bpe, profile)
            rows[f"{name} {f:.0%}"] = r.tpot_s
    return {"preset": preset, "what": p.what, "bytes_per_expert": bpe[0], "profile": hw, "routing": ROUTING_NAME,
            "tpot_ms_estimate": {k: v * 1e3 for k, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, type=Path, help="a trace of the embedded model (gpu-pack/trace.npz)")
    ap.add_argument("--presets", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--hw", default="h100", help="hardware profile (name or .toml)")
    ap.add_argument("--fractions", default="0.25,0.5,1.0")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    fractions = [float(x) for x in a.fractions.split(",") if x]
    out = [estimate(name, a.trace, a.hw, fractions) for name in a.presets.split(",") if name]
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    for e in out:
        t = e["tpot_ms_estimate"]
        vram = t["stock-vram"]
        print(f"\n{e['what']} ({e['bytes_per_expert'] / 1e6:.2f} MB per expert); profile {e['profile']}; "
              f"ESTIMATES of the simulator, {e['routing']}")
        print(f"{'row':<16}{'TPOT ms':>10}{'x all-in-VRAM':>15}{'x n-cpu-moe':>13}")
        for k, v in t.items():
            frac = k.split()[-1] if " " in k else None
            ncpu = t.get(f"n-cpu-moe {frac}") if frac else None
            print(f"{k:<16}{v:>10.2f}{vram / v:>15.2f}{(ncpu / v if ncpu else float('nan')):>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
