"""The ``mlp`` predictor (ProMoE): per source layer, a net from the MoE input to expert scores.

It runs any file of the ``ggmoe-predictor`` format (``ggmoe.predict.mlp_file``, which
documents the arrays): kind ``mlp``, the two-layer MLPs, and kind ``linear``, the
linear baseline without a hidden layer (``ggmoe train-predictor --kind linear``).
``PRED.npz`` given where a predictor name goes (``make_predictor``) means this predictor.

The caller says which ``mode`` it needs: ``layer`` (the stride prefetcher: ``predict`` scores a layer
``stride`` MoE layers ahead within the token) or ``token`` (the planner between tokens: ``predict_next``
scores layer il of the next token from layer il's input of this one). A file of the other mode, for another
model or without a net at the stride is refused in one message (``mlp_file.check_need``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import Param
from ggmoe.predict.base import PREDICTORS, FoldedNet, ModelShape, Predictor
from ggmoe.predict.mlp_file import MODES, Net, PredictorNeed, file_strides, load_mlp_file, read_predictor_file

__all__ = ["MLP", "load_mlp_file"]  # load_mlp_file: the file reader, re-exported under this predictor's name


@PREDICTORS.register("mlp")
class MLP(Predictor):
    """ProMoE's learned predictor (or the linear baseline), loaded from a ``ggmoe train-predictor`` file.

    ``predict`` returns None for a source layer the file has no net for (trained with ``--layers``).
    """

    needs_hidden = True
    PARAMS = (Param("path", Path, internal=True, help="the predictor file (PRED.npz)"),
              Param("mode", str, internal=True,
                    help="what the caller needs: layer (within a token) or token (the next token)"))

    def __init__(self, shape: ModelShape, stride: int = 1, path: str | Path | None = None,
                 mode: str = "layer") -> None:
        super().__init__(shape, stride)
        if path is None:
            raise UsageError("the mlp predictor needs a predictor file (PRED.npz)")
        if mode not in MODES:
            raise UsageError(f"mlp predictor mode {mode!r} is not one of {MODES}")
        self.path = Path(path)
        self.mode = mode
        # mode token: one token ahead, whatever stride the caller's other predictor uses
        self.file = read_predictor_file(self.path, PredictorNeed(shape, mode, stride if mode == "layer" else 1))
        # (source il, target il) -> (net, column offset); a later net wins if two cover a pair
        self._route: dict[tuple[int, int], tuple[Net, int]] = {}
        for net in self.file.nets:
            for t, il_t in enumerate(net.targets):
                self._route[(net.il, il_t)] = (net, t * shape.n_expert)
        self._src: int | None = None  # latest observed layer of the current token
        self._hidden: np.ndarray | None = None  # [n_embd] float32 its MoE input
        self._out: dict[int, np.ndarray] = {}  # id(net) -> logits [T * E] for the current token
        self._graph: dict[int, Net] = {}  # source il -> the net the engine computes in the graph
        self.predicts_next = mode == "token"

    def strides(self) -> list[int]:
        """The strides this file has nets for (MoE layers ahead; mode token: [1], one token ahead)."""
        return file_strides(self.file.meta)

    def begin_token(self, token_id: int) -> None:
        self._src, self._hidden = None, None
        self._out.clear()

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        self._src, self._hidden = il, hidden
        self._out.clear()

    def graph_net(self, il: int) -> FoldedNet | None:
        """The net for (il, the layer ``stride`` MoE layers ahead), folded for the engine's graph (mode layer
        only: a mode token net runs between tokens, in numpy)."""
        if self.mode == "token":
            return None
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
        if self._src is None or self.mode == "token":  # a mode token file says nothing within the token
            return None
        return self._scores(il_target)

    def predict_next(self, il: int) -> np.ndarray | None:
        """Mode token: the next token's scores at layer ``il`` from this token's input at ``il`` (just observed)."""
        if self.mode != "token" or self._src != il:
            return None
        return self._scores(il)

    def _scores(self, il_target: int) -> np.ndarray | None:
        """sigmoid of the logits of the net from the observed layer to ``il_target``, or None without one."""
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
