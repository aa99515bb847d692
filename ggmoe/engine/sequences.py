"""Several sequences in one ``llama_decode``, sampling from a copied logits row, one sequence's KV state.

Engine layer (ctypes allowed): ``ggmoe.serve``'s parallel slots use these and never touch ctypes.

- ``SeqBatch``: one ``llama_batch`` holding several sequences' tokens (each with its own ``seq_id`` and
  positions), decoded with one ``llama_decode``; the logits of each entry's last token are copied out
  (the next decode overwrites the context's), one row of ``n_vocab`` float32 per entry.
- ``sample_row``: a ``llama_sampler`` chain applied to such a row, as ``llama_sampler_sample`` applies it
  to the context's logits (llama-sampler.cpp: every token id with its logit, ``p`` 0, unsorted; apply;
  the selected token is accepted), so a slot samples whenever its thread gets to it.
- ``seq_state`` / ``set_seq_state``: one sequence's KV cells as bytes (``llama_state_seq_*``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ggmoe.base.errors import EngineError
from ggmoe.engine import ggml as B

_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


@dataclass(frozen=True)
class SeqEntry:
    """One sequence's tokens in a multi-sequence decode."""

    seq_id: int  # llama_seq_id, 0 .. n_seq_max - 1
    n_past: int  # tokens of this sequence already in the KV cache: the first token's position
    tokens: tuple[int, ...]  # token ids (at least one); only the last one's logits are read


class SeqBatch:
    """A ``llama_batch`` of up to ``n_tokens_max`` tokens of any sequences, reused for every decode."""

    def __init__(self, n_tokens_max: int, n_vocab: int) -> None:
        self.n_tokens_max = n_tokens_max
        self.n_vocab = n_vocab
        # struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
        self._batch = B.llama_cpp.llama_batch_init(n_tokens_max, 0, 1)
        self._live = True

    def fill(self, entries: Sequence[SeqEntry]) -> list[int]:
        """Write ``entries`` into the batch; the batch index of each entry's last token."""
        b = self._batch
        n = 0
        last = []
        for e in entries:
            if not e.tokens:
                raise EngineError(f"sequence {e.seq_id}: an empty entry in a multi-sequence decode")
            for j, tok in enumerate(e.tokens):
                if n >= self.n_tokens_max:
                    raise EngineError(f"a multi-sequence decode of more than {self.n_tokens_max} tokens")
                b.token[n] = tok
                b.pos[n] = e.n_past + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = e.seq_id
                b.logits[n] = j == len(e.tokens) - 1
                n += 1
            last.append(n - 1)
        b.n_tokens = n
        return last

    def decode(self, ctx_ptr: int, entries: Sequence[SeqEntry]) -> list[np.ndarray]:
        """One ``llama_decode`` of every entry; a copy of each entry's last logits row (float32, n_vocab)."""
        last = self.fill(entries)
        step = len(entries) > 1 and all(len(e.tokens) == 1 for e in entries)  # one token alone: n_threads already
        rc = _decode_step(ctx_ptr, self._batch) if step else \
            B.llama_cpp.llama_decode(ctx_ptr, self._batch)  # int32_t llama_decode(llama_context *, llama_batch);
        if rc != 0:
            raise EngineError(f"llama_decode of {len(entries)} sequences failed (status {rc}: "
                              f"{'no room in the KV cache' if rc == 1 else 'aborted or error'})")
        rows = []
        for i in last:
            # float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
            ptr = B.llama_cpp.llama_get_logits_ith(ctx_ptr, i)
            if not ptr:
                raise EngineError(f"no logits for batch index {i}")
            rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return rows

    def close(self) -> None:
        if self._live:
            B.llama_cpp.llama_batch_free(self._batch)  # void llama_batch_free(struct llama_batch batch);
            self._live = False


def _decode_step(ctx_ptr: int, batch: object) -> int:
    """``llama_decode`` of a generation step (one token from each of several sequences) on the context's
    generation threads (``n_threads``), as llama.cpp decodes a single token, not on ``n_threads_batch``, which
    it takes for any micro-batch of more than one token. A step is a decode, not a prompt: on a CPU the batch
    threads spin through it and take the cores the other slots' sampling needs (``serve --parallel 4`` at the
    defaults on 2 cores served 0.40x one request at a time, 0.82x with this; docs/benchmarks.md)."""
    # int32_t llama_n_threads(llama_context *); int32_t llama_n_threads_batch(llama_context *);
    n_threads, n_batch = B.llama_cpp.llama_n_threads(ctx_ptr), B.llama_cpp.llama_n_threads_batch(ctx_ptr)
    if n_threads == n_batch:
        return B.llama_cpp.llama_decode(ctx_ptr, batch)
    # void llama_set_n_threads(llama_context *, int32_t n_threads, int32_t n_threads_batch);
    B.llama_cpp.llama_set_n_threads(ctx_ptr, n_threads, n_threads)
    try:
        return B.llama_cpp.llama_decode(ctx_ptr, batch)
    finally:
        B.llama_cpp.llama_set_n_threads(ctx_ptr, n_threads, n_batch)


def sample_row(sampler_ptr: int, logits: np.ndarray) -> int:
    """The token a ``llama_sampler`` (chain) picks from one logits row, accepted into its state: what
    ``llama_sampler_sample`` does with the context's row (no backend sampler)."""
    cur = np.zeros(logits.shape[0], dtype=_TOKEN_DATA)
    cur["id"] = np.arange(logits.shape[0], dtype=np.intc)
    cur["logit"] = logits
    # typedef struct llama_token_data_array { llama_token_data * data; size_t size; int64_t selected;
    #                                         bool sorted; } llama_token_data_array;
    arr = B.llama_cpp.llama_token_data_array(
        data=cur.ctypes.data_as(B.llama_cpp.llama_token_data_p), size=cur.shape[0], selected=-1, sorted=False)
    # void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
    B.llama_cpp.llama_sampler_apply(sampler_ptr, ctypes.byref(arr))
    if not 0 <= arr.selected < arr.size:
        raise EngineError(f"the sampler selected no token (selected {arr.selected} of {arr.size})")
    token = int(arr.data[arr.selected].id)
    B.llama_cpp.llama_sampler_accept(sampler_ptr, token)  # void llama_sampler_accept(smpl, llama_token token);
    return token


def seq_state(ctx_ptr: int, seq_id: int) -> bytes:
    """One sequence's KV cells (``llama_state_seq_get_data``)."""
    # size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
    n = B.llama_cpp.llama_state_seq_get_size(ctx_ptr, seq_id)
    buf = (ctypes.c_uint8 * max(n, 1))()
    # size_t llama_state_seq_get_data(ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
    got = B.llama_cpp.llama_state_seq_get_data(ctx_ptr, buf, n, seq_id)
    return bytes(buf)[:got]


def set_seq_state(ctx_ptr: int, seq_id: int, data: bytes) -> bool:
    """Load one sequence's KV cells from ``data`` (False when llama.cpp refuses it)."""
    buf = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
    # size_t llama_state_seq_set_data(ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
    return bool(B.llama_cpp.llama_state_seq_set_data(ctx_ptr, buf, len(data), seq_id))
