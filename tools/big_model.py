#!/usr/bin/env python3
"""A random-weight GGUF MoE model of a given total size, larger than RAM if asked: the disk tier's benchmark model.

The shape is one of the real-shape writer's presets (tools/gpu/realshape.py: qwen3-30b-a3b by default, n_embd
2048, 128 experts of width 768, top-8) with its experts in the type asked (Q8_0 by default: 4.8 MiB an
expert) and as many layers as the size takes: 32 GiB is 53 layers, the experts ~98 % of the bytes. The
matrices that add to the residual stream are scaled by 1/sqrt(2 n_layer) (GPT-2's rule): without it the
tokens of a 53-layer random model mostly route to the same few experts (top-8 of 128 take 2/3 of the uses),
a working set that fits in RAM. The writer is realshape's (one GGUF writer in tools/): quant blocks written
directly, one tensor in memory at a time, so a model larger than RAM streams to disk; deterministic in its
arguments.

A sidecar ``<model>.json`` records what was asked and the bytes written: a second call with the same
arguments finds the file and writes nothing.

Usage:
    python tools/big_model.py                                   # ~/.cache/ggmoe/big/qwen3-30b-a3b-q8_0-32GiB.gguf
    python tools/big_model.py --size 50MB --base toy -o /tmp/small.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import gguf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))
from realshape import PRESETS, Preset, plan_for, tensor_bytes, tensor_type, write_model  # noqa: E402

QType = gguf.GGMLQuantizationType
EXPERT_TYPES: dict[str, QType] = {"q8_0": QType.Q8_0, "q4_k": QType.Q4_K, "mxfp4": QType.MXFP4}
DEFAULT_SIZE = 32 << 30  # bytes: above the 24 GiB of RAM of the machine the benchmark was written for
DEFAULT_BASE = "qwen3-30b-a3b"


def _model_bytes(p: Preset, n_layer: int) -> tuple[int, int]:
    """(tensor bytes of the whole model, of its routed experts) with ``n_layer`` layers."""
    plan, _ = plan_for(dataclasses.replace(p, shape=dataclasses.replace(p.shape, n_layer=n_layer)))
    sizes = [(t, tensor_bytes(t, tensor_type(t, p.expert_type, p.down_type))) for t in plan.tensors]
    return sum(n for _, n in sizes), sum(n for t, n in sizes if "_exps." in t.name)


def big_preset(size: int, base: str = DEFAULT_BASE, expert_type: str = "q8_0") -> Preset:
    """``base``'s shape with ``expert_type`` experts and the number of layers whose bytes come nearest ``size``."""
    if base not in PRESETS:
        raise SystemExit(f"error: unknown base {base!r}; choose one of {', '.join(sorted(PRESETS))}")
    if expert_type not in EXPERT_TYPES:
        raise SystemExit(f"error: unknown expert type {expert_type!r}; choose one of {', '.join(EXPERT_TYPES)}")
    p = dataclasses.replace(PRESETS[base], expert_type=EXPERT_TYPES[expert_type])
    one, two = _model_bytes(p, 1)[0], _model_bytes(p, 2)[0]
    per_layer, fixed = two - one, 2 * one - two  # bytes: every layer's, and the embeddings' and head's
    n_layer = max(1, round((size - fixed) / per_layer))
    shape = dataclasses.replace(p.shape, n_layer=n_layer)
    what = f"{base}'s shape, {n_layer} layers, {expert_type} experts, ~{size / 2**30:.3g} GiB asked"
    return dataclasses.replace(p, shape=shape, what=what, residual_std=1 / math.sqrt(2 * n_layer))


def default_path(size: int = DEFAULT_SIZE, base: str = DEFAULT_BASE, expert_type: str = "q8_0") -> Path:
    """Where the benchmark looks for the model: $GGMOE_CACHE/big or ~/.cache/ggmoe/big."""
    root = os.environ.get("GGMOE_CACHE")
    cache = (Path(root) if root else Path.home() / ".cache" / "ggmoe") / "big"
    return cache / f"{base}-{expert_type}-{size / 2**30:.3g}GiB.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


