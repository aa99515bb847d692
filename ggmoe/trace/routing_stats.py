"""Routing statistics that outlive a process: per-layer expert counts, co-activation, predictor state.

``--stats-out FILE`` on run, trace, serve and chat collects them while the model runs
(``RoutingStatsCollector``, a route observer) and writes them when it stops;
``--stats-in FILE`` reloads them so a restart starts warm: the counts continue,
the ``static`` policy pins the hottest experts from them, and a data-driven
predictor (eam, expert-map) gets back what it had learnt. ``ggmoe plan`` and
the simulator read the counts instead of traces.

The file is an ``.npz`` (written atomically, read without pickle through
``ggmoe.base.npzfile``): ``meta`` (UTF-8 JSON as uint8: format, version, model
fingerprint, layers, n_expert, predictor name), ``counts`` [L, E] int64 (tokens
that selected each expert), ``coact`` [L, E, E] int64 (tokens that selected
both experts; the diagonal equals ``counts``), ``n_tokens`` [L] int64 (tokens
routed per layer), and the predictor's arrays as ``pred.<name>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ggmoe.base.errors import GgmoeError, UsageError
from ggmoe.base.hook import HookRequest, RouteEvent
from ggmoe.base.npzfile import NpzMembers
from ggmoe.base.outputs import atomic_write

FORMAT = "ggmoe-routing-stats"
VERSION = 1
_MAX_META_BYTES = 1 << 16  # bytes of JSON meta
_MAX_ARRAY_BYTES = 1 << 31  # bytes per array (co-activation of 512 layers x 512 experts fits)
_PRED_PREFIX = "pred."


class StatsFileError(GgmoeError):
    """A routing statistics file that cannot be used: unreadable, malformed or for another model."""


@dataclass(frozen=True)
class RoutingStats:
    """Counts of one model's routing; arrays indexed by the position of the MoE layer in ``layers``."""

    model_fingerprint: str  # ggmoe.inspect.fingerprint of the GGUF
    layers: tuple[int, ...]  # il of each MoE layer, ascending
    n_expert: int
    counts: np.ndarray  # [L, E] int64: tokens that selected each expert
    coact: np.ndarray  # [L, E, E] int64: tokens that selected both; diagonal = counts
    n_tokens: np.ndarray  # [L] int64: tokens routed through each layer
    predictor: str | None = None  # the registered name whose state ``predictor_state`` holds
    predictor_state: Mapping[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def empty(cls, model_fingerprint: str, layers: tuple[int, ...], n_expert: int) -> RoutingStats:
        n = len(layers)
        return cls(model_fingerprint, tuple(layers), n_expert, np.zeros((n, n_expert), np.int64),
                   np.zeros((n, n_expert, n_expert), np.int64), np.zeros(n, np.int64))

    def counts_by_layer(self) -> dict[int, np.ndarray]:
        """il -> [n_expert] int64 counts (what the static policy takes)."""
        return {il: self.counts[j].copy() for j, il in enumerate(self.layers)}

    def frequencies(self) -> np.ndarray:
        """[L, E] float64: the share of a layer's tokens that selected each expert (0 without tokens)."""
        n = np.maximum(self.n_tokens, 1).astype(np.float64)[:, None]
        return self.counts / n

    def check_model(self, model_fingerprint: str, layers: tuple[int, ...], n_expert: int) -> None:
        """Refuse statistics of another model (fingerprint, layers or experts differ)."""
        if self.model_fingerprint != model_fingerprint:
            raise UsageError("the routing statistics come from another model (fingerprints differ)")
        if tuple(self.layers) != tuple(layers) or self.n_expert != n_expert:
            raise UsageError(f"the routing statistics are for MoE layers {list(self.layers)} with "
                             f"{self.n_expert} experts; this model has {list(layers)} with {n_expert}")


class RoutingStatsCollector:
    """A route observer that adds every routed token to running counts (ids only: cheap)."""

    request = HookRequest(probs=False, hidden=False)

    def __init__(self, start: RoutingStats) -> None:
        self.model_fingerprint = start.model_fingerprint
        self.layers = tuple(start.layers)
        self.n_expert = start.n_expert
        self._pos = {il: j for j, il in enumerate(self.layers)}
        self.counts = start.counts.copy()
        self.coact = start.coact.copy()
        self.n_tokens = start.n_tokens.copy()

    def on_route(self, event: RouteEvent) -> None:
        j = self._pos.get(event.il)
        if j is None:
            return
        ids = event.ids.astype(np.intp)  # [T, k]
        onehot = np.zeros((ids.shape[0], self.n_expert), dtype=np.int64)  # [T, E]
        np.put_along_axis(onehot, ids, 1, axis=1)
        self.counts[j] += onehot.sum(axis=0)
        self.coact[j] += onehot.T @ onehot
        self.n_tokens[j] += ids.shape[0]

    def snapshot(self, predictor: str | None = None,
                 predictor_state: Mapping[str, np.ndarray] | None = None) -> RoutingStats:
        return RoutingStats(self.model_fingerprint, self.layers, self.n_expert, self.counts.copy(),
                            self.coact.copy(), self.n_tokens.copy(), predictor, dict(predictor_state or {}))


def save_stats(path: str | Path, stats: RoutingStats) -> Path:
    """Write ``stats`` to ``path`` atomically (never a half-written file under the final name)."""
    meta = {"format": FORMAT, "version": VERSION, "model_fingerprint": stats.model_fingerprint,
            "layers": list(stats.layers), "n_expert": stats.n_expert, "predictor": stats.predictor,
            "predictor_arrays": sorted(stats.predictor_state)}
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8),
              "counts": np.ascontiguousarray(stats.counts, np.int64),
              "coact": np.ascontiguousarray(stats.coact, np.int64),
              "n_tokens": np.ascontiguousarray(stats.n_tokens, np.int64)}
    arrays.update({_PRED_PREFIX + k: np.ascontiguousarray(v) for k, v in stats.predictor_state.items()})
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    return Path(path)


