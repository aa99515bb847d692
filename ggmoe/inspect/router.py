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


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == name:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            return np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
    return None


def load_routers(path: str | Path) -> dict[int, Router]:
    """Every MoE layer's router, keyed by ``il``."""
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises many kinds on bad files
        raise ModelFileError(f"cannot read {path}: {e}") from e
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = field.contents() if field is not None else ""
    gf = reader.get_field(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch))
    gating = _GATING.get(int(gf.contents()), "softmax") if gf is not None else "softmax"
    routers = {}
    fmt = gguf.TENSOR_NAMES
    for t in reader.tensors:
        if not t.name.endswith("ffn_gate_inp.weight"):
            continue
        il = int(t.name.split(".")[1])
        base_inp = fmt[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=il)
        base_b = fmt[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B].format(bid=il)
        weight = _tensor(reader, base_inp + ".weight")
        routers[il] = Router(il=il, weight=weight, bias=_tensor(reader, base_inp + ".bias"),
                             selection_bias=_tensor(reader, base_b + ".bias"), gating=gating)
    if not routers:
        raise ModelFileError(f"{path}: no ffn_gate_inp tensors: not a MoE model")
    return routers