# How the weights are drawn, recorded in the sidecar: a file written by other rules is written again.
# residual-1/sqrt(2L): GPT-2's scaling of the residual branches (realshape.Preset.residual_std)
WEIGHTS = "realshape, residual-1/sqrt(2L)"


def _asked(size: int, base: str, expert_type: str, seed: int) -> dict[str, object]:
    return {"size_asked": size, "base": base, "expert_type": expert_type, "seed": seed, "weights": WEIGHTS}


def existing(path: Path, size: int, base: str, expert_type: str, seed: int) -> dict | None:
    """The sidecar's record when ``path`` holds the model these arguments write (whole: its byte count
    matches), else None."""
    side = _sidecar(path)
    if not (path.is_file() and side.is_file()):
        return None
    try:
        rec = json.loads(side.read_text())
    except (OSError, ValueError):
        return None
    same = all(rec.get(k) == v for k, v in _asked(size, base, expert_type, seed).items())
    return rec if same and rec.get("bytes") == path.stat().st_size else None


def _progress_printer(every: float = 5.0):
    """A ``progress(done, total)`` that prints a line at most every ``every`` seconds (and at the end)."""
    t0 = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every or done == total:
            last = now
            rate = done / max(now - t0, 1e-9) / 2**20
            print(f"  {done / 2**30:6.2f} of {total / 2**30:.2f} GiB ({rate:.0f} MiB/s)", flush=True)

    return progress


def ensure_model(path: Path, size: int = DEFAULT_SIZE, base: str = DEFAULT_BASE, expert_type: str = "q8_0",
                 seed: int = 0, quiet: bool = False) -> tuple[dict, bool]:
    """Write the model to ``path`` unless the sidecar says it is there; returns (its record, whether written)."""
    rec = existing(path, size, base, expert_type, seed)
    if rec is not None:
        return rec, False
    p = big_preset(size, base, expert_type)
    total, experts = _model_bytes(p, p.shape.n_layer)
    if not quiet:
        print(f"writing {path}: {p.what}, {total / 2**30:.2f} GiB of tensors ({experts / total:.1%} experts)",
              flush=True)
    _sidecar(path).unlink(missing_ok=True)  # no record of a half-written file survives a crash
    out, nbytes, secs = write_model(p, path, seed, progress=None if quiet else _progress_printer(),
                                    label=f"big {base} {expert_type} {p.shape.n_layer} layers")
    rec = {**_asked(size, base, expert_type, seed), "n_layer": p.shape.n_layer, "n_embd": p.shape.n_embd,
           "n_expert": p.shape.n_expert, "n_expert_used": p.shape.n_expert_used, "n_ff_exp": p.shape.n_ff_exp,
           "bytes": nbytes, "expert_bytes": experts, "write_s": round(secs, 1)}
    _sidecar(out).write_text(json.dumps(rec, indent=2) + "\n")
    return rec, True


def main(argv: list[str] | None = None) -> int:
    from ggmoe.base.units import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="32GiB", help="total size, e.g. 32GiB or 50MB (default 32GiB)")
    ap.add_argument("--base", default=DEFAULT_BASE, choices=sorted(PRESETS), help="realshape preset: the shape")
    ap.add_argument("--expert-type", default="q8_0", choices=sorted(EXPERT_TYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", type=Path, help="model path (default: ~/.cache/ggmoe/big/<base>-<type>-<size>.gguf)")
    a = ap.parse_args(argv)
    size = parse_bytes(a.size)
    path = a.out or default_path(size, a.base, a.expert_type)
    rec, written = ensure_model(path, size, a.base, a.expert_type, a.seed)
    verb = f"wrote in {rec['write_s']} s" if written else "already there"
    print(f"{path}: {rec['bytes'] / 2**30:.2f} GiB, {rec['n_layer']} layers x {rec['n_expert']} experts "
          f"(top-{rec['n_expert_used']}), {verb}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
