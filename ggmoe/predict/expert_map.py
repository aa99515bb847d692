"""The ``expert-map`` predictor (fMoE): search a store of per-iteration router probability maps.

An expert map is one iteration's (here: one token's) router probabilities at every
MoE layer, ``[n_layer, n_expert]``, each row normalised to sum to 1. The store keeps
up to ``capacity`` maps, each with a semantic key: the mean embedding of its
request's tokens up to that token. Traces hold no token embeddings, so the key
uses the first MoE layer's input hidden state as the embedding proxy (the closest
traced state to the embeddings; it has seen one attention block).

Search, per token:

- semantic: before any layer of the token has been observed (with stride s, the
  targets among the first s MoE layers: fMoE's d = s), the stored map whose key is
  most cosine-similar to the request's running mean key;
- trajectory: afterwards, the stored map whose observed prefix (layers 0..l,
  flattened) is most cosine-similar to the token's own probabilities so far.

From the matched map's target row, with match score ``score`` (the cosine),
the similarity-aware threshold ``delta = clip(1 - score, 0, 1)`` selects the most
probable experts until their cumulative probability reaches delta, at least
n_expert_used: a confident match prefetches few experts, a poor one many. Scores
returned are the map's probabilities plus 1 for the selected experts, so the
selected set ranks first.

When the store is full, a new map replaces the stored one with the highest
combined redundancy ``w * semantic + (1 - w) * trajectory`` similarity,
``w = stride / n_layer`` (deduplication). With ``online`` each finished token's
map is added, as fMoE does after each iteration.
"""

from __future__ import annotations

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.params import MAX_COLLECTION, Param, check_state_bytes
from ggmoe.predict.base import PREDICTORS, ModelShape, Predictor
from ggmoe.trace.format import Trace


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


def select_count(row: np.ndarray, score: float, k: int) -> int:
    """Experts to prefetch from a map row [n_expert] (sums to 1) matched with similarity ``score``."""
    delta = min(max(1.0 - score, 0.0), 1.0)
    mass = np.cumsum(np.sort(row)[::-1], dtype=np.float64)
    return int(np.clip(int(np.sum(mass < delta)) + 1, k, row.shape[0]))


