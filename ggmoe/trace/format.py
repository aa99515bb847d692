"""The trace format: per processed token and MoE layer, the router's decision.

Format ``ggmoe-trace`` version 2, one uncompressed ``.npz`` (read and written
with ``allow_pickle=False``). Arrays, with T processed tokens, L MoE layers,
k = n_expert_used, E = n_expert:

==================  ============  =================  ==========================================
name                dtype         shape              meaning
==================  ============  =================  ==========================================
``meta``            uint8         [n_bytes]          UTF-8 JSON, see ``TraceMeta``
``token_ids``       int32         [T]                the token fed to the model at that step
``positions``       int32         [T]                its position in its sequence
``stage``           uint8         [T]                0 prefill, 1 decode
``prompt_offsets``  int64         [P + 1]            tokens of prompt p are rows
                                                     ``prompt_offsets[p]:prompt_offsets[p+1]``
``layers``          int32         [L]                il of each MoE layer, ascending
``ids``             int16         [T, L, k]          selected expert ids, router order
``probs``           float16       [T, L, E]          router probabilities, never negative: the
                                                     gating's (meta ``gating``); for gpt-oss's
                                                     ``softmax_weight`` the softmax of the logits
                                                     over every expert
``logits``          float16       [T, L, E]          raw router logits with the router bias
                                                     (optional: where the graph hands them, gpt-oss)
``hidden``          float16       [T, L, n_embd]     MoE layer input (optional)
==================  ============  =================  ==========================================

Every processed token has one row: the prompt tokens of a prefill and each token
fed in a decode step. The last sampled token of a prompt is never fed, so it has
no row. A reader validates every dtype, shape and id range.

Version 1 has no gating and stores what the graph hands on under ``probs``: the probabilities for
every architecture but gpt-oss, whose ``probs`` are its logits. A version 1 trace
is read as version 2: a gpt-oss one's ``probs`` become ``logits`` and their softmax the ``probs``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ggmoe.base.errors import TraceFormatError
from ggmoe.base.hook import RouteEvent
from ggmoe.base.npzfile import NpzMembers
from ggmoe.base.outputs import atomic_write
from ggmoe.inspect.gating import GATING_FUNCS, gating_from_kv, softmax

FORMAT = "ggmoe-trace"
VERSION = 2
READS = (1, 2)  # versions this reader takes
STAGE_PREFILL = 0
STAGE_DECODE = 1
# What an imported trace may lack (``TraceMeta.lacks``), and what needs it:
LACKS = {
    "hidden": "MoE inputs (hidden states): predictors that read them (mlp, skip-gate) cannot run",
    "token_ids": "token ids: the token predictor cannot run",
    "probs": "the router's full distribution (only the selected experts' weights, or none): predictors that "
             "read router probabilities (expert-map) cannot run",
}


@dataclass(frozen=True)
class TraceMeta:
    model_fingerprint: str
    model_name: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    mode: str  # greedy | sample | teacher
    max_tokens: int  # decode steps asked per prompt
    ggmoe_version: str
    n_ubatch: int = 512  # tokens per micro-batch the engine used (replays chunk prefills alike)
    gating: str = "softmax"  # the model's gating function (ggmoe.inspect.gating.Gating.func)
    source: str = ""  # where the routing came from: "" recorded by ggmoe, else the imported log (trace import)
    lacks: tuple[str, ...] = ()  # what the routing log did not hold (keys of LACKS); those arrays are filled but
    # never read as data: a command that needs one refuses the trace in one line (require)
    format: str = FORMAT
    version: int = VERSION


@dataclass(frozen=True)
class Trace:
    meta: TraceMeta
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    stage: np.ndarray  # [T] uint8
    prompt_offsets: np.ndarray  # [P + 1] int64
    layers: np.ndarray  # [L] int32
    ids: np.ndarray  # [T, L, k] int16
    probs: np.ndarray  # [T, L, E] float16
    hidden: np.ndarray | None  # [T, L, n_embd] float16
    logits: np.ndarray | None = None  # [T, L, E] float16, raw router logits (gpt-oss), else None

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def n_prompts(self) -> int:
        return int(self.prompt_offsets.shape[0] - 1)

    def prompt_slice(self, p: int) -> slice:
        return slice(int(self.prompt_offsets[p]), int(self.prompt_offsets[p + 1]))

    def layer_index(self, il: int) -> int:
        """Column of layer ``il`` in ids/probs/hidden."""
        hits = np.nonzero(self.layers == il)[0]
        if hits.size == 0:
            raise KeyError(f"layer {il} is not a traced MoE layer")
        return int(hits[0])


def _write_arrays(path: str | Path, meta: TraceMeta, arrays: dict[str, np.ndarray], compress: bool = False) -> None:
    d = asdict(meta)
    for key in ("source", "lacks"):  # a recorded trace's metadata stays readable by earlier versions
        if not d[key]:
            del d[key]
    arrays = {**arrays, "meta": np.frombuffer(json.dumps(d).encode(), dtype=np.uint8)}
    with atomic_write(path) as f:  # never a half-written trace under the final name
        (np.savez_compressed if compress else np.savez)(f, **arrays)


def write_trace(trace: Trace, path: str | Path, compress: bool = False) -> Path:
    """Write a ``Trace`` (e.g. a selection or a transformation of a loaded one) in the same format;
    ``compress``: deflated members (an imported trace's probabilities are mostly zeros)."""
    arrays = {"token_ids": trace.token_ids.astype(np.int32), "positions": trace.positions.astype(np.int32),
              "stage": trace.stage.astype(np.uint8), "ids": trace.ids.astype(np.int16),
              "probs": trace.probs.astype(np.float16), "prompt_offsets": trace.prompt_offsets.astype(np.int64),
              "layers": trace.layers.astype(np.int32)}
    if trace.hidden is not None:
        arrays["hidden"] = trace.hidden.astype(np.float16)
    if trace.logits is not None:
        arrays["logits"] = trace.logits.astype(np.float16)
    _write_arrays(path, trace.meta, arrays, compress)
    return Path(path)


class TraceWriter:
    """Accumulates steps (one ``decode`` call each) and writes the ``.npz`` at the end."""

    def __init__(self, meta: TraceMeta, keep_hidden: bool) -> None:
        self.meta = meta
        self.keep_hidden = keep_hidden
        # the events carry ids only (the async decode's): probabilities are written as zeros, never read as data
        self.ids_only = "probs" in meta.lacks
        self._rows: dict[str, list[np.ndarray]] = {k: [] for k in
                                                   ("token_ids", "positions", "stage", "ids", "probs", "hidden", "logits")}
        self._offsets = [0]
        self._layers: list[int] | None = None
        self._n = 0

    def add_step(self, tokens: list[int], pos0: int, stage: int, events: dict[int, RouteEvent]) -> None:
        n = len(tokens)
        layers = sorted(events)
        if self._layers is None:
            self._layers = layers
        elif layers != self._layers:
            raise TraceFormatError(f"MoE layers changed between steps: {self._layers} vs {layers}")
        for il in layers:
            ev = events[il]
            if ev.n_tokens != n or (ev.probs is None and not self.ids_only) or (self.keep_hidden and ev.hidden is None):
                raise TraceFormatError(f"layer {il}: hook delivered {ev.n_tokens} rows for {n} tokens")
        r = self._rows
        r["token_ids"].append(np.asarray(tokens, dtype=np.int32))
        r["positions"].append(np.arange(pos0, pos0 + n, dtype=np.int32))
        r["stage"].append(np.full(n, stage, dtype=np.uint8))
        r["ids"].append(np.stack([events[il].ids for il in layers], axis=1).astype(np.int16))
        if self.ids_only:
            r["probs"].append(np.zeros((n, len(layers), self.meta.n_expert), dtype=np.float16))
        else:
            r["probs"].append(np.stack([events[il].probs for il in layers], axis=1).astype(np.float16))
        if self.keep_hidden:
            r["hidden"].append(np.stack([events[il].hidden for il in layers], axis=1).astype(np.float16))
        if all(events[il].logits is not None for il in layers):
            r["logits"].append(np.stack([events[il].logits for il in layers], axis=1).astype(np.float16))
        elif r["logits"]:
            raise TraceFormatError("router logits stopped coming between steps")
        self._n += n

    def end_prompt(self) -> None:
        self._offsets.append(self._n)

    def save(self, path: str | Path) -> Path:
        if self._layers is None or self._n == 0:
            raise TraceFormatError("nothing was traced")
        if self._offsets[-1] != self._n:
            self.end_prompt()
        if self._rows["logits"] and len(self._rows["logits"]) != len(self._rows["ids"]):
            raise TraceFormatError("router logits came for some steps only")
        arrays = {k: np.concatenate(v, axis=0) for k, v in self._rows.items() if v}
        arrays["prompt_offsets"] = np.asarray(self._offsets, dtype=np.int64)
        arrays["layers"] = np.asarray(self._layers, dtype=np.int32)
        _write_arrays(path, self.meta, arrays)
        return Path(path)


_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "model_fingerprint": str, "model_name": str, "arch": str, "n_layer": int, "n_expert": int,
    "n_expert_used": int, "n_embd": int, "mode": str, "max_tokens": int, "ggmoe_version": str, "n_ubatch": int,
    "gating": str, "source": str, "lacks": list, "format": str, "version": int,
}
# fields with a default (gating: version 1 has none; source, lacks: recorded traces leave them out)
_OPTIONAL = {"n_ubatch", "gating", "source", "lacks"}
_META_MAX = 1 << 20  # bytes of metadata JSON; a real trace's is a few hundred


