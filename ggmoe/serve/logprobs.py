"""Logprobs of generated tokens without ``logits_all``: each step's logits exist anyway.

A ``LogprobRecorder`` is a llama-cpp-python logits processor (it sees the raw logits of every sampling step,
before any bias or grammar) and the per-token hook of the generation (it learns which token was sampled).
From both it keeps, per generated token, its logprob and the ``top`` best alternatives. The entries are
then cut to the text the response carries (stop strings and end-of-generation tokens excluded) and shaped
as OpenAI's chat ``logprobs.content`` or the legacy completions ``logprobs`` object, with plain floats and
``bytes`` filled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: bytes  # the token's piece
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]  # (token, piece, logprob), best first


class LogprobRecorder:
    """Logits processor + token hook; ``entries`` grows by one per sampled token (EOG tokens excluded)."""

    def __init__(self, top: int, piece: Callable[[int], bytes], is_eog: Callable[[int], bool]) -> None:
        self.top = top  # alternatives per token (0: the sampled token's logprob only)
        self.piece = piece  # token id -> bytes
        self.is_eog = is_eog
        self._last: np.ndarray | None = None  # log-softmax of the latest step
        self.entries: list[TokenLogprob] = []

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        x = scores.astype(np.float64)
        m = x.max()
        self._last = x - (m + np.log(np.exp(x - m).sum()))
        return scores

    def on_token(self, token: int) -> None:
        lp = self._last
        self._last = None
        if lp is None or self.is_eog(token):
            return
        top: tuple[tuple[int, bytes, float], ...] = ()
        if self.top > 0:
            k = min(self.top, lp.shape[0])
            idx = np.argpartition(-lp, k - 1)[:k]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = tuple((int(i), self.piece(int(i)), float(lp[i])) for i in idx)
        self.entries.append(TokenLogprob(int(token), self.piece(int(token)), float(lp[token]), top))

    def covering(self, start: int, n_bytes: int) -> tuple[list[TokenLogprob], int]:
        """The entries from ``start`` whose pieces fit in ``n_bytes`` bytes of text, and the next index."""
        out: list[TokenLogprob] = []
        used = 0
        i = start
        while i < len(self.entries) and used + len(self.entries[i].text) <= n_bytes:
            used += len(self.entries[i].text)
            out.append(self.entries[i])
            i += 1
        return out, i


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs`` of a chat completion."""
    return {"content": [{"token": _text(e.text), "logprob": e.logprob, "bytes": list(e.text),
                         "top_logprobs": [{"token": _text(t), "logprob": lp, "bytes": list(t)}
                                          for _, t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs (maps), text_offset."""
    offsets = []
    pos = offset
    for e in entries:
        offsets.append(pos)
        pos += len(_text(e.text))
    return {"tokens": [_text(e.text) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(t): lp for _, t, lp in e.top} for e in entries], "text_offset": offsets}


def plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays turned into Python numbers and lists (JSON-serialisable)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
