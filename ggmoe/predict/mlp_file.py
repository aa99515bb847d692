"""The predictor file format ``ggmoe-predictor`` version 2: constants, validation, reader and writer (numpy only).

One ``.npz`` (a zip of ``.npy`` members, no pickle) holds every net of one training
run. Its ``meta["mode"]`` says what the nets predict:

- ``layer`` (ProMoE's stride prediction, within a token): net i maps layer ``il``'s MoE input to
  the experts of later MoE layers ``targets`` of the SAME token; one or several strides, or the
  multi-target nets (one net per source layer predicting the next up to 6 MoE layers at once);
- ``token`` (cross-token, between tokens): net i maps layer ``il``'s MoE input of token t to the
  experts of the same layer ``il`` at token t + 1 (``targets`` is ``[il]``): one token ahead, its
  stride is 1.

Version 1 files have no ``mode`` and read as mode ``layer``. Two kinds of net, named
by ``meta["kind"]``; for net i with H hidden units, n_embd inputs and T target layers:

==============  ===================  ==========================  ==========================================
name            dtype                shape                       meaning
==============  ===================  ==========================  ==========================================
``meta``        uint8                [n_bytes]                   UTF-8 JSON object, see below
kind ``mlp`` (ProMoE's two-layer MLP, ``predictors/mlp.py``):
``net{i}.w1``   float32 or float16   [H, n_embd]                 first layer (torch ``nn.Linear`` layout)
``net{i}.b1``   same                 [H]
``net{i}.w2``   same                 [T * n_expert, H]           output: target t is rows t*E:(t+1)*E
``net{i}.b2``   same                 [T * n_expert]
kind ``linear`` (no hidden layer, ``predictors/linear.py``):
``net{i}.w``    float32 or float16   [T * n_expert, n_embd]      output: target t is rows t*E:(t+1)*E
``net{i}.b``    same                 [T * n_expert]
both kinds:
``net{i}.mean`` float32              [n_embd]                    input normalisation, from the training
``net{i}.std``  float32              [n_embd]                    prompts: x = (hidden - mean) / std
==============  ===================  ==========================  ==========================================

``meta``: ``format``, ``version``, ``kind``, ``mode`` (version 2), ``model_fingerprint``, ``model_name``,
``layers`` (MoE layers of the model), ``n_expert``, ``n_expert_used``, ``n_embd``,
``dtype``, ``hidden`` (0 for ``linear``), ``nets`` (per net: ``il`` source layer,
``targets`` target layers, ``metrics``) and ``training`` (the settings, the split,
the time). Scores are ``sigmoid(w2 relu(w1 x + b1) + b2)`` (mlp) or
``sigmoid(w x + b)`` (linear), computed in float32 whatever the stored dtype.

The reader trusts nothing in the file: it opens the zip itself and checks every
member's ``.npy`` header (dtype, shape, and that shape x itemsize is the member's
size) against what the validated metadata and the model say BEFORE reading its
data, so a lying header cannot make it allocate more than the model's nets need.
A file for another model, mode or stride than the caller needs (``PredictorNeed``) is
refused from its metadata alone, in one message naming what differs, before any net is read.
The writer writes atomically and reads its own output back before it replaces
anything, so it never leaves a file the reader would refuse.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggmoe.base import outputs
from ggmoe.base.errors import PredictorFileError
from ggmoe.base.npzfile import NpzMembers
from ggmoe.predict.base import FoldedNet, ModelShape

FORMAT = "ggmoe-predictor"
VERSION = 2  # what the writer writes
READS = (1, 2)  # versions the reader takes (1: no mode, read as mode layer)
KINDS = ("mlp", "linear")
MODES = ("layer", "token")  # within a token, layer il -> il + s; across tokens, layer il at t -> il at t + 1
DTYPES = ("float32", "float16")
NET_KEYS = {"mlp": ("w1", "b1", "w2", "b2", "mean", "std"), "linear": ("w", "b", "mean", "std")}
MAX_HIDDEN = 1 << 16  # hidden units; bounds what a file can make the reader allocate
MAX_META_BYTES = 16 << 20  # the JSON metadata (per-net metrics, the split) stays far below this
_META_KEYS = ("model_fingerprint", "layers", "n_expert", "n_expert_used", "n_embd", "dtype", "hidden", "nets")


@dataclass(frozen=True)
class Net:
    """One loaded net, weights pre-transposed to float32 for ``x @ w``."""

    il: int  # source MoE layer
    targets: tuple[int, ...]  # target MoE layers, column block t*E:(t+1)*E of the output
    w1t: np.ndarray | None  # [n_embd, H] float32; None for a linear net
    b1: np.ndarray | None  # [H] float32; None for a linear net
    w2t: np.ndarray  # [H, T * n_expert] float32 (linear: [n_embd, T * n_expert])
    b2: np.ndarray  # [T * n_expert] float32
    mean: np.ndarray  # [n_embd] float32
    std: np.ndarray  # [n_embd] float32, > 0

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n, n_embd] -> logits [n, T * n_expert] float32."""
        x = (hidden.astype(np.float32, copy=False) - self.mean) / self.std
        if self.w1t is not None:
            x = np.maximum(x @ self.w1t + self.b1, 0.0)
        return x @ self.w2t + self.b2

    def folded(self) -> FoldedNet:
        """The same function with the input normalisation folded into the first layer, in ggml's layout."""
        shift = self.mean / self.std  # x = h / std - mean / std
        if self.w1t is not None:
            w1 = np.ascontiguousarray((self.w1t / self.std[:, None]).T, dtype=np.float32)  # [H, n_embd]
            b1 = (self.b1 - shift @ self.w1t).astype(np.float32)
            return FoldedNet(w1, b1, np.ascontiguousarray(self.w2t.T, dtype=np.float32), self.b2)
        w2 = np.ascontiguousarray((self.w2t / self.std[:, None]).T, dtype=np.float32)  # [T * E, n_embd]
        return FoldedNet(None, None, w2, (self.b2 - shift @ self.w2t).astype(np.float32))


