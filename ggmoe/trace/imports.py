"""Public routing logs into ggmoe's trace format (``ggmoe trace import``).

Two forms are read; :func:`detect_form` tells them apart and refuses anything else:

``layer-files``
    A directory with one text file per MoE layer, ``<anything>_<il>.txt`` or ``.txt.gz`` (``il``:
    llama.cpp's layer index), as DeepSeek's ESFT writes them (``scripts/expert/get_expert_scores.py``,
    github.com/deepseek-ai/ESFT). One line per sequence, the same sequences in the same order in every
    file: the selected ids of every token, ``top_k`` per token, token after token, tab-separated; then
    optionally an empty field (``\\t\\t``) and the router weights of those ids in the same order.
``jsonl``
    One JSON object per line, one per token and MoE layer, as per-token routing loggers over vLLM or
    transformers write them: the sequence (``seq``, ``seq_id``, ``sequence``, ``request_id``), the token's
    index in it (``token``, ``token_idx``, ``token_index``, ``position``, ``pos``), the layer (``layer``,
    ``layer_id``, ``il``), the selected ids (``topk_ids``, ``expert_ids``, ``ids``, ``experts``) and
    optionally their weights (``topk_weights``, ``expert_weights``, ``weights``, ``probs``); a record may
    carry its token id (``token_id``). Sequences keep the order of their first record, tokens their index.

The mapping to the trace (``ggmoe.trace.format``): every token is one row, ``stage`` decode (a routing log
of teacher-forced text routes what decoding that text would route; replay it as a decode stream),
``positions`` its index in its sequence, ``prompt_offsets`` the sequence boundaries, ``ids`` the selected
experts in the log's order, ``probs`` the weights scattered at those ids and 0 elsewhere. What the log
did not hold is named in ``TraceMeta.lacks`` (always ``hidden``; ``token_ids`` unless every record had one;
``probs``: the full distribution is never in these logs), and the commands that need it refuse the trace.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ggmoe.base.errors import TraceFormatError
from ggmoe.base.version import __version__
from ggmoe.trace.format import STAGE_DECODE, Trace, TraceMeta

FORMS = ("layer-files", "jsonl")
_LAYER_FILE = re.compile(r"(\d+)\.txt(\.gz)?$")
_KEYS = {
    "seq": ("seq", "seq_id", "sequence", "request_id"),
    "token": ("token", "token_idx", "token_index", "position", "pos"),
    "layer": ("layer", "layer_id", "il"),
    "ids": ("topk_ids", "expert_ids", "ids", "experts"),
    "weights": ("topk_weights", "expert_weights", "weights", "probs"),
}
MAX_RECORDS = 1 << 26  # JSONL records read at most (a 64k-token, 1k-layer log)


@dataclass(frozen=True)
class RoutingShape:
    """The model the routing belongs to: from its GGUF header (``--model``) or given by hand."""

    n_layer: int  # layers of the model, dense ones included (0: the log's highest layer + 1)
    n_expert: int  # routed experts per MoE layer
    n_expert_used: int  # experts selected per token (top-k)
    moe_layers: tuple[int, ...] | None = None  # il of the MoE layers (None: whatever the log names, < n_layer)
    fingerprint: str = ""  # the GGUF's (ggmoe.inspect.fingerprint); "" when no GGUF was given
    name: str = ""  # the model's name
    arch: str = ""  # llama.cpp architecture
    n_embd: int = 1  # hidden size (1 when unknown: imported traces hold no hidden states)


@dataclass(frozen=True)
class TraceShape:
    """The model shape an imported trace names, where no GGUF is at hand: counts only (no bytes)."""

    n_layer: int
    n_expert: int
    n_expert_used: int
    moe_layers: tuple[int, ...]  # the trace's MoE layers

    @classmethod
    def of(cls, trace: Trace) -> TraceShape:
        m = trace.meta
        return cls(m.n_layer, m.n_expert, m.n_expert_used, tuple(int(il) for il in trace.layers))

    def bytes_per_expert(self, il: int) -> int:
        """Unknown without a GGUF: 0 (counts do not depend on it; times need ``--model``)."""
        return 0


def check_trace_fits(trace: Trace, n_expert: int, n_expert_used: int, moe_layers: tuple[int, ...],
                     model: str) -> None:
    """An imported trace against a model's shape; TraceFormatError naming the field that differs."""
    m = trace.meta
    if m.n_expert != n_expert:
        raise TraceFormatError(f"n_expert: the trace has {m.n_expert} experts per layer, {model} {n_expert}")
    if m.n_expert_used != n_expert_used:
        raise TraceFormatError(f"top-k: the trace selects {m.n_expert_used} experts per token, {model} "
                               f"{n_expert_used}")
    extra = sorted(set(int(il) for il in trace.layers) - set(moe_layers))
    if extra:
        raise TraceFormatError(f"layer: the trace routes layer {extra[0]}, not a MoE layer of {model} "
                               f"({len(moe_layers)} MoE layers)")