class MapStore:
    """Fixed-capacity store of expert maps with semantic keys."""

    def __init__(self, capacity: int, n_layer: int, n_expert: int, n_embd: int, semantic_weight: float) -> None:
        if capacity < 1:
            raise UsageError(f"expert-map: capacity {capacity} must be at least 1")
        check_state_bytes("expert-map", 4 * capacity * (n_embd + 3 * n_layer * n_expert + n_layer),
                          "lower its capacity")
        self.capacity = capacity
        self.semantic_weight = semantic_weight  # w of the redundancy score
        self.keys = np.zeros((capacity, n_embd), dtype=np.float32)  # [C, n_embd] unit keys (0: none)
        self.maps = np.zeros((capacity, n_layer, n_expert), dtype=np.float32)  # [C, L, E] rows sum to 1
        self.by_layer = np.zeros((n_layer, capacity, n_expert), dtype=np.float32)  # [L, C, E] same, layer-major
        self.flat_unit = np.zeros((capacity, n_layer * n_expert), dtype=np.float32)  # [C, L*E] unit maps
        self.prefix_norm = np.zeros((capacity, n_layer), dtype=np.float32)  # [C, L] norm of layers 0..l
        self.origin = np.full(capacity, -1, dtype=np.int64)  # sequence number of the add that wrote it
        self.n = 0
        self._adds = 0

    def add(self, key: np.ndarray | None, emap: np.ndarray) -> int:
        """Store a map [n_layer, n_expert] (rows sum to 1) with key [n_embd] (or None); returns the slot."""
        ukey = _unit(key.astype(np.float32)) if key is not None else np.zeros(self.keys.shape[1], np.float32)
        flat = _unit(emap.ravel())
        if self.n < self.capacity:
            slot = self.n
            self.n += 1
        else:
            w = self.semantic_weight
            redundancy = w * (self.keys @ ukey) + (1.0 - w) * (self.flat_unit @ flat)
            slot = int(np.argmax(redundancy))
        self.keys[slot] = ukey
        self.maps[slot] = emap
        self.by_layer[:, slot] = emap
        self.flat_unit[slot] = flat
        self.prefix_norm[slot] = np.sqrt(np.cumsum(np.square(emap).sum(axis=1)))
        self.origin[slot] = self._adds
        self._adds += 1
        return slot

    def arrays(self) -> dict[str, np.ndarray]:
        """The entries in use: ``keys`` [n, n_embd], ``maps`` [n, L, E] float32, ``origin`` [n] int64."""
        n = self.n
        return {"keys": self.keys[:n].copy(), "maps": self.maps[:n].copy(), "origin": self.origin[:n].copy()}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Entries saved by ``arrays()``, re-added in their original order (derived arrays recomputed)."""
        keys, maps, origin = arrays.get("keys"), arrays.get("maps"), arrays.get("origin")
        ok = (keys is not None and maps is not None and origin is not None and maps.ndim == 3
              and maps.shape[1:] == self.maps.shape[1:] and keys.shape == (maps.shape[0], self.keys.shape[1])
              and origin.shape == maps.shape[:1] and maps.dtype == keys.dtype == np.float32
              and origin.dtype == np.int64 and np.all(np.isfinite(maps)) and np.all(np.isfinite(keys)))
        if not ok:
            raise UsageError("expert-map: the saved maps do not fit this model (keys [n, n_embd], maps [n, L, E] "
                             "float32, origin [n] int64)")
        for i in np.argsort(origin, kind="stable"):
            self.add(keys[i] if np.any(keys[i]) else None, maps[i])

    def semantic(self, key: np.ndarray | None) -> tuple[int, float]:
        """Best entry and cosine for a key [n_embd]; without a key, (-1, 0.0): no match."""
        if key is None or self.n == 0 or not np.any(key):
            return -1, 0.0
        sims = self.keys[:self.n] @ _unit(key.astype(np.float32))
        best = int(np.argmax(sims))
        return best, float(np.clip(sims[best], -1.0, 1.0))


def _row(probs: np.ndarray | None, ids: np.ndarray, n_expert: int) -> np.ndarray:
    """One layer's map row [n_expert] summing to 1 (router probs, or the selection if none)."""
    if probs is None:
        row = np.zeros(n_expert, dtype=np.float32)
        row[ids] = 1.0
    else:
        row = np.asarray(probs, dtype=np.float32)
    s = float(row.sum())
    return row / s if s > 0 else np.full(n_expert, 1.0 / n_expert, dtype=np.float32)