def _meta(raw: np.ndarray) -> TraceMeta:
    """The metadata JSON, every field of the right type and every count in range."""
    if raw.size > _META_MAX:
        raise TraceFormatError(f"trace metadata of {raw.size} bytes is too large")
    try:
        d = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise TraceFormatError(f"bad trace metadata: {e}") from None
    if not isinstance(d, dict):
        raise TraceFormatError(f"bad trace metadata: a JSON {type(d).__name__}, expected an object")
    if d.get("format") != FORMAT:
        raise TraceFormatError(f"not a ggmoe trace (format {str(d.get('format'))[:40]!r})")
    if d.get("version") not in READS or isinstance(d.get("version"), bool):
        raise TraceFormatError(f"trace format version {str(d.get('version'))[:20]} is not supported (this ggmoe reads "
                               f"versions {READS[0]}-{READS[-1]}; record the trace again with `ggmoe trace`)")
    unknown = sorted(set(d) - set(_META_TYPES))
    if unknown:
        raise TraceFormatError(f"bad trace metadata: unknown field {unknown[0][:40]!r}")
    for key, typ in _META_TYPES.items():
        if key not in d:
            if key in _OPTIONAL:
                continue  # has a default
            raise TraceFormatError(f"bad trace metadata: missing {key}")
        v = d[key]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise TraceFormatError(f"bad trace metadata: {key} is {type(v).__name__}, expected {typ.__name__}")
    for key, low in (("n_layer", 1), ("n_expert", 1), ("n_expert_used", 1), ("n_embd", 1), ("max_tokens", 0),
                     ("n_ubatch", 1)):
        if key in d and not low <= d[key] <= 1 << 20:
            raise TraceFormatError(f"bad trace metadata: {key} {d[key]} is not in {low}..{1 << 20}")
    if d["n_expert_used"] > d["n_expert"]:
        raise TraceFormatError("bad trace metadata: n_expert_used > n_expert")
    lacks = d.get("lacks", [])
    bad = [x for x in lacks if not isinstance(x, str) or x not in LACKS]
    if bad:
        raise TraceFormatError(f"bad trace metadata: lacks {str(bad[0])[:40]!r}; known: {', '.join(LACKS)}")
    d["lacks"] = tuple(lacks)
    if d.get("gating", "softmax") not in GATING_FUNCS.values():
        raise TraceFormatError(f"bad trace metadata: unknown gating {str(d['gating'])[:40]!r}")
    if d["version"] == 1:  # no gating recorded: the architecture's, as this ggmoe reads it
        d["gating"] = gating_from_kv(d["arch"], {}).func
    return TraceMeta(**d)


