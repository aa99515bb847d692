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

from ggmoe.errors import ModelFileError
from ggmoe.inspect.reader import TensorInfo, read_header

_GATING = {int(gguf.ExpertGatingFuncType.SOFTMAX): "softmax", int(gguf.ExpertGatingFuncType.SIGMOID): "sigmoid"}


@dataclass(frozen=True)
class Router:
    il: int
    weight: np.ndarray  # [n_expert, n_embd] float32 (ffn_gate_inp)
    bias: np.ndarray | None  # [n_expert] float32 (ffn_gate_inp.bias), added to the logits
    selection_bias: np.ndarray | None  # [n_expert] float32 (exp_probs_b), only for choosing
    gating: str  # softmax | sigmoid

    def probs(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n_tokens, n_embd] -> router probabilities [n_tokens, n_expert] float32."""
        logits = hidden.astype(np.float32) @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        if self.gating == "sigmoid":
            return 1.0 / (1.0 + np.exp(-logits))
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)

    def topk(self, hidden: np.ndarray, k: int) -> np.ndarray:
        """Selected experts [n_tokens, k] int32, highest score first (as llama.cpp's argsort)."""
        score = self.probs(hidden)
        if self.selection_bias is not None:
            score = score + self.selection_bias
        return np.argsort(-score, axis=-1, kind="stable")[:, :k].astype(np.int32)


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
    gf = header.kv.get(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch))
    gating = _GATING.get(gf, "softmax") if type(gf) is int else "softmax"
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
