"""Quality of a quantization level: perplexity, and the KL divergence of its token distributions against a
reference level's, as llama.cpp's ``llama-perplexity`` computes them (``--kl-divergence-base``).

Windows. The text's tokens are cut into windows of ``n_ctx`` tokens (BOS first where the model adds one);
each window is decoded from an empty context, and only its second half is scored: logits row ``j`` predicts
token ``j + 1`` for ``j`` in ``[n_ctx // 2, n_ctx - 1)``, so every scored token has at least half a window
of context. Perplexity is ``exp`` of the mean negative log-likelihood of the scored tokens.

The reference file (``.npz``, written atomically, read without pickle): the reference level's ``top_k`` most
likely tokens at every scored position, in descending order (ties by token id), their log-probabilities,
and the log of the probability mass outside them (``tail_logp``), with the windows' tokens and the model's
shape facts. So it is bounded: ``n_scored x (top_k x 8 + 4)`` bytes (64 tokens: 516 bytes per scored
token), not ``n_scored x n_vocab``. The KL divergence is then that of the two distributions coarsened to
``top_k + 1`` outcomes (the reference's top tokens and "any other"): a lower bound of the full divergence,
equal to it when ``top_k`` covers the vocabulary, and exactly 0 for the reference's own logits. The top-token
agreement compares argmaxes and is exact.

The numbers go through float32 log-probabilities on both sides, so a level scored against a reference it
built itself gets 0 to the last bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.npzfile import NpzMembers
from ggmoe.base.outputs import atomic_write

if TYPE_CHECKING:
    from ggmoe.inspect import ModelFacts

REF_FORMAT = 1  # the reference file's format version
ROWS = 64  # logits rows handled at once (bounds the float64 copies for large vocabularies)


@dataclass(frozen=True)
class Windows:
    """The text's windows: ``tokens[w]`` is window ``w``; rows ``first .. n_ctx - 2`` of its logits are scored."""

    tokens: np.ndarray  # [n_windows, n_ctx] int32
    first: int

    @property
    def n_ctx(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def n_scored(self) -> int:
        return int(self.tokens.shape[0]) * (self.n_ctx - 1 - self.first)


def make_windows(ids: list[int], bos: list[int], n_ctx: int, max_windows: int | None = None) -> Windows:
    """Windows of ``n_ctx`` tokens: ``bos`` then the next ``n_ctx - len(bos)`` text tokens; UsageError when the
    text does not fill one."""
    width = n_ctx - len(bos)
    n = len(ids) // width
    if n == 0:
        raise UsageError(f"the text has {len(ids)} tokens, fewer than one window of {width} "
                         f"(--ctx {n_ctx}); give a longer text or a smaller --ctx")
    if max_windows is not None:
        n = min(n, max_windows)
    rows = [list(bos) + ids[w * width:(w + 1) * width] for w in range(n)]
    return Windows(np.asarray(rows, dtype=np.int32), n_ctx // 2)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of log-probabilities, computed in float64 and returned as float32."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x.astype(np.float32)


def top_tokens(logp: np.ndarray, k: int) -> np.ndarray:
    """Each row's ``k`` most likely token ids, in descending probability, ties by ascending id."""
    if k < logp.shape[1]:
        part = np.argpartition(-logp, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(logp.shape[1]), logp.shape)
    vals = np.take_along_axis(logp, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)  # last key first: value descending, then id
    return np.take_along_axis(part, order, axis=1).astype(np.int32)


def tail_logp(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Log of each row's probability mass outside ``ids`` (-inf where ``ids`` cover the vocabulary)."""
    rest = logp.astype(np.float64)
    np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=1)
    m = rest.max(axis=1, keepdims=True)
    finite = np.isfinite(m)
    shifted = np.where(finite, rest - np.where(finite, m, 0.0), -np.inf)
    with np.errstate(divide="ignore"):
        out = np.log(np.exp(shifted).sum(axis=1)) + np.where(finite[:, 0], m[:, 0], 0.0)
    return np.where(finite[:, 0], out, -np.inf).astype(np.float32)


def kld_rows(ref_logp: np.ndarray, ref_tail: np.ndarray, logp: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """KL(reference || level) per row over the reference's top tokens plus the rest as one outcome."""
    p = np.exp(ref_logp.astype(np.float64))
    body = (p * (ref_logp.astype(np.float64) - logp.astype(np.float64))).sum(axis=1)
    p_tail = np.exp(ref_tail.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        rest = np.where(p_tail > 0, p_tail * (ref_tail.astype(np.float64) - tail.astype(np.float64)), 0.0)
    return body + rest


@dataclass(frozen=True)
class Reference:
    """The reference level's distributions at every scored position, and what they were computed on."""

    tokens: np.ndarray  # the windows' tokens [n_windows, n_ctx] int32
    first: int
    top_ids: np.ndarray  # [n_scored, top_k] int32
    top_logp: np.ndarray  # [n_scored, top_k] float32
    tail: np.ndarray  # [n_scored] float32: log of the mass outside top_ids
    meta: dict[str, Any]  # model: name, fingerprint, shape facts; n_vocab; top_k


@dataclass(frozen=True)
class Quality:
    """One level's figures over the scored tokens."""

    n_tokens: int
    ppl: float
    ppl_stderr: float  # the delta method's standard error of the perplexity
    kld_mean: float
    kld_median: float
    kld_p99: float
    top_agreement: float  # share of positions whose most likely token is the reference's

    def to_dict(self) -> dict[str, float | int]:
        return {"n_tokens": self.n_tokens, "ppl": self.ppl, "ppl_stderr": self.ppl_stderr,
                "kld_mean": self.kld_mean, "kld_median": self.kld_median, "kld_p99": self.kld_p99,
                "top_agreement": self.top_agreement}


@dataclass
class Scorer:
    """Accumulates one level's pass: give it each window's scored logits rows in order. Against ``ref`` when
    given; otherwise the level is the reference: its top tokens are kept (``reference()``) and scored against
    themselves."""

    top_k: int
    ref: Reference | None = None
    nll: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)
    built: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    row: int = 0  # scored positions seen

    def add(self, logits: np.ndarray, targets: np.ndarray) -> None:
        for a in range(0, len(targets), ROWS):
            self._add(log_softmax(logits[a:a + ROWS]), targets[a:a + ROWS])

    def _add(self, logp: np.ndarray, targets: np.ndarray) -> None:
        n = len(targets)
        if self.ref is None:
            ids = top_tokens(logp, min(self.top_k, logp.shape[1]))
            ref = (ids, np.take_along_axis(logp, ids, axis=1), tail_logp(logp, ids))
            self.built.append(ref)
        else:
            sl = slice(self.row, self.row + n)
            ref = (self.ref.top_ids[sl], self.ref.top_logp[sl], self.ref.tail[sl])
        ids = ref[0]
        self.nll.append(-np.take_along_axis(logp, targets[:, None].astype(np.int64), axis=1)[:, 0])
        self.kld.append(kld_rows(ref[1], ref[2], np.take_along_axis(logp, ids, axis=1), tail_logp(logp, ids)))
        self.agree.append(logp.argmax(axis=1) == ids[:, 0])
        self.row += n

    def result(self) -> Quality:
        nll = np.concatenate(self.nll).astype(np.float64)
        kld = np.concatenate(self.kld)
        mean = float(nll.mean())
        stderr = float(nll.std(ddof=1) / np.sqrt(len(nll))) if len(nll) > 1 else 0.0
        ppl = float(np.exp(mean))
        return Quality(len(nll), ppl, ppl * stderr, float(kld.mean()), float(np.median(kld)),
                       float(np.percentile(kld, 99)), float(np.concatenate(self.agree).mean()))

    def reference(self, windows: Windows, meta: dict[str, Any]) -> Reference:
        ids, logp, tail = (np.concatenate([b[i] for b in self.built]) for i in range(3))
        return Reference(windows.tokens, windows.first, ids, logp, tail, {**meta, "top_k": int(ids.shape[1])})


class Decoder(Protocol):
    """What a quality pass needs of an engine (``ggmoe.engine.Engine`` is one)."""

    def reset(self) -> None: ...

    def decode(self, tokens: list[int], all_logits: bool = False) -> np.ndarray: ...


def score(decoder: Decoder, windows: Windows, scorer: Scorer) -> Quality:
    """One pass of a level over the windows, each from an empty context."""
    for row in windows.tokens:
        decoder.reset()
        logits = decoder.decode([int(t) for t in row], all_logits=True)
        scorer.add(logits[windows.first:-1], row[windows.first + 1:])
    return scorer.result()


def save_reference(path: str | Path, ref: Reference) -> None:
    meta = json.dumps({"format": REF_FORMAT, "first": ref.first, **ref.meta}).encode()
    with atomic_write(path) as f:
        np.savez(f, tokens=ref.tokens, top_ids=ref.top_ids, top_logp=ref.top_logp, tail=ref.tail,
                 meta=np.frombuffer(meta, dtype=np.uint8))


def load_reference(path: str | Path) -> Reference:
    """A reference file this module wrote; UsageError naming the file otherwise."""
    def fail(msg: str) -> UsageError:
        return UsageError(f"--kl-base {path}: {msg}")

    if not Path(path).is_file():
        raise fail("no such file")
    with NpzMembers(path, fail) as m:
        if m.names != {"tokens", "top_ids", "top_logp", "tail", "meta"}:
            raise fail("not a ggmoe compare-quants reference (written by --save-kl-base)")
        try:
            meta = json.loads(m.read("meta", np.uint8, ndim=1, max_bytes=1 << 20).tobytes())
        except (ValueError, UnicodeDecodeError):
            raise fail("its meta is not JSON") from None
        if not isinstance(meta, dict) or meta.get("format") != REF_FORMAT:
            raise fail(f"format {meta.get('format') if isinstance(meta, dict) else '?'}, expected {REF_FORMAT}")
        tokens = m.read("tokens", np.int32, ndim=2)
        ids = m.read("top_ids", np.int32, ndim=2)
        logp = m.read("top_logp", np.float32, ids.shape)
        tail = m.read("tail", np.float32, (ids.shape[0],))
    first = meta.get("first")
    if not isinstance(first, int) or not 0 < first < tokens.shape[1] - 1 or \
            ids.shape[0] != tokens.shape[0] * (tokens.shape[1] - 1 - first):
        raise fail("its arrays do not agree with each other")
    return Reference(tokens, first, ids, logp, tail, meta)


def model_key(facts: ModelFacts) -> dict[str, Any]:
    """The GGUF facts every quantization level of one model shares (not the types or the bytes)."""
    return {"arch": facts.arch, "n_layer": facts.n_layer, "n_embd": facts.n_embd, "n_expert": facts.n_expert,
            "n_expert_used": facts.n_expert_used, "n_expert_shared": facts.n_expert_shared,
            "n_ff_exp": facts.n_ff_exp, "moe_layers": list(facts.moe_layers)}


def key_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first field where two model keys differ, as ``field x vs y``; None when they agree."""
    for name in a:
        if a[name] != b.get(name):
            return f"{name} {a[name]} vs {b.get(name)}"
    return None


def check_reference(ref: Reference, windows: Windows, key: dict[str, Any], n_vocab: int, where: str) -> None:
    """The reference must come from a level of this model (``key``), over these windows' tokens."""
    diff = key_difference(ref.meta.get("model", {}).get("key", {}), key)
    if diff is not None:
        raise UsageError(f"--kl-base {where}: made from another model than the levels ({diff})")
    if ref.meta.get("n_vocab") != n_vocab:
        raise UsageError(f"--kl-base {where}: made with a vocabulary of {ref.meta.get('n_vocab')} tokens, "
                         f"the levels have {n_vocab}")
    if ref.tokens.shape != windows.tokens.shape or ref.first != windows.first or \
            not np.array_equal(ref.tokens, windows.tokens):
        raise UsageError(f"--kl-base {where}: made on other tokens ({ref.tokens.shape[0]} windows of "
                         f"{ref.tokens.shape[1]}; here {windows.tokens.shape[0]} of {windows.n_ctx}): give the "
                         "--text, --ctx and --chunks it was made with")