def load_stats(path: str | Path) -> RoutingStats:
    """Read and validate a statistics file; ``StatsFileError`` says what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise StatsFileError(f"{p}: no such file")

    def fail(msg: str) -> StatsFileError:
        return StatsFileError(f"{p}: {msg}")

    with NpzMembers(p, fail) as m:
        meta = _meta(m, fail)
        n_layer, n_expert = len(meta["layers"]), meta["n_expert"]
        counts = m.read("counts", "<i8", (n_layer, n_expert), max_bytes=_MAX_ARRAY_BYTES)
        coact = m.read("coact", "<i8", (n_layer, n_expert, n_expert), max_bytes=_MAX_ARRAY_BYTES)
        n_tokens = m.read("n_tokens", "<i8", (n_layer,), max_bytes=_MAX_ARRAY_BYTES)
        state = {k: m.read(_PRED_PREFIX + k, m.header(_PRED_PREFIX + k)[0], max_bytes=_MAX_ARRAY_BYTES)
                 for k in meta["predictor_arrays"]}
        extra = m.unexpected({"meta", "counts", "coact", "n_tokens", *(_PRED_PREFIX + k for k in state)})
        if extra:
            raise fail(f"unexpected arrays {extra}")
    if (counts < 0).any() or (coact < 0).any() or (n_tokens < 0).any():
        raise fail("negative counts")
    if not np.array_equal(np.diagonal(coact, axis1=1, axis2=2), counts):
        raise fail("co-activation diagonal differs from the counts")
    return RoutingStats(meta["model_fingerprint"], tuple(meta["layers"]), n_expert, counts, coact, n_tokens,
                        meta["predictor"], state)


def _meta(m: NpzMembers, fail) -> dict:
    raw = m.read("meta", "|u1", ndim=1, max_bytes=_MAX_META_BYTES)
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"meta is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise fail(f"not a routing statistics file (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise fail(f"version {meta.get('version')!r}; this ggmoe reads version {VERSION}")
    layers, n_expert = meta.get("layers"), meta.get("n_expert")
    ok = (isinstance(meta.get("model_fingerprint"), str) and isinstance(layers, list) and layers
          and all(isinstance(il, int) and not isinstance(il, bool) and il >= 0 for il in layers)
          and layers == sorted(set(layers)) and isinstance(n_expert, int) and 1 <= n_expert <= 4096
          and (meta.get("predictor") is None or isinstance(meta.get("predictor"), str))
          and isinstance(meta.get("predictor_arrays"), list)
          and all(isinstance(k, str) and k.isidentifier() for k in meta["predictor_arrays"]))
    if not ok:
        raise fail("meta is malformed (model_fingerprint, layers, n_expert, predictor, predictor_arrays)")
    return meta
