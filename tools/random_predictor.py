"""Random-weight predictor files (the ``ggmoe-predictor`` format) for a model's shape, from a seed.

For tests (fixtures) and speed benchmarks, where what a net computes matters and what it predicts does not:

    python tools/random_predictor.py [MODEL] -o OUT.npz [--kind mlp|linear] [--hidden 1024] [--stride 2] [--mode token]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ggmoe.inspect import inspect_model
from ggmoe.inspect.fingerprint import model_fingerprint
from ggmoe.predict.mlp_file import write_predictor_file


def random_predictor_file(model: Path, out: Path, kind: str = "mlp", stride: int = 1, hidden: int = 64,
                          seed: int = 0, mode: str = "layer") -> Path:
    """One net per source layer predicting the layer ``stride`` MoE layers ahead (mode token: its own layer at
    the next token), random weights. Mode layer files are written as format version 1 (no mode field), as
    files from before the mode existed."""
    facts = inspect_model(model)
    layers = list(facts.moe_layers)
    d, e = facts.n_embd, facts.n_expert
    rng = np.random.default_rng(seed)
    nets, arrays = [], {}
    pairs = [(il, il) for il in layers] if mode == "token" else list(zip(layers, layers[stride:], strict=False))
    for i, (il, target) in enumerate(pairs):
        nets.append({"il": il, "targets": [target], "metrics": {}})
        p = f"net{i}."
        if kind == "mlp":
            arrays |= {p + "w1": (rng.standard_normal((hidden, d)) / np.sqrt(d)).astype(np.float32),
                       p + "b1": rng.standard_normal(hidden).astype(np.float32) * 0.1,
                       p + "w2": (rng.standard_normal((e, hidden)) / np.sqrt(hidden)).astype(np.float32),
                       p + "b2": rng.standard_normal(e).astype(np.float32) * 0.1}
        else:
            arrays |= {p + "w": (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32),
                       p + "b": rng.standard_normal(e).astype(np.float32) * 0.1}
        arrays |= {p + "mean": rng.standard_normal(d).astype(np.float32) * 0.1,
                   p + "std": rng.uniform(0.5, 2.0, d).astype(np.float32)}
    meta = {"format": "ggmoe-predictor", "version": 1, "kind": kind, "model_fingerprint": model_fingerprint(model),
            "model_name": model.name, "layers": layers, "n_expert": e, "n_expert_used": facts.n_expert_used,
            "n_embd": d, "dtype": "float32", "hidden": hidden if kind == "mlp" else 0, "nets": nets}
    if mode != "layer":
        meta |= {"version": 2, "mode": mode}
    return write_predictor_file(out, meta, arrays)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ggmoe.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", type=Path, default=None, help="default: the embedded model")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--kind", choices=("mlp", "linear"), default="mlp")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("layer", "token"), default="layer")
    a = ap.parse_args(argv)
    out = random_predictor_file(a.model or default_model_path(), a.out, a.kind, a.stride, a.hidden, a.seed, a.mode)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
