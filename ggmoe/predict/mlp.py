"""The ``mlp`` predictor (ProMoE): per source layer, a two-layer MLP from the MoE input to expert scores.

File format ``ggmoe-predictor`` version 1: one ``.npz`` (``allow_pickle=False``) holding
every trained net of one training run: all the source layers asked for, for one
or several strides, or the multi-target nets (one net per source layer predicting
the next up to 6 MoE layers at once). Arrays, for net i with H hidden units,
n_embd inputs and T target layers:

==============  ===================  ==========================  ==========================================
name            dtype                shape                       meaning
==============  ===================  ==========================  ==========================================
``meta``        uint8                [n_bytes]                   UTF-8 JSON, see below
``net{i}.w1``   float32 or float16   [H, n_embd]                 first layer (torch ``nn.Linear`` layout)
``net{i}.b1``   same                 [H]
``net{i}.w2``   same                 [T * n_expert, H]           output: target t is rows t*E:(t+1)*E
``net{i}.b2``   same                 [T * n_expert]
``net{i}.mean`` float32              [n_embd]                    input normalisation, from the training
``net{i}.std``  float32              [n_embd]                    prompts: x = (hidden - mean) / std
==============  ===================  ==========================  ==========================================

``meta``: ``format``, ``version``, ``kind`` ("mlp"), ``model_fingerprint``,
``model_name``, ``layers`` (MoE layers of the model), ``n_expert``,
``n_expert_used``, ``n_embd``, ``dtype``, ``hidden``, ``nets`` (per net: ``il``
source layer, ``targets`` target layers, ``metrics``) and ``training`` (the
settings, the split and the time). Scores are ``sigmoid(w2 relu(w1 x + b1) + b2)``,
computed in float32 whatever the stored dtype.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggmoe.errors import PredictorFileError, UsageError
from ggmoe.predict.base import PREDICTORS, ModelShape, Predictor

FORMAT = "ggmoe-predictor"
VERSION = 1
KIND = "mlp"
DTYPES = ("float32", "float16")
NET_KEYS = ("w1", "b1", "w2", "b2", "mean", "std")


@dataclass(frozen=True)
class Net:
    """One loaded net, weights pre-transposed to float32 for ``x @ w``."""

    il: int  # source MoE layer
    targets: tuple[int, ...]  # target MoE layers, column block t*E:(t+1)*E of the output
    w1t: np.ndarray  # [n_embd, H] float32
    b1: np.ndarray  # [H] float32
    w2t: np.ndarray  # [H, T * n_expert] float32
    b2: np.ndarray  # [T * n_expert] float32
    mean: np.ndarray  # [n_embd] float32
    std: np.ndarray  # [n_embd] float32, > 0

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n, n_embd] -> logits [n, T * n_expert] float32."""
        x = (hidden.astype(np.float32, copy=False) - self.mean) / self.std
        a = np.maximum(x @ self.w1t + self.b1, 0.0)
        return a @ self.w2t + self.b2


@dataclass(frozen=True)
class MLPFile:
    meta: dict
    nets: tuple[Net, ...]


def _fail(path: Path, msg: str) -> PredictorFileError:
    return PredictorFileError(f"{path}: {msg}")


