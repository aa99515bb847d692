"""How a MoE model's router turns logits into probabilities, selections and weights: llama.cpp's gating.

llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp) computes, per token, from the router logits
``ffn_gate_inp @ x (+ ffn_gate_inp.bias)``:

- ``probs`` (the graph's ``ffn_moe_probs``, what the route op hands on) = gating(logits): softmax,
  sigmoid, sqrt(softplus), or the logits themselves for ``softmax_weight`` (gpt-oss);
- the selection scores: probs + ``exp_probs_b`` (DeepSeek-V3's selection-only bias), the raw logits for
  llama4; with ``n_expert_groups > 1`` only the ``n_group_used`` groups whose two best scores sum highest;
- the routing weights of the selected experts: their probs, softmaxed over the selection
  (``softmax_weight``), divided by their sum (``expert_weights_norm``), times ``expert_weights_scale``.

Which gating a model uses comes from its architecture (some graphs hard-code it: src/models/*.cpp of the
vendored llama.cpp) and its hparams (``{arch}.expert_gating_func``, ``.expert_weights_norm``,
``.expert_weights_scale``, ``.expert_group_count``, ``.expert_group_used_count``), read as llama.cpp's
loader reads them: an architecture whose loader does not read a key ignores it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import gguf
import numpy as np

Keys = gguf.Keys

# llama_expert_gating_func_type (src/llama-hparams.h) -> ggmoe's name; 0 (NONE) means "not set"
GATING_FUNCS: dict[int, str] = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}


@dataclass(frozen=True)
class Gating:
    """One model's gating, as its llama.cpp graph computes it."""

    func: str  # softmax | sigmoid | softmax_weight | sqrt_softplus: what the graph applies to the logits
    norm_w: bool  # the selected experts' weights divided by their sum (clamped at 6.1e-5)
    w_scale: float  # the weights multiplied by this (0 and 1: not scaled)
    n_expert_groups: int  # > 1: group-limited selection over this many equal groups of experts
    n_group_used: int  # groups a token may select from (with n_expert_groups > 1)
    select_on_logits: bool = False  # llama4: top-k over the raw logits, not the gated probabilities
    # llama4 (llama.cpp's weight_before_ffn): the routing weight scales the MoE input before the expert matmuls,
    # so the input a matmul reads differs per expert and the mailbox (patch 0010) hands the host ids only
    weight_before_ffn: bool = False

    @property
    def hook_gives_logits(self) -> bool:
        """Whether the graph's "probs" are the raw router logits (gpt-oss's softmax over the selected ones):
        the hook then converts them (``true_probs``) and hands the logits on under their own name."""
        return self.func == "softmax_weight"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line, e.g. "sigmoid, weights normalised, scaled 2.5, 8 groups (4 used)"."""
        parts = [{"softmax_weight": "softmax over the selected experts' logits"}.get(self.func, self.func)]
        if self.select_on_logits:
            parts.append("selected on the logits")
        if self.norm_w:
            parts.append("weights normalised")
        if self.w_scale not in (0.0, 1.0):
            parts.append(f"scaled {self.w_scale:g}")
        if self.n_expert_groups > 1:
            parts.append(f"{self.n_expert_groups} groups ({self.n_group_used} used)")
        return ", ".join(parts)


@dataclass(frozen=True)
class _ArchRule:
    """What an architecture's graph passes to build_moe_ffn (None: the hparam its loader reads)."""

    func: str | None  # fixed gating, or None: expert_gating_func (default below)
    func_default: str  # when the key is absent (NONE)
    norm_w: bool | None  # fixed, or None: expert_weights_norm (default false)
    reads_scale: bool  # whether the loader reads expert_weights_scale (else 0: not scaled)
    select_on_logits: bool = False
    weight_before_ffn: bool = False


def _fixed(func: str, norm_w: bool, reads_scale: bool = False, **kw: bool) -> _ArchRule:
    return _ArchRule(func, func, norm_w, reads_scale, **kw)


