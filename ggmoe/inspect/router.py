"""The routers of a GGUF MoE model, recomputed in numpy.

Used to verify the gate hook (router of layer l applied to the hooked MoE input
must give the hooked ids) and by the skip-gate predictor (router of layer l+s
applied to the hidden state of layer l). Weights are read once, dequantized to
float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ggmoe.base.errors import ModelFileError
from ggmoe.inspect.gating import Gating, gate, gating_from_kv, softmax, true_probs
from ggmoe.inspect.reader import TensorInfo, read_header


@dataclass(frozen=True)
class Router:
    """Layer ``il``'s router and the model's gating (``ggmoe.inspect.gating``), as llama.cpp computes them."""

    il: int
    weight: np.ndarray  # [n_expert, n_embd] float32 (ffn_gate_inp)
    bias: np.ndarray | None  # [n_expert] float32 (ffn_gate_inp.bias), added to the logits
    selection_bias: np.ndarray | None  # [n_expert] float32 (exp_probs_b), only for choosing
    gating: Gating

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n_tokens, n_embd] -> router logits [n_tokens, n_expert] float32 (with the router bias)."""
        logits = hidden.astype(np.float32) @ self.weight.T
        return logits + self.bias if self.bias is not None else logits

    def probs(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n_tokens, n_embd] -> router probabilities [n_tokens, n_expert] float32, as the hook reports
        them (``gating.true_probs``: for softmax-weight gating the softmax of the logits over every expert)."""
        return true_probs(self.gating, gate(self.gating.func, self.logits(hidden)))[0]

    def selection_scores(self, hidden: np.ndarray) -> np.ndarray:
        """The scores top-k selects on [n_tokens, n_expert]: the graph's probs plus the selection bias (the raw
        logits for llama4), other groups at -inf under group-limited selection."""
        logits = self.logits(hidden)
        score = logits if self.gating.select_on_logits else gate(self.gating.func, logits)
        if self.selection_bias is not None and not self.gating.select_on_logits:
            score = score + self.selection_bias
        return _group_mask(score, self.gating.n_expert_groups, self.gating.n_group_used)

    def topk(self, hidden: np.ndarray, k: int) -> np.ndarray:
        """Selected experts [n_tokens, k] int32, highest score first (as llama.cpp's argsort)."""
        return np.argsort(-self.selection_scores(hidden), axis=-1, kind="stable")[:, :k].astype(np.int32)

    def weights(self, hidden: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The routing weights [n_tokens, k] float32 of the selected experts ``ids`` [n_tokens, k]: their graph
        probs, softmaxed over the selection (softmax-weight), normalised to sum 1, scaled."""
        g = self.gating
        w = np.take_along_axis(gate(g.func, self.logits(hidden)), np.asarray(ids, dtype=np.int64), axis=-1)
        if g.func == "softmax_weight":
            w = softmax(w)
        if g.norm_w:
            w = w / np.maximum(w.sum(axis=-1, keepdims=True), np.float32(6.103515625e-5))
        if g.w_scale not in (0.0, 1.0):
            w = w * np.float32(g.w_scale)
        return w.astype(np.float32)


def _group_mask(score: np.ndarray, n_groups: int, n_used: int) -> np.ndarray:
    """Group-limited selection (DeepSeek-V3): experts outside the ``n_used`` groups whose two best scores sum
    highest get -inf. ``n_groups`` <= 1: ``score`` unchanged."""
    if n_groups <= 1:
        return score
    n_tokens, n_expert = score.shape
    groups = score.reshape(n_tokens, n_groups, n_expert // n_groups)
    top2 = np.sort(groups, axis=-1)[..., -2:].sum(axis=-1)  # [n_tokens, n_groups]
    keep = np.argsort(-top2, axis=-1, kind="stable")[:, :n_used]
    mask = np.full((n_tokens, n_groups), -np.inf, dtype=np.float32)
    np.put_along_axis(mask, keep, 0.0, axis=-1)
    return (groups + mask[..., None]).reshape(n_tokens, n_expert)


def _read_tensor(t: TensorInfo) -> np.ndarray:
    """A tensor's data, dequantized to float32 numpy order (ne reversed); offsets checked by the reader."""
    raw = np.fromfile(t.file, dtype=np.uint8, count=t.nbytes, offset=t.data_offset)
    if raw.size != t.nbytes:
        raise ModelFileError(f"{t.file}: tensor {t.name} is truncated")
    shape = [int(d) for d in reversed(t.shape)]
    if t.qtype == gguf.GGMLQuantizationType.F32:
        data = raw.view(np.float32)
    elif t.qtype == gguf.GGMLQuantizationType.F16:
        data = raw.view(np.float16)
    else:
        data = gguf.quants.dequantize(raw.reshape(shape[:-1] + [-1]), t.qtype)
    return np.asarray(data, dtype=np.float32).reshape(shape)


def load_routers(path: str | Path) -> dict[int, Router]:
    """Every MoE layer's router, keyed by ``il``, read through the bounded reader (no trust in the file)."""
    path = Path(path)
    header = read_header(path)
    arch = header.kv.get(gguf.Keys.General.ARCHITECTURE, "")
    gating = gating_from_kv(arch, header.kv)
    tensors = {t.name: t for t in header.tensors}
    fmt = gguf.TENSOR_NAMES
    routers = {}
    for name in tensors:
        if not name.endswith("ffn_gate_inp.weight"):
            continue
        il = int(name.split(".")[1])
        base_inp = fmt[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=il)
        base_b = fmt[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B].format(bid=il)

        def get(n: str) -> np.ndarray | None:
            return _read_tensor(tensors[n]) if n in tensors else None

        routers[il] = Router(il=il, weight=get(base_inp + ".weight"), bias=get(base_inp + ".bias"),
                             selection_bias=get(base_b + ".bias"), gating=gating)
    if not routers:
        raise ModelFileError(f"{path}: no ffn_gate_inp tensors: not a MoE model")
    return routers