def _read_meta(path: Path, raw: np.ndarray) -> dict:
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise _fail(path, "meta must be a uint8 vector of UTF-8 JSON")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"bad metadata: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(path, f"not a ggmoe predictor file (format {meta.get('format') if isinstance(meta, dict) else meta!r})")
    if meta.get("version") != VERSION:
        raise _fail(path, f"predictor format version {meta.get('version')} is not supported (this is {VERSION})")
    if meta.get("kind") != KIND:
        raise _fail(path, f"predictor kind {meta.get('kind')!r}, expected {KIND!r}")
    need = ("model_fingerprint", "layers", "n_expert", "n_expert_used", "n_embd", "dtype", "hidden", "nets")
    missing = [k for k in need if k not in meta]
    if missing:
        raise _fail(path, f"metadata lacks {missing}")
    for key in ("n_expert", "n_expert_used", "n_embd", "hidden"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 1:
            raise _fail(path, f"metadata {key} must be a positive integer, not {meta[key]!r}")
    if not isinstance(meta["layers"], list) or not all(isinstance(il, int) for il in meta["layers"]):
        raise _fail(path, "metadata layers must be a list of layer indices")
    if meta["dtype"] not in DTYPES:
        raise _fail(path, f"weight dtype {meta['dtype']!r} is not one of {DTYPES}")
    if not isinstance(meta["nets"], list) or not meta["nets"]:
        raise _fail(path, "metadata lists no nets")
    return meta


def _check_model(path: Path, meta: dict, shape: ModelShape) -> None:
    if meta["model_fingerprint"] != shape.model_fingerprint:
        raise _fail(path, f"made for model {meta['model_fingerprint']} ({meta.get('model_name', '?')}), "
                          f"not this model ({shape.model_fingerprint})")
    for key in ("n_expert", "n_expert_used", "n_embd"):
        if meta[key] != getattr(shape, key):
            raise _fail(path, f"{key} {meta[key]} does not match the model's {getattr(shape, key)}")
    if list(meta["layers"]) != list(shape.layers):
        raise _fail(path, f"MoE layers {meta['layers']} do not match the model's {list(shape.layers)}")


def _array(path: Path, z: np.lib.npyio.NpzFile, key: str, dtype: str, shape: tuple[int, ...] | None) -> np.ndarray:
    if key not in z.files:
        raise _fail(path, f"missing array {key}")
    try:
        a = z[key]
    except ValueError as e:  # object arrays need pickle: refused
        raise _fail(path, f"array {key} cannot be read without pickle ({e})") from e
    if a.dtype != np.dtype(dtype):
        raise _fail(path, f"{key}: dtype {a.dtype}, expected {dtype}")
    if shape is not None and a.shape != shape:
        raise _fail(path, f"{key}: shape {a.shape}, expected {shape}")
    if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
        raise _fail(path, f"{key}: contains NaN or infinity")
    return a


def _read_net(path: Path, z: np.lib.npyio.NpzFile, i: int, entry: dict, meta: dict) -> Net:
    try:
        il, targets = int(entry["il"]), tuple(int(t) for t in entry["targets"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(path, f"net {i}: bad entry {entry!r}") from e
    layers = list(meta["layers"])
    if il not in layers or not targets or any(t not in layers or t <= il for t in targets):
        raise _fail(path, f"net {i}: source {il} / targets {list(targets)} are not later MoE layers of {layers}")
    d, e, h, dt = int(meta["n_embd"]), int(meta["n_expert"]), int(meta["hidden"]), meta["dtype"]
    p = f"net{i}."
    w1 = _array(path, z, p + "w1", dt, (h, d))
    b1 = _array(path, z, p + "b1", dt, (h,))
    w2 = _array(path, z, p + "w2", dt, (len(targets) * e, h))
    b2 = _array(path, z, p + "b2", dt, (len(targets) * e,))
    mean = _array(path, z, p + "mean", "float32", (d,))
    std = _array(path, z, p + "std", "float32", (d,))
    if np.any(std <= 0):
        raise _fail(path, f"{p}std must be positive")
    f32 = np.float32
    return Net(il=il, targets=targets, w1t=np.ascontiguousarray(w1.T, dtype=f32), b1=b1.astype(f32),
               w2t=np.ascontiguousarray(w2.T, dtype=f32), b2=b2.astype(f32), mean=mean, std=std)


def load_mlp_file(path: str | Path, shape: ModelShape) -> MLPFile:
    """Read and validate a predictor file for the model ``shape``; PredictorFileError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PredictorFileError(f"predictor file not found: {path}")
    try:
        z = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:  # ValueError: a pickle or garbage
        raise _fail(path, f"not a readable .npz file ({e})") from e
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise _fail(path, "not an .npz archive")
    try:
        with z:
            if "meta" not in z.files:
                raise _fail(path, "missing array meta")
            meta = _read_meta(path, _array(path, z, "meta", "uint8", None))
            _check_model(path, meta, shape)
            nets = tuple(_read_net(path, z, i, entry, meta) for i, entry in enumerate(meta["nets"]))
            extra = set(z.files) - {"meta"} - {f"net{i}.{k}" for i in range(len(nets)) for k in NET_KEYS}
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise _fail(path, f"damaged .npz file ({e})") from e
    if extra:
        raise _fail(path, f"unexpected arrays {sorted(extra)}")
    return MLPFile(meta=meta, nets=nets)


@PREDICTORS.register("mlp")
class MLP(Predictor):
    """ProMoE's learned predictor, loaded from a ``ggmoe train-predictor`` file.

    ``predict`` returns None for a source layer the file has no net for (trained with ``--layers``).
    """

    needs_hidden = True

    def __init__(self, shape: ModelShape, stride: int = 1, path: str | Path | None = None) -> None:
        super().__init__(shape, stride)
        if path is None:
            raise UsageError("the mlp predictor needs a predictor file (PRED.npz)")
        self.path = Path(path)
        self.file = load_mlp_file(self.path, shape)
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

    def strides(self) -> list[int]:
        """The strides (in MoE layers) this file has nets for."""
        return sorted({self.shape.pos(b) - self.shape.pos(a) for a, b in self._route})

    def begin_token(self, token_id: int) -> None:
        self._src, self._hidden = None, None
        self._out.clear()

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        self._src, self._hidden = il, hidden
        self._out.clear()

    def predict(self, il_target: int) -> np.ndarray | None:
        if self._src is None or self._hidden is None:
            return None
        hit = self._route.get((self._src, il_target))
        if hit is None:
            return None
        net, off = hit
        out = self._out.get(id(net))
        if out is None:  # one forward per net and token serves all its targets
            out = self._out[id(net)] = net.logits(self._hidden[None])[0]
        z = out[off:off + self.shape.n_expert]
        return 1.0 / (1.0 + np.exp(-z))