@dataclass(frozen=True)
class Routing:
    """What a log holds, before it becomes a trace (T tokens, L MoE layers, k = top-k)."""

    layers: np.ndarray  # [L] int32, ascending
    ids: np.ndarray  # [T, L, k] int32
    weights: np.ndarray | None  # [T, L, k] float32, the router's weights of ids; None if the log has none
    offsets: np.ndarray  # [P + 1] int64, sequence boundaries
    positions: np.ndarray  # [T] int32, token index in its sequence
    token_ids: np.ndarray | None  # [T] int32, or None


def detect_form(src: Path) -> str:
    """``layer-files`` or ``jsonl``; TraceFormatError naming what was expected otherwise."""
    if src.is_dir() and any(_LAYER_FILE.search(p.name) for p in src.iterdir() if p.is_file()):
        return "layer-files"
    if src.is_file() and src.name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if not src.exists():
        raise TraceFormatError(f"{src}: no such file or directory")
    raise TraceFormatError(f"{src}: unknown routing log form; expected a directory of per-layer files "
                           "(NAME_<layer>.txt or .txt.gz) or a .jsonl / .jsonl.gz file of per-token records")


def _open_text(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from f
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise TraceFormatError(f"{path}: cannot read: {e}") from None


def _numbers(text: str, dtype: type, where: str) -> np.ndarray:
    try:
        return np.array(text.split(), dtype=dtype)
    except ValueError:
        raise TraceFormatError(f"{where}: a value that is not a number") from None


def _read_layer_file(path: Path, k: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per sequence: ids [n, k] and weights [n, k] (or None)."""
    out = []
    for i, line in enumerate(_open_text(path), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {i}"
        ids_txt, sep, w_txt = line.rstrip("\n").partition("\t\t")
        ids = _numbers(ids_txt, np.int64, where)
        w = _numbers(w_txt, np.float32, where) if sep and w_txt.strip() else None
        if ids.size == 0 or ids.size % k:
            raise TraceFormatError(f"{where}: {ids.size} ids is not a multiple of top-k {k}")
        if w is not None and w.size != ids.size:
            raise TraceFormatError(f"{where}: {w.size} weights for {ids.size} ids")
        if w is not None and not np.all(np.isfinite(w) & (w >= 0)):
            raise TraceFormatError(f"{where}: a weight that is negative or not finite")
        out.append((ids.reshape(-1, k), None if w is None else w.reshape(-1, k)))
    return out


def read_layer_files(src: Path, k: int) -> Routing:
    """The ``layer-files`` form (see the module docstring)."""
    files = {int(m.group(1)): p for p in src.iterdir() if p.is_file() and (m := _LAYER_FILE.search(p.name))}
    layers = sorted(files)
    if not layers:
        raise TraceFormatError(f"{src}: no per-layer files (NAME_<layer>.txt or .txt.gz)")
    per_layer = [_read_layer_file(files[il], k) for il in layers]
    first = per_layer[0]
    lengths = [ids.shape[0] for ids, _ in first]
    for il, seqs in zip(layers, per_layer, strict=True):
        if [ids.shape[0] for ids, _ in seqs] != lengths:
            raise TraceFormatError(f"{files[il].name}: its sequences or their token counts differ from "
                                   f"{files[layers[0]].name}'s (every layer file must hold the same sequences)")
    ids = np.stack([np.concatenate([s[0] for s in seqs]) for seqs in per_layer], axis=1)
    has_w = all(s[1] is not None for seqs in per_layer for s in seqs)
    weights = (np.stack([np.concatenate([s[1] for s in seqs]) for seqs in per_layer], axis=1)
               if has_w else None)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    return Routing(np.asarray(layers, np.int32), ids.astype(np.int32), weights, offsets, positions, None)


def _field(rec: dict, name: str, where: str, required: bool = True) -> object:
    for key in _KEYS.get(name, (name,)):
        if key in rec:
            return rec[key]
    if required:
        raise TraceFormatError(f"{where}: no {name} field (one of {', '.join(_KEYS[name])})")
    return None


def _int(v: object, name: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceFormatError(f"{where}: {name} must be a non-negative integer, got {str(v)[:40]!r}")
    return v


def _records(src: Path) -> Iterator[tuple[str, dict]]:
    for i, line in enumerate(_open_text(src), start=1):
        if not line.strip():
            continue
        where = f"{src.name} line {i}"
        if i > MAX_RECORDS:
            raise TraceFormatError(f"{where}: more than {MAX_RECORDS} records")
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise TraceFormatError(f"{where}: not JSON ({e})") from None
        if not isinstance(rec, dict):
            raise TraceFormatError(f"{where}: a JSON {type(rec).__name__}, expected an object")
        yield where, rec


def _list(v: object, name: str, where: str, k: int, numbers: bool) -> list:
    """A list of k ints (ids) or k finite non-negative numbers (weights)."""
    kind = (int, float) if numbers else (int,)
    ok = isinstance(v, list) and len(v) == k and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)
    if ok and numbers:
        ok = all(math.isfinite(x) and x >= 0 for x in v)
    if not ok:
        what = "finite non-negative numbers" if numbers else "ints"
        raise TraceFormatError(f"{where}: {name} must be a list of {k} {what} (top-k {k}), got {str(v)[:60]}")
    return v


def read_jsonl(src: Path, k: int) -> Routing:
    """The ``jsonl`` form (see the module docstring)."""
    seqs: dict[str, dict[int, dict[int, tuple[list, list | None, int | None]]]] = {}
    layers: set[int] = set()
    for where, rec in _records(src):
        seq = str(_field(rec, "seq", where))
        tok = _int(_field(rec, "token", where), "token", where)
        il = _int(_field(rec, "layer", where), "layer", where)
        ids = _list(_field(rec, "ids", where), "ids", where, k, numbers=False)
        w = _field(rec, "weights", where, required=False)
        w = None if w is None else _list(w, "weights", where, k, numbers=True)
        tid = rec.get("token_id")
        tid = None if tid is None else _int(tid, "token_id", where)
        row = seqs.setdefault(seq, {}).setdefault(tok, {})
        if il in row:
            raise TraceFormatError(f"{where}: a second record for sequence {seq[:40]!r}, token {tok}, layer {il}")
        row[il] = (ids, w, tid)
        layers.add(il)
    if not seqs:
        raise TraceFormatError(f"{src}: no records")
    return _assemble(src, seqs, sorted(layers))


def _assemble(src: Path, seqs: dict, layers: list[int]) -> Routing:
    ids, weights, tids, positions, lengths = [], [], [], [], []
    for seq, toks in seqs.items():
        for tok in sorted(toks):
            row = toks[tok]
            if len(row) != len(layers):
                gone = sorted(set(layers) - set(row))[0]
                raise TraceFormatError(f"{src.name}: sequence {seq[:40]!r}, token {tok} has no record for "
                                       f"layer {gone}")
            ids.append([row[il][0] for il in layers])
            weights.append([row[il][1] for il in layers])
            tids.append(next((row[il][2] for il in layers if row[il][2] is not None), None))
            positions.append(tok)
        lengths.append(len(toks))
    has_w = all(w is not None for r in weights for w in r)
    return Routing(np.asarray(layers, np.int32), np.asarray(ids, np.int32),
                   np.asarray(weights, np.float32) if has_w else None,
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   np.asarray(positions, np.int32),
                   np.asarray(tids, np.int32) if all(t is not None for t in tids) else None)


def check_shape(r: Routing, shape: RoutingShape) -> None:
    """The routing against the model: layer indices, expert ids, top-k; TraceFormatError naming the field."""
    if r.ids.shape[2] != shape.n_expert_used:
        raise TraceFormatError(f"top-k: the log selects {r.ids.shape[2]} experts per token, the model "
                               f"{shape.n_expert_used}")
    bad = [int(il) for il in r.layers if il >= shape.n_layer or
           (shape.moe_layers is not None and il not in shape.moe_layers)]
    if bad:
        what = "MoE layers " + ",".join(map(str, shape.moe_layers)) if shape.moe_layers else \
            f"{shape.n_layer} layers"
        raise TraceFormatError(f"layer: the log names layer {bad[0]}, the model has {what}")
    if r.ids.size and (r.ids.min() < 0 or r.ids.max() >= shape.n_expert):
        raise TraceFormatError(f"expert id: the log selects expert {int(r.ids.max())}, the model has "
                               f"{shape.n_expert} experts (0..{shape.n_expert - 1})")
    if np.any(np.sort(r.ids, axis=2)[..., 1:] == np.sort(r.ids, axis=2)[..., :-1]):
        raise TraceFormatError("expert id: a token selects the same expert twice in one layer")


def to_trace(r: Routing, shape: RoutingShape, source: str) -> Trace:
    """The trace of a checked routing (see the module docstring for the mapping)."""
    check_shape(r, shape)
    t, n_l, k = r.ids.shape
    probs = np.zeros((t, n_l, shape.n_expert), dtype=np.float16)
    if r.weights is not None:
        np.put_along_axis(probs, r.ids.astype(np.int64), r.weights.astype(np.float16), axis=2)
    lacks = ["hidden", "probs"] + ([] if r.token_ids is not None else ["token_ids"])
    lengths = np.diff(r.offsets)
    meta = TraceMeta(model_fingerprint=shape.fingerprint, model_name=shape.name or Path(source).name,
                     arch=shape.arch or "unknown", n_layer=shape.n_layer, n_expert=shape.n_expert,
                     n_expert_used=shape.n_expert_used, n_embd=shape.n_embd, mode="teacher",
                     max_tokens=int(lengths.max()) if lengths.size else 0, ggmoe_version=__version__,
                     source=source, lacks=tuple(sorted(lacks)))
    return Trace(meta=meta, token_ids=(r.token_ids if r.token_ids is not None else np.zeros(t, np.int32)),
                 positions=r.positions, stage=np.full(t, STAGE_DECODE, np.uint8), prompt_offsets=r.offsets,
                 layers=r.layers, ids=r.ids.astype(np.int16), probs=probs, hidden=None)


def source_form(path: Path, form: str = "auto") -> str:
    """The form of the log at ``path`` (``form`` auto: detected), checked to be that form's kind of path."""
    if form == "auto":
        return detect_form(path)
    if form not in FORMS:
        raise TraceFormatError(f"unknown routing log form {form!r}; choose auto, {', '.join(FORMS)}")
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file or directory")
    if form == "layer-files" and not path.is_dir():
        raise TraceFormatError(f"{path}: the layer-files form is a directory of per-layer files")
    if form == "jsonl" and not path.is_file():
        raise TraceFormatError(f"{path}: the jsonl form is one file")
    return form


def import_routing(src: str | Path, shape: RoutingShape, form: str = "auto", note: str = "") -> Trace:
    """Read a routing log (``form``: ``auto``, ``layer-files`` or ``jsonl``) into a checked trace; ``note``
    (e.g. the log's origin and licence) joins the trace's ``source``."""
    path = Path(src)
    form = source_form(path, form)
    if form == "layer-files":
        r = read_layer_files(path, shape.n_expert_used)
    else:
        r = read_jsonl(path, shape.n_expert_used)
    if shape.n_layer == 0:
        shape = replace(shape, n_layer=int(r.layers.max()) + 1)
    return to_trace(r, shape, f"{form}:{path}" + (f" ({note})" if note else ""))