@PREDICTORS.register("expert-map")
class ExpertMap(Predictor):
    """fMoE's fine-grained expert maps (see the module docstring)."""

    needs_fit = True
    needs_probs = True
    PARAMS = (Param("capacity", int, low=1, high=MAX_COLLECTION, help="expert maps kept"),
              Param("online", bool, help="store each token's map while serving"))

    def __init__(self, shape: ModelShape, stride: int = 1, capacity: int = 1024, online: bool = True) -> None:
        super().__init__(shape, stride)
        self.store = MapStore(capacity, shape.n_layer, shape.n_expert, shape.n_embd,
                              semantic_weight=stride / shape.n_layer)
        self.online = online
        n_l, n_e = shape.n_layer, shape.n_expert
        self._map = np.zeros((n_l, n_e), dtype=np.float32)  # [L, E] the current token's map so far
        self._key_sum = np.zeros(shape.n_embd, dtype=np.float64)  # sum of the request's layer-0 inputs
        self._n_key = 0
        self._dots = np.zeros(capacity, dtype=np.float64)  # [C] <token prefix, stored prefix>
        self._qsq = 0.0  # squared norm of the token's prefix
        self._now = -1  # position of the latest observed layer
        self._token_key: np.ndarray | None = None  # the key the current token's map is stored with
        self._match: tuple[int, float] | None = None  # (entry, score) cached until the next observe
        self.last_match: tuple[int, float] | None = None  # for inspection

    def _key(self) -> np.ndarray | None:
        return (self._key_sum / self._n_key).astype(np.float32) if self._n_key else None

    def fit(self, trace: Trace) -> None:
        h0 = trace.hidden[:, 0] if trace.hidden is not None else None  # [T, n_embd] layer-0 inputs
        for p in range(trace.n_prompts):
            sl = trace.prompt_slice(p)
            probs = trace.probs[sl].astype(np.float32)  # [T_p, L, E]
            probs /= np.maximum(probs.sum(axis=2, keepdims=True), 1e-12)
            keys = None
            if h0 is not None:  # running mean, as the request would see it
                csum = np.cumsum(h0[sl].astype(np.float64), axis=0)
                keys = (csum / np.arange(1, csum.shape[0] + 1)[:, None]).astype(np.float32)
            for t in range(probs.shape[0]):
                self.store.add(keys[t] if keys is not None else None, probs[t])

    def begin_request(self) -> None:
        self._key_sum[:] = 0
        self._n_key = 0
        self._token_key = None
        self._now = -1

    def begin_token(self, token_id: int) -> None:
        self._keep_token()
        self._map[:] = 0
        self._dots[:] = 0
        self._qsq = 0.0
        self._now = -1
        self._match = None

    def end_request(self) -> None:
        self._keep_token()

    def state(self) -> dict[str, np.ndarray]:
        return self.store.arrays()

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.store.restore(arrays)

    @property
    def has_state(self) -> bool:
        return self.store.n > 0

    def _keep_token(self) -> None:
        if self.online and self._now == self.shape.n_layer - 1:  # a complete token map
            self.store.add(self._token_key, self._map.copy())
        self._now = -1

    def observe(self, il: int, ids: np.ndarray, probs: np.ndarray | None, hidden: np.ndarray | None) -> None:
        j = self._pos[il]
        row = _row(probs, np.asarray(ids), self.shape.n_expert)
        self._map[j] = row
        s = self.store
        self._dots[:s.n] += s.by_layer[j, :s.n] @ row
        self._qsq += float(row @ row)
        if j == 0 and hidden is not None:
            self._key_sum += hidden
            self._n_key += 1
            self._token_key = self._key()
        self._now = j
        self._match = None

    def _search(self) -> tuple[int, float]:
        s = self.store
        if s.n == 0:
            raise UsageError("expert-map: the map store is empty: fit() it on training traces first")
        if self._now < 0:
            return s.semantic(self._key())
        cos = self._dots[:s.n] / (np.sqrt(self._qsq) * np.maximum(s.prefix_norm[:s.n, self._now], 1e-12))
        best = int(np.argmax(cos))
        return best, float(np.clip(cos[best], -1.0, 1.0))

    def predict(self, il_target: int) -> np.ndarray | None:
        if self._match is None:
            self._match = self.last_match = self._search()
        return self._scores(*self._match, self._pos[il_target])

    predicts_next = True

    def predict_next(self, il: int) -> np.ndarray | None:
        """The next token at ``il``: fMoE's search before an iteration's first layer, the semantic one (the
        stored map whose key best matches the request's running key), as ``predict`` does at a token's start."""
        if self.store.n == 0:
            raise UsageError("expert-map: the map store is empty: fit() it on training traces first")
        return self._scores(*self.store.semantic(self._key()), self._pos[il])

    def _scores(self, entry: int, score: float, i: int) -> np.ndarray:
        """The matched map's row of layer position ``i`` (-1: the store's mean), its delta-selected experts + 1."""
        s = self.store
        row = s.maps[entry, i] if entry >= 0 else s.maps[:s.n, i].mean(axis=0)  # no key: the store's mean
        n_sel = select_count(row, score, self.shape.n_expert_used)
        scores = row.copy()
        scores[np.argsort(-row, kind="stable")[:n_sel]] += 1.0
        return scores
