"""The ``mlp`` predictor (ProMoE): per source layer, a net from the MoE input to expert scores.

It runs any file of the ``ggmoe-predictor`` format (``ggmoe.predict.mlp_file``, which
documents the arrays): kind ``mlp``, the two-layer MLPs, and kind ``linear``, the
linear baseline without a hidden layer (``ggmoe train-predictor --kind linear``).
``PRED.npz`` given where a predictor name goes (``make_predictor``) means this predictor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ggmoe.errors import UsageError
from ggmoe.params import Param
from ggmoe.predict.base import PREDICTORS, FoldedNet, ModelShape, Predictor
from ggmoe.predict.mlp_file import Net, load_mlp_file, read_predictor_file

__all__ = ["MLP", "load_mlp_file"]  # load_mlp_file: the reader's name from when the format lived here


@PREDICTORS.register("mlp")
class MLP(Predictor):
    """ProMoE's learned predictor (or the linear baseline), loaded from a ``ggmoe train-predictor`` file.

    ``predict`` returns None for a source layer the file has no net for (trained with ``--layers``).
    """

    needs_hidden = True
    PARAMS = (Param("path", Path, internal=True, help="the predictor file (PRED.npz)"),)

    def __init__(self, shape: ModelShape, stride: int = 1, path: str | Path | None = None) -> None:
        super().__init__(shape, stride)
        if path is None:
            raise UsageError("the mlp predictor needs a predictor file (PRED.npz)")
        self.path = Path(path)
        self.file = read_predictor_file(self.path, shape)
        # (source il, target il) -> (net, column offset); a later net wins if two cover a pair
        self._route: dict[tuple[int, int], tuple[Net, int]] = {}
        for net in self.file.nets:
            for t, il_t in enumerate(net.targets):
                self._route[(net.il, il_t)] = (net, t * shape.n_expert)
        pairs = zip(shape.layers, shape.layers[stride:], strict=False)  # (source, target) of this stride
        if not any(pair in self._route for pair in pairs):
            raise UsageError(f"{self.path} has no net for stride {stride} (it covers strides {self.strides()})")
        self._src: int | None = None  # latest observed layer of the current token
        self._hidden: np.ndarray | None = None  # [n_embd] float32 its MoE input
        self._out: dict[int, np.ndarray] = {}  # id(net) -> logits [T * E] for the current token
        self._graph: dict[int, Net] = {}  # source il -> the net the engine computes in the graph

    def strides(self) -> list[int]:
        """The strides (in MoE layers) this file has nets for."""
        return sorted({self.shape.pos(b) - self.shape.pos(a) for a, b in self._route})

    def begin_token(self, token_id: int) -> None:
        self._src, self._hidden = None, None
        self._out.clear()

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        self._src, self._hidden = il, hidden
        self._out.clear()

    def graph_net(self, il: int) -> FoldedNet | None:
        """The net for (il, the layer ``stride`` MoE layers ahead), folded for the engine's graph."""
        j = self.shape.pos(il) + self.stride
        if j >= len(self.shape.layers):
            return None
        hit = self._route.get((il, self.shape.layers[j]))
        if hit is None:
            return None
        self._graph[il] = hit[0]
        return hit[0].folded()

    def observe_scores(self, il: int, scores: np.ndarray) -> None:
        net = self._graph.get(il)
        if net is not None and il == self._src:
            self._out[id(net)] = scores

    def predict(self, il_target: int) -> np.ndarray | None:
        if self._src is None:
            return None
        hit = self._route.get((self._src, il_target))
        if hit is None:
            return None
        net, off = hit
        out = self._out.get(id(net))
        if out is None:  # one forward per net and token serves all its targets
            if self._hidden is None:
                return None
            out = self._out[id(net)] = net.logits(self._hidden[None])[0]
        z = out[off:off + self.shape.n_expert]
        return 1.0 / (1.0 + np.exp(-z))