@dataclass(frozen=True)
class PredictorFile:
    meta: dict  # validated metadata (a version 1 file's carries mode "layer")
    nets: tuple[Net, ...]

    @property
    def kind(self) -> str:
        return str(self.meta["kind"])

    @property
    def mode(self) -> str:
        return str(self.meta["mode"])


@dataclass(frozen=True)
class PredictorNeed:
    """What a run needs of a predictor file: made for this model, in this mode, with a net at this stride (mode
    layer: MoE layers ahead within a token; mode token: tokens ahead, always 1)."""

    shape: ModelShape
    mode: str = "layer"
    stride: int | None = 1  # None: any stride the file has


MLPFile = PredictorFile  # the same record under the mlp predictor's name (public API)


def _fail(label: object, msg: str) -> PredictorFileError:
    return PredictorFileError(f"{label}: {msg}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --- metadata ---------------------------------------------------------------------------------


def check_meta(meta: object, label: object) -> dict:
    """The metadata of a predictor file, checked for types and consistency; PredictorFileError otherwise."""
    if not isinstance(meta, dict):
        raise _fail(label, f"metadata is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise _fail(label, f"not a ggmoe predictor file (format {meta.get('format')!r})")
    if not _is_int(meta.get("version")) or meta["version"] not in READS:
        raise _fail(label, f"predictor format version {meta.get('version')!r} is not supported "
                           f"(this ggmoe reads versions {', '.join(map(str, READS))})")
    _check_mode(meta, label)
    kind = meta.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise _fail(label, f"predictor kind {kind!r} is not one of {KINDS}")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise _fail(label, f"metadata lacks {missing}")
    if not isinstance(meta["model_fingerprint"], str) or not meta["model_fingerprint"]:
        raise _fail(label, f"metadata model_fingerprint must be a string, not {meta['model_fingerprint']!r}")
    for key in ("n_expert", "n_expert_used", "n_embd"):
        if not _is_int(meta[key]) or meta[key] < 1:
            raise _fail(label, f"metadata {key} must be a positive integer, not {meta[key]!r}")
    if meta["n_expert_used"] > meta["n_expert"]:
        raise _fail(label, f"metadata n_expert_used {meta['n_expert_used']} exceeds n_expert {meta['n_expert']}")
    _check_hidden(meta, label)
    layers = meta["layers"]
    if (not isinstance(layers, list) or len(layers) < 2 or not all(_is_int(il) and il >= 0 for il in layers)
            or layers != sorted(set(layers))):
        raise _fail(label, f"metadata layers must be at least 2 ascending layer indices, not {layers!r}")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in DTYPES:
        raise _fail(label, f"weight dtype {meta['dtype']!r} is not one of {DTYPES}")
    nets = meta["nets"]
    if not isinstance(nets, list) or not nets:
        raise _fail(label, "metadata lists no nets")
    if len(nets) > len(layers) ** 2:  # every (source, stride) pair plus a multi net per source fits
        raise _fail(label, f"metadata lists {len(nets)} nets, more than {len(layers)} MoE layers can have")
    for i, entry in enumerate(nets):
        _check_net_entry(label, i, entry, layers, meta["mode"])
    return meta


def _check_mode(meta: dict, label: object) -> None:
    """``meta["mode"]``: required from version 2; a version 1 file has none and is mode layer (set here)."""
    if meta["version"] == 1:
        if meta.setdefault("mode", "layer") != "layer":
            raise _fail(label, f"mode {meta['mode']!r} needs predictor format version 2 (version 1 is mode layer)")
        return
    mode = meta.get("mode")
    if not isinstance(mode, str) or mode not in MODES:
        raise _fail(label, f"predictor mode {mode!r} is not one of {MODES}")


def _check_hidden(meta: dict, label: object) -> None:
    h = meta["hidden"]
    if meta["kind"] == "linear":
        if h != 0 or not _is_int(h):
            raise _fail(label, f"metadata hidden must be 0 for a linear predictor, not {h!r}")
    elif not _is_int(h) or not 1 <= h <= MAX_HIDDEN:
        raise _fail(label, f"metadata hidden must be a positive integer up to {MAX_HIDDEN}, not {h!r}")


def _check_net_entry(label: object, i: int, entry: object, layers: list[int], mode: str) -> None:
    if not isinstance(entry, dict) or not _is_int(entry.get("il")) or not isinstance(entry.get("targets"), list) \
            or not all(_is_int(t) for t in entry["targets"]):
        raise _fail(label, f"net {i}: bad entry {entry!r} (needs integer il and a list of integer targets)")
    il, targets = entry["il"], entry["targets"]
    if mode == "token":  # the same layer, one token ahead
        if il not in layers or targets != [il]:
            raise _fail(label, f"net {i}: a mode token net predicts its own MoE layer of the next token "
                               f"(targets [{il}]), not {targets} (MoE layers {layers})")
        return
    if il not in layers or not targets or any(t not in layers or t <= il for t in targets) \
            or len(set(targets)) != len(targets):
        raise _fail(label, f"net {i}: source {il} / targets {targets} are not later MoE layers of {layers}")


def file_strides(meta: dict) -> list[int]:
    """The strides a (checked) file has nets for: MoE layers ahead in mode layer; [1] (a token) in mode token."""
    if meta["mode"] == "token":
        return [1]
    pos = {il: j for j, il in enumerate(meta["layers"])}
    return sorted({pos[t] - pos[n["il"]] for n in meta["nets"] for t in n["targets"]})


def _strides_text(strides: list[int]) -> str:
    return f"stride {strides[0]}" if len(strides) == 1 else f"strides {', '.join(map(str, strides))}"


def check_need(meta: dict, need: PredictorNeed, label: object) -> None:
    """The file was made for the model, mode and stride the run needs: else ONE message naming what differs
    (from the metadata alone, before any net is read)."""
    have: list[str] = []
    want: list[str] = []
    fp = need.shape.model_fingerprint
    if meta["model_fingerprint"] != fp:
        have.append(f"model {meta['model_fingerprint']} ({meta.get('model_name', '?')})")
        want.append(f"model {fp}")
    strides = file_strides(meta)
    if meta["mode"] != need.mode:
        have.append(f"mode {meta['mode']}, {_strides_text(strides)}")
        want.append(f"mode {need.mode}" + (f", stride {need.stride}" if need.stride is not None else ""))
    elif need.stride is not None and need.stride not in strides:
        have.append(_strides_text(strides))
        want.append(f"stride {need.stride}")
    if have:
        raise _fail(label, f"trained for {'; '.join(have)}; this run needs {'; '.join(want)}")


def check_model(meta: dict, shape: ModelShape, label: object) -> None:
    """The file was made for the model ``shape``."""
    if meta["model_fingerprint"] != shape.model_fingerprint:
        raise _fail(label, f"made for model {meta['model_fingerprint']} ({meta.get('model_name', '?')}), "
                           f"not this model ({shape.model_fingerprint})")
    for key in ("n_expert", "n_expert_used", "n_embd"):
        if meta[key] != getattr(shape, key):
            raise _fail(label, f"{key} {meta[key]} does not match the model's {getattr(shape, key)}")
    if list(meta["layers"]) != list(shape.layers):
        raise _fail(label, f"MoE layers {meta['layers']} do not match the model's {list(shape.layers)}")


def shape_of(meta: dict) -> ModelShape:
    """The model facts a (checked) metadata dict describes."""
    return ModelShape(model_fingerprint=meta["model_fingerprint"], layers=tuple(meta["layers"]),
                      n_expert=meta["n_expert"], n_expert_used=meta["n_expert_used"], n_embd=meta["n_embd"])


# --- arrays: headers checked before data ------------------------------------------------------


def _read_net(m: NpzMembers, i: int, entry: dict, meta: dict, label: object) -> Net:
    il, targets = entry["il"], tuple(entry["targets"])
    d, e, h, dt = meta["n_embd"], meta["n_expert"], meta["hidden"], meta["dtype"]
    n_out = len(targets) * e
    p = f"net{i}."
    f32 = np.float32
    if meta["kind"] == "linear":
        w1t = b1 = None
        w2 = m.read(p + "w", dt, (n_out, d), finite=True)
        b2 = m.read(p + "b", dt, (n_out,), finite=True)
    else:
        w1 = m.read(p + "w1", dt, (h, d), finite=True)
        b1 = m.read(p + "b1", dt, (h,), finite=True).astype(f32)
        w1t = np.ascontiguousarray(w1.T, dtype=f32)
        w2 = m.read(p + "w2", dt, (n_out, h), finite=True)
        b2 = m.read(p + "b2", dt, (n_out,), finite=True)
    mean = m.read(p + "mean", "float32", (d,), finite=True)
    std = m.read(p + "std", "float32", (d,), finite=True)
    if np.any(std <= 0):
        raise _fail(label, f"{p}std must be positive")
    return Net(il=il, targets=targets, w1t=w1t, b1=b1, w2t=np.ascontiguousarray(w2.T, dtype=f32),
               b2=b2.astype(f32), mean=mean, std=std)


def _read_meta(m: NpzMembers, label: object) -> dict:
    raw = m.read("meta", "uint8", ndim=1, max_bytes=MAX_META_BYTES)
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _fail(label, f"bad metadata: {e}") from e
    return check_meta(meta, label)


def _read(path: Path, need: PredictorNeed | None, label: object) -> PredictorFile:
    """Read ``path`` for what the run needs (None: the model its metadata names, any mode and stride), messages
    under ``label``. The metadata is checked against ``need`` before any net is read."""
    try:
        with NpzMembers(path, lambda msg: _fail(label, msg)) as m:
            meta = _read_meta(m, label)
            if need is not None:
                check_need(meta, need, label)
            check_model(meta, need.shape if need is not None else shape_of(meta), label)
            nets = tuple(_read_net(m, i, entry, meta, label) for i, entry in enumerate(meta["nets"]))
            extra = m.unexpected({"meta"} | {f"net{i}.{k}" for i in range(len(nets)) for k in NET_KEYS[meta["kind"]]})
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError) as e:
        raise _fail(label, f"damaged .npz file ({e})") from e
    if extra:
        raise _fail(label, f"unexpected arrays {extra}")
    return PredictorFile(meta=meta, nets=nets)


def read_predictor_file(path: str | Path, need: ModelShape | PredictorNeed) -> PredictorFile:
    """Read and validate a predictor file for what the run needs (a ``ModelShape`` alone: that model, mode layer,
    any stride the file has); PredictorFileError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PredictorFileError(f"predictor file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(6)
    if head == b"\x93NUMPY":
        raise _fail(path, "not an .npz archive: a single .npy array (save predictors with ggmoe train-predictor)")
    if not zipfile.is_zipfile(path):
        raise _fail(path, "not a readable .npz file (no zip archive found)")
    if isinstance(need, ModelShape):
        need = PredictorNeed(need, "layer", None)
    return _read(path, need, path)


load_mlp_file = read_predictor_file  # the same reader under the mlp predictor's name (public API)


# --- writing ----------------------------------------------------------------------------------


def check_predictor_output(path: str | Path) -> Path:
    """``path`` can take a predictor file (``ggmoe.base.outputs.check_output``: a regular file or nothing yet,
    in a writable directory). Called before any training starts, so a bad ``-o`` fails in a second."""
    return outputs.check_output(path, what="predictor file")


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return mask


def write_predictor_file(path: str | Path, meta: dict, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``meta`` and the nets' ``arrays`` to ``path`` atomically; the result reads back as valid.

    A temporary file in the same directory is written, read back with the reader's
    checks, then moved over ``path`` with ``os.replace``; on any failure ``path`` is
    untouched and the temporary file removed. (Not ``ggmoe.base.outputs.atomic_write``: the
    read-back needs the temporary file's name before the rename.)
    """
    path = check_predictor_output(path)
    check_meta(meta, f"{path} (not written)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a saved file gets the usual permissions
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        _read(tmp, None, f"{path} (not written)")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
