#!/usr/bin/env python3
"""The simulator's estimate of the GPU matrix, without a GPU: the real shapes on a hardware profile.

For each real-shape preset (tools/gpu/realshape.py's gpt-oss-20b and qwen3-30b-a3b), the held-out trace of
the embedded model is tiled over the preset's layers and experts exactly as trace-replay routing does on the
GPU (trace_routing.tile_trace), the bytes per expert come from the preset's quant type, and the simulator
replays the routing through ggmoe's own cache and controller on the profile (default h100: an H100's
calibrated link, CPU and route hook; the zero-copy rate quoted from nvbandwidth until the probe measures it):

    stock-vram, stock-cpu, n-cpu-moe (at the cache's VRAM), lru (sync), async

at each fraction of experts cacheable, then MoEpic's split beside whole-expert LRU at the same VRAM bytes
(--split-fractions, default 25 and 50 %): for each top share θ of --thetas (each rounded up to what the
preset's down tensor can represent: a whole number of its quant blocks; duplicates and θ that round to the
whole expert dropped), as many top segments per layer as fit the bytes of the whole-expert LRU's slots, in
the sync and the async decode (LRU, no predictor: a top-only hit reads the bottom, a miss the whole expert,
from pinned host memory at the profile's zero-copy rate). Each split row also gives what crossed the link
per decoded token (bytes read in place + bytes copied into slots; the prefills' micro-batches take the
native path in every row below 100 %, so these are the decode's). Every figure printed is an ESTIMATE of
the cost model, labelled so; tools/gpu/matrix.py measures the same rows (split, split-async) on a GPU.

    python tools/gpu/estimate.py --trace gpu-pack/trace.npz [--presets gpt-oss-20b,qwen3-30b-a3b] [--hw h100]
                                 [--thetas 1/3,1/2,2/3,3/4] [--split-fractions 0.25,0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools.* when run as a file
from ggmoe.cache.hardware import load_profile  # noqa: E402
from ggmoe.cache.split import LayerSplit, layer_split, tops_in  # noqa: E402
from ggmoe.inspect.facts import ExpertTensor, MoeLayer  # noqa: E402
from ggmoe.simulate.des import SimConfig, SimResult, baseline, simulate  # noqa: E402
from ggmoe.trace import load_traces  # noqa: E402
from tools.gpu.matrix import split_theta  # noqa: E402
from tools.gpu.realshape import PRESETS, plan_for, tensor_bytes, tensor_type  # noqa: E402
from tools.gpu.trace_routing import model_trace, routing_name  # noqa: E402

DEFAULT_THETAS = "1/3,1/2,2/3,3/4"


def expert_bytes(preset: str) -> int:
    """Bytes of one expert of the preset: up, gate and down, n_embd x n_ff_exp each, in its quant type."""
    p = PRESETS[preset]
    block, size = gguf.GGML_QUANT_SIZES[p.expert_type]  # weights per block, bytes per block
    return 3 * p.shape.n_embd * p.shape.n_ff_exp // block * size


def preset_layer(preset: str, il: int = 0) -> MoeLayer:
    """Layer ``il``'s routed experts as realshape.py writes them (types, shapes, bytes), without a file: what
    the split's geometry (ggmoe.cache.split) needs."""
    plan, p = plan_for(preset)
    tensors = []
    for t in plan.tensors:
        if not t.name.startswith(f"blk.{il}.") or "_exps" not in t.name:
            continue
        q = tensor_type(t, p.expert_type)
        nbytes = tensor_bytes(t, q)
        tensors.append(ExpertTensor(t.name, t.name.split(".", 2)[2], q.name, tuple(t.ne), nbytes,
                                    nbytes // p.shape.n_expert, "", 0))
    return MoeLayer(il, tuple(sorted(tensors, key=lambda t: t.kind)))


def preset_splits(preset: str, thetas: list[str]) -> list[LayerSplit]:
    """The preset's splits for the asked top shares, each rounded up to a representable θ; duplicates and θ
    that round to the whole expert dropped; in ascending θ."""
    layer = preset_layer(preset)
    out: dict[int, LayerSplit] = {}
    for want in thetas:
        t = split_theta(layer, Fraction(want))
        if t is not None:
            s = layer_split(layer, t)
            out.setdefault(s.n_top, s)
    return [out[k] for k in sorted(out)]


def _row(r: SimResult, config: str, mode: str, fraction: float, slots: int, vram: int, theta: float | None,
         whole: float | None = None) -> dict:
    """One split-section row of a simulation: TPOT, hits, and what crossed the link per decoded token."""
    t = r.stats["total"]
    n = max(r.decode_tokens, 1)
    row = {"config": config, "mode": mode, "fraction": fraction, "theta": theta, "slots": slots,
           "vram_bytes": vram, "tpot_ms": r.tpot_s * 1e3, "hit_rate": t["hit_rate"], "top_hit_rate": t["top_hit_rate"],
           "read_mb_per_token": t["host_read_bytes"] / n / 1e6, "copied_mb_per_token": t["bytes_copied"] / n / 1e6,
           "link_busy_ms_per_token": r.link_busy_s / n * 1e3}
    if whole is not None:
        row["x_whole_lru"] = whole / row["tpot_ms"]  # > 1: faster than whole-expert LRU in the same mode
    return row


def estimate(preset: str, trace_path: Path, hw: str, fractions: list[float], thetas: list[str] | None = None,
             split_fractions: list[float] | None = None) -> dict:
    p = PRESETS[preset]
    layers = tuple(range(p.shape.n_layer))
    src = load_traces([str(trace_path)])
    trace = model_trace(src, layers, p.shape.n_expert, p.shape.n_expert_used, preset)
    bpe = dict.fromkeys(layers, expert_bytes(preset))
    profile = load_profile(hw)
    rows: dict[str, float] = {}
    whole: dict[tuple[str, float], SimResult] = {}  # (mode, fraction) -> whole-expert LRU's result

    def slots_at(f: float) -> int:
        return max(p.shape.n_expert_used, min(p.shape.n_expert, round(f * p.shape.n_expert)))

    def lru(mode: str, f: float) -> SimResult:
        if (mode, f) not in whole:
            whole[mode, f] = simulate(trace, SimConfig(dict.fromkeys(layers, slots_at(f)), decode_mode=mode), bpe,
                                      profile)
        return whole[mode, f]

    for kind in ("stock-vram", "stock-cpu"):
        rows[kind] = baseline(trace, kind, bpe, profile).tpot_s
    for f in fractions:
        n = slots_at(f)
        budget = n * sum(bpe.values())
        rows[f"n-cpu-moe {f:.0%}"] = baseline(trace, "n-cpu-moe", bpe, profile, budget).tpot_s
        for mode, name in (("sync", "lru"), ("async", "async")):
            rows[f"{name} {f:.0%}"] = lru(mode, f).tpot_s
    split_rows: list[dict] = []
    splits = preset_splits(preset, thetas or [])
    for f in split_fractions or []:
        n = slots_at(f)
        for mode in ("sync", "async"):
            ref = lru(mode, f)
            split_rows.append(_row(ref, "lru" if mode == "sync" else "async", mode, f, n, n * sum(bpe.values()), None))
            for s in splits:
                tops = tops_in({0: s}, {0: n}, bpe, p.shape.n_expert)[0]
                sp = {il: LayerSplit(il, s.theta, s.n_ff, s.n_top, s.kinds) for il in layers}
                r = simulate(trace, SimConfig(dict.fromkeys(layers, tops), decode_mode=mode, split=sp), bpe, profile)
                split_rows.append(_row(r, "split" if mode == "sync" else "split-async", mode, f, tops,
                                       tops * s.top_bytes * len(layers), s.n_top / s.n_ff, ref.tpot_s * 1e3))
    out = {"preset": preset, "what": p.what, "bytes_per_expert": bpe[0], "profile": hw, "routing": routing_name(src),
           "tpot_ms_estimate": {k: v * 1e3 for k, v in rows.items()}}
    if split_rows:
        out["split"] = {"geometry": [{"theta": s.n_top / s.n_ff, "n_top": s.n_top, "n_ff": s.n_ff,
                                      "top_bytes": s.top_bytes, "bottom_bytes": s.bottom_bytes} for s in splits],
                        "rows": split_rows}
    return out


def split_table(e: dict) -> list[str]:
    """The split section of one preset's estimate, as printed lines."""
    lines = [f"MoEpic's split beside whole-expert LRU at the same VRAM ({e['what'].split(':')[0]}; ESTIMATES); "
             "geometry: " + ", ".join(f"θ {g['n_top']}/{g['n_ff']}: top {g['top_bytes'] / 1e6:.2f} MB, bottom "
                                       f"{g['bottom_bytes'] / 1e6:.2f} MB" for g in e["split"]["geometry"]),
             f"{'row':<13}{'mode':<6}{'cacheable':>10}{'θ':>6}{'slots':>7}{'VRAM GB':>9}{'TPOT ms':>9}"
             f"{'x whole':>9}{'hit':>7}{'top hit':>9}{'MB/token read + copied':>24}{'link ms/token':>15}"]
    for r in e["split"]["rows"]:
        theta = "-" if r["theta"] is None else f"{r['theta']:.2f}"
        x = f"{r['x_whole_lru']:.2f}" if "x_whole_lru" in r else "-"
        link = f"{r['read_mb_per_token']:.1f} + {r['copied_mb_per_token']:.1f}"
        lines.append(f"{r['config']:<13}{r['mode']:<6}{r['fraction']:>10.0%}{theta:>6}{r['slots']:>7}"
                     f"{r['vram_bytes'] / 1e9:>9.2f}{r['tpot_ms']:>9.2f}{x:>9}{r['hit_rate']:>7.1%}"
                     f"{r['top_hit_rate']:>9.1%}{link:>24}{r['link_busy_ms_per_token']:>15.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, type=Path, help="a trace of the embedded model (gpu-pack/trace.npz)")
    ap.add_argument("--presets", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--hw", default="h100", help="hardware profiles (names or .toml files, comma list)")
    ap.add_argument("--fractions", default="0.25,0.5,1.0")
    ap.add_argument("--thetas", default=DEFAULT_THETAS,
                    help="the split rows' top shares (numbers or fractions), each rounded up to what the preset's "
                         "down tensor can represent; empty: no split rows")
    ap.add_argument("--split-fractions", default="0.25,0.5", help="fractions of the experts' bytes for the split rows")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    fractions = [float(x) for x in a.fractions.split(",") if x]
    split_fractions = [float(x) for x in a.split_fractions.split(",") if x]
    thetas = [x for x in a.thetas.split(",") if x]
    for x in thetas:
        try:
            ok = 0 < Fraction(x) < 1
        except (ValueError, ZeroDivisionError):
            ok = False
        if not ok:
            raise SystemExit(f"error: --thetas: {x!r} is not a top share in (0, 1)")
    out = [estimate(name, a.trace, hw, fractions, thetas, split_fractions)
           for hw in a.hw.split(",") if hw for name in a.presets.split(",") if name]
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
        if "split" in e:
            print()
            print("\n".join(split_table(e)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
