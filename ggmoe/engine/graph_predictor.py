"""The in-graph predictor: a predictor's nets as ggml tensors that llama.cpp computes inside the decode graph.

Engine layer (ctypes allowed). With ``llama_ggmoe_set_predictor`` (patch 0005) a MoE layer's route op also
receives ``w2 relu(w1 inp + b1) + b2`` for the token, computed by the graph on the weights' device (the GPU
when there is one, else by ggml-cpu's threads): the predictor then costs the route callback only the
ranking and the prefetch bookkeeping, not its matmuls in numpy. Which nets: ``Predictor.graph_net(il)``
(the ``mlp`` predictor's nets for the prefetcher's stride, input normalisation folded in); their logits
reach ``Predictor.observe_scores`` through the route event.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ggmoe.base.errors import EngineError
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.arena import TensorArena
from ggmoe.predict.base import FoldedNet, Predictor


def device_buft() -> int:
    """The buffer type the graph's weights use: the first GPU's, else the CPU's."""
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    if dev:
        return B.libggml.ggml_backend_dev_buffer_type(dev)
    return B.libggml_cpu.ggml_backend_cpu_buffer_type()


class GraphPredictor:
    """Owns the tensors of the nets computed in the graph and registers them with the context, per layer.

    Close it after the context (the graphs read the tensors), or ``close(ctx_alive=True)`` to unregister
    first.
    """

    def __init__(self, ctx_ptr: int, nets: dict[int, FoldedNet], buft: int | None = None) -> None:
        self._ctx_ptr = ctx_ptr
        self.layers = tuple(sorted(nets))  # source MoE layers with a net in the graph
        self.arena = TensorArena(sum(4 if n.w1 is not None else 2 for n in nets.values()), "the predictor's tensors")
        try:
            arrays: list[tuple[int, np.ndarray]] = []  # (tensor, its data)
            per_layer: dict[int, list[int | None]] = {}
            for il, net in nets.items():
                made: list[int | None] = []
                for name, a in (("w1", net.w1), ("b1", net.b1), ("w2", net.w2), ("b2", net.b2)):
                    if a is None:
                        made.append(None)
                        continue
                    a = np.ascontiguousarray(a, dtype=np.float32)
                    ne0, ne1 = (a.shape[1], a.shape[0]) if a.ndim == 2 else (a.shape[0], 1)
                    made.append(self.arena.new_tensor(B.GGML_TYPE_F32, ne0, ne1, 1, f"ggmoe_pred.{il}.{name}"))
                    arrays.append((made[-1], a))
                per_layer[il] = made
            self.nbytes = self.arena.allocate(buft or device_buft())  # bytes of device memory the nets take
            for ptr, a in arrays:
                B.libggml_base.ggml_backend_tensor_set(ctypes.cast(ptr, B.ggml_tensor_p),
                                                       a.ctypes.data_as(ctypes.c_void_p), 0, a.nbytes)
            P = _patched.symbols()
            for il, (w1, b1, w2, b2) in per_layer.items():
                rc = P.llama_ggmoe_set_predictor(ctx_ptr, il, w1, b1, w2, b2)
                if rc != _patched.LLAMA_GGMOE_OK:
                    raise EngineError(f"the in-graph predictor of layer {il} was refused: "
                                      f"{_patched.ERROR_NAMES.get(rc, rc)}")
        except BaseException:
            self.close(ctx_alive=True)
            raise

    def close(self, ctx_alive: bool = False) -> None:
        """Free the tensors; with ``ctx_alive``, first take the predictor out of the context's graphs."""
        if ctx_alive and self._ctx_ptr:
            P = _patched.symbols()
            for il in self.layers:
                P.llama_ggmoe_set_predictor(self._ctx_ptr, il, None, None, None, None)
        self._ctx_ptr = None
        self.arena.close()


def attach_graph_predictor(ctx_ptr: int, predictor: Predictor, layers: Sequence[int]) -> GraphPredictor | None:
    """The predictor's nets in the graph of ``ctx_ptr``, or None when it has none (it computes in Python)."""
    nets = {il: n for il in layers if (n := predictor.graph_net(il)) is not None}
    if not nets:
        return None
    return GraphPredictor(ctx_ptr, nets)