_KEYS = _ArchRule(None, "softmax", None, True)  # every key read; an architecture not listed below

# From the vendored llama.cpp: src/models/<file>.cpp, its load_arch_hparams and its build_moe_ffn call.
ARCH_RULES: dict[str, _ArchRule] = {
    "llama": _fixed("softmax", True),  # llama.cpp: Mixtral
    "qwen2moe": _fixed("softmax", False),
    "qwen3moe": _fixed("softmax", True),
    "qwen3next": _fixed("softmax", True),
    "qwen35moe": _fixed("softmax", True),
    "olmoe": _fixed("softmax", False),
    "granitemoe": _fixed("softmax", True),
    "ernie4_5-moe": _fixed("softmax", True),
    "hunyuan-moe": _fixed("softmax", True),
    "deepseek": _fixed("softmax", False, reads_scale=True),
    "gpt-oss": _fixed("softmax_weight", False),  # openai-moe.cpp: LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT
    "llama4": _fixed("sigmoid", False, select_on_logits=True, weight_before_ffn=True),  # llama4.cpp, llama-graph.cpp
    "deepseek2": _KEYS,  # default softmax (DeepSeek V2/V2.5 files without the key)
    "glm4moe": _ArchRule(None, "sigmoid", None, True),  # glm4-moe.cpp: GLM-4.5 defaults to sigmoid
    "dots1": _KEYS,
    "bailingmoe2": _KEYS,
    "minimax-m2": _ArchRule(None, "softmax", True, False),
}


def _int(kv: dict[str, Any], key: str, default: int) -> int:
    v = kv.get(key, default)
    return v if type(v) is int else default


def gating_from_kv(arch: str, kv: dict[str, Any]) -> Gating:
    """The gating of a model of architecture ``arch`` with header key/values ``kv``."""
    rule = ARCH_RULES.get(arch, _KEYS)
    func = rule.func
    if func is None:
        func = GATING_FUNCS.get(_int(kv, Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch), 0), rule.func_default)
    norm_w = rule.norm_w
    if norm_w is None:
        norm_w = kv.get(Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch)) is True
    scale = kv.get(Keys.LLM.EXPERT_WEIGHTS_SCALE.format(arch=arch), 0.0) if rule.reads_scale else 0.0
    groups = _int(kv, Keys.LLM.EXPERT_GROUP_COUNT.format(arch=arch), 0)
    return Gating(func=func, norm_w=norm_w, w_scale=float(scale) if isinstance(scale, (int, float)) else 0.0,
                  n_expert_groups=groups,
                  n_group_used=_int(kv, Keys.LLM.EXPERT_GROUP_USED_COUNT.format(arch=arch), 0) if groups > 1 else 0,
                  select_on_logits=rule.select_on_logits, weight_before_ffn=rule.weight_before_ffn)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32."""
    x = np.asarray(x, dtype=np.float32)
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def gate(func: str, logits: np.ndarray) -> np.ndarray:
    """What the graph calls probs (``ffn_moe_probs``) for router logits [..., n_expert], float32."""
    logits = np.asarray(logits, dtype=np.float32)
    if func == "softmax":
        return softmax(logits)
    if func == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if func == "sqrt_softplus":
        return np.sqrt(np.logaddexp(0.0, logits)).astype(np.float32)
    if func == "softmax_weight":
        return logits
    raise ValueError(f"unknown gating function {func!r}")


def true_probs(gating: Gating, graph_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The graph's probs [..., n_expert] -> (router probabilities, raw logits or None).

    For ``softmax_weight`` (gpt-oss) the graph's probs are the biased logits: the probabilities are their
    softmax over every expert (the selected experts' weights are these, renormalised over the selection)."""
    if gating.hook_gives_logits:
        return softmax(graph_probs), np.asarray(graph_probs, dtype=np.float32)
    return graph_probs, None