def trace_lacks(meta: TraceMeta, what: str, needed_by: str) -> None:
    """TraceFormatError in one line when ``needed_by`` needs ``what`` (a key of LACKS) and the trace lacks it."""
    if what in meta.lacks:
        raise TraceFormatError(f"{needed_by} needs {what}: the trace ({meta.source or meta.model_name}) has none")


def _v1_probs(meta: TraceMeta, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, TraceMeta]:
    """A version 1 trace's ``probs`` -> (probs, logits, meta) of version 2: a softmax-weight model's (gpt-oss)
    were its router logits."""
    if meta.version != 1:
        return probs, None, meta
    meta = replace(meta, version=VERSION)
    if meta.gating != "softmax_weight":
        return probs, None, meta
    return softmax(probs.astype(np.float32)).astype(np.float16), probs, meta


def _expect(name: str, a: np.ndarray, dtype: type, shape: tuple) -> None:
    if a.dtype != np.dtype(dtype):
        raise TraceFormatError(f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape, strict=True)):
        raise TraceFormatError(f"{name}: shape {a.shape}, expected {shape}")


def load_trace(path: str | Path, hidden: bool = True) -> Trace:
    """Read and validate a trace; ``hidden=False`` skips the (large) hidden states."""
    path = Path(path)
    if path.is_dir():
        path = path / "trace.npz"
    if not path.is_file():
        raise TraceFormatError(f"trace file not found: {path}")
    def fail(msg: str) -> TraceFormatError:
        return TraceFormatError(f"{path}: {msg}")

    need = ("meta", "token_ids", "positions", "stage", "prompt_offsets", "layers", "ids", "probs")
    dtypes = {"meta": np.uint8, "token_ids": np.int32, "positions": np.int32, "stage": np.uint8,
              "prompt_offsets": np.int64, "layers": np.int32, "ids": np.int16, "probs": np.float16}
    with NpzMembers(path, fail) as z:
        missing = [k for k in need if k not in z.names]
        if missing:
            raise fail(f"missing arrays {missing}")
        a = {k: z.read(k, np.dtype(dtypes[k])) for k in need}
        h = z.read("hidden", np.dtype(np.float16)) if hidden and "hidden" in z.names else None
        logits = z.read("logits", np.dtype(np.float16)) if "logits" in z.names else None
    meta = _meta(a["meta"])
    _check_arrays(meta, a, h, logits)
    probs, v1_logits, meta = _v1_probs(meta, a["probs"])
    return Trace(meta=meta, token_ids=a["token_ids"], positions=a["positions"], stage=a["stage"],
                 prompt_offsets=a["prompt_offsets"], layers=a["layers"], ids=a["ids"], probs=probs, hidden=h,
                 logits=logits if v1_logits is None else v1_logits)


