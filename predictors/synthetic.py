"""Synthetic traces with planted routing, for the predictor tests and the training-time benchmark.

Every token belongs to a group g. Group g routes, at MoE layer position l, to a
fixed set of k experts ``sets[l, g]`` (router order as listed), with router
probabilities ``peak`` spread over that set and the rest uniform; its MoE input at
layer l is ``centroids[l, g] + noise * N(0, 1)``. So the right answer is known:

- ``group_by="token"``: a token's group is a fixed function of its token id, so the
  token id determines every layer's experts (token predictor: 100 %), and the hidden
  state of layer l determines the experts of every later layer (mlp: ~100 %);
- ``group_by="prompt"``: every token of a prompt has the prompt's group (a request
  group): each token reuses the previous token's experts (reuse: 100 % after the
  first token) and requests of one group have the same EAM and expert maps.

Numpy only (no torch); ``python -m predictors.synthetic OUT.npz --tokens 40000`` writes one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggmoe.base.hook import RouteEvent
from ggmoe.trace import STAGE_DECODE, STAGE_PREFILL, TraceMeta, TraceWriter


@dataclass(frozen=True)
class Planted:
    sets: np.ndarray  # [n_layer, n_groups, k] int, experts of group g at layer position l
    centroids: np.ndarray  # [n_layer, n_groups, n_embd] float32
    token_group: np.ndarray  # [vocab] int, the group of each token id (group_by="token")
    prompt_group: np.ndarray  # [n_prompts] int, the group of each prompt (group_by="prompt")
    groups: np.ndarray  # [T] int, the group of every traced token


def synthetic_meta(n_layer: int = 4, n_expert: int = 8, k: int = 2, n_embd: int = 16,
                   fingerprint: str = "5e17e71c0ffee000") -> TraceMeta:
    return TraceMeta(model_fingerprint=fingerprint, model_name="synthetic.gguf", arch="qwen3moe",
                     n_layer=n_layer, n_expert=n_expert, n_expert_used=k, n_embd=n_embd, mode="teacher",
                     max_tokens=0, ggmoe_version="synthetic")


def _plant(rng: np.random.Generator, meta: TraceMeta, n_groups: int, vocab: int, n_prompts: int) -> Planted:
    n_l, e, k = meta.n_layer, meta.n_expert, meta.n_expert_used
    sets = np.stack([np.stack([rng.permutation(e)[:k] for _ in range(n_groups)]) for _ in range(n_l)])
    centroids = rng.standard_normal((n_l, n_groups, meta.n_embd)).astype(np.float32)
    return Planted(sets=sets, centroids=centroids, token_group=rng.integers(0, n_groups, vocab),
                   prompt_group=rng.integers(0, n_groups, n_prompts), groups=np.zeros(0, np.int64))


def planted_trace(path: str | Path, n_prompts: int = 40, tokens: int = 24, meta: TraceMeta | None = None,
                  n_groups: int = 8, group_by: str = "token", noise: float = 0.1, peak: float = 0.9,
                  vocab: int = 64, prefill: int = 8, seed: int = 0, keep_hidden: bool = True) -> Planted:
    """Write a trace (``tokens`` per prompt: ``prefill`` in one step, the rest one per step)."""
    if group_by not in ("token", "prompt"):
        raise ValueError(f"group_by {group_by!r}")
    meta = meta or synthetic_meta()
    rng = np.random.default_rng(seed)
    plant = _plant(rng, meta, n_groups, vocab, n_prompts)
    n_l, e, k = meta.n_layer, meta.n_expert, meta.n_expert_used
    w = TraceWriter(meta, keep_hidden=keep_hidden)
    all_groups = []
    for p in range(n_prompts):
        toks = rng.integers(0, vocab, tokens)
        groups = plant.token_group[toks] if group_by == "token" else np.full(tokens, plant.prompt_group[p])
        all_groups.append(groups)
        steps = [slice(0, prefill)] + [slice(t, t + 1) for t in range(prefill, tokens)]
        for st in steps:
            g = groups[st]
            events = {}
            for j in range(n_l):
                ids = plant.sets[j, g]  # [n, k]
                probs = np.full((ids.shape[0], e), (1.0 - peak) / (e - k), dtype=np.float32)
                share = peak * np.linspace(1.5, 0.5, k) / k  # decreasing: router order = listed order
                np.put_along_axis(probs, ids, share[None].astype(np.float32), axis=1)
                hidden = plant.centroids[j, g] + noise * rng.standard_normal((ids.shape[0], meta.n_embd))
                events[j] = RouteEvent(il=j, ids=ids.astype(np.int32), probs=probs,
                                       hidden=hidden.astype(np.float32))
            w.add_step(toks[st].tolist(), st.start, STAGE_PREFILL if st.start == 0 else STAGE_DECODE, events)
        w.end_prompt()
    w.save(path)
    return Planted(sets=plant.sets, centroids=plant.centroids, token_group=plant.token_group,
                   prompt_group=plant.prompt_group, groups=np.concatenate(all_groups))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=40000, help="total tokens (prompts of --prompt-tokens)")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--group-by", choices=("token", "prompt"), default="token")
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    meta = synthetic_meta(a.layers, a.experts, a.k, a.embd)
    planted_trace(a.out, n_prompts=max(2, a.tokens // a.prompt_tokens), tokens=a.prompt_tokens, meta=meta,
                  n_groups=a.groups, group_by=a.group_by, noise=a.noise, vocab=4 * a.groups,
                  prefill=min(32, a.prompt_tokens), seed=a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