def _check_arrays(meta: TraceMeta, a: dict[str, np.ndarray], h: np.ndarray | None,
                  logits: np.ndarray | None) -> None:
    t = a["token_ids"].shape[0] if a["token_ids"].ndim == 1 else -1
    n_l = a["layers"].shape[0] if a["layers"].ndim == 1 else -1
    _expect("token_ids", a["token_ids"], np.int32, (None,))
    _expect("positions", a["positions"], np.int32, (t,))
    _expect("stage", a["stage"], np.uint8, (t,))
    _expect("prompt_offsets", a["prompt_offsets"], np.int64, (None,))
    _expect("layers", a["layers"], np.int32, (None,))
    _expect("ids", a["ids"], np.int16, (t, n_l, meta.n_expert_used))
    _expect("probs", a["probs"], np.float16, (t, n_l, meta.n_expert))
    if h is not None:
        _expect("hidden", h, np.float16, (t, n_l, meta.n_embd))
    if logits is not None:
        _expect("logits", logits, np.float16, (t, n_l, meta.n_expert))
    ids, offs = a["ids"], a["prompt_offsets"]
    if ids.size and (ids.min() < 0 or ids.max() >= meta.n_expert):
        raise TraceFormatError(f"expert ids outside [0, {meta.n_expert})")
    if offs.size < 2 or offs[0] != 0 or offs[-1] != t or np.any(np.diff(offs) < 0):
        raise TraceFormatError("prompt_offsets must rise from 0 to the number of tokens")
    if np.any(a["layers"] < 0) or np.any(a["layers"] >= meta.n_layer) or np.any(np.diff(a["layers"]) <= 0):
        raise TraceFormatError("layers must be ascending layer indices below n_layer")
    if np.any(a["stage"] > STAGE_DECODE):
        raise TraceFormatError("stage must be 0 (prefill) or 1 (decode)")
    if meta.version > 1 and not np.all(a["probs"] >= 0):  # NaN fails too
        raise TraceFormatError("probs holds negative or NaN values: router logits are not probabilities "
                               "(a version 2 trace keeps logits under `logits`)")
