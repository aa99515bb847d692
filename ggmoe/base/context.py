"""The one rule for prompts: what a context holds and what one ``llama_decode`` takes, checked before
llama.cpp sees a token.

llama.cpp caps a context's batch at the context asked for (``n_batch = min(n_ctx, n_batch)``, before it
pads ``n_ctx`` up to a multiple of 256) and aborts the process (``GGML_ASSERT(n_tokens_all <= n_batch)``)
when one decode is handed more tokens than that. So every caller:

- builds its context with ``decode_batch(n_ctx, n_batch)`` as the batch it feeds a prompt in (the
  engine and ``llama_cpp.Llama`` both feed a prompt in chunks of their batch);
- checks each prompt with ``check_prompt``: at least one token, and room in the context for the prompt
  and one generated token.

``trace``, ``run``, ``verify-hook``, ``calibrate``, ``serve``, ``chat`` and ``ggmoe.load()`` all go
through it; a prompt that does not fit is a ``ContextLengthError`` (exit 2 at the CLI, a 400
error from the server, an exception from ``ggmoe.load()``'s ``Llama``).
"""

from __future__ import annotations

from ggmoe.base.errors import ContextLengthError, UsageError

DEFAULT_N_BATCH = 512  # tokens per llama_decode when the context is at least this large
N_CTX_PAD = 256  # llama.cpp pads every context up to a multiple of this (llama-context.cpp, GGML_PAD)
MAX_N_CTX = 1 << 24  # tokens: a larger context is a typo (llama.cpp's n_ctx is a uint32: it would wrap)


def context_tokens(n_ctx: int) -> int:
    """The context llama.cpp makes when asked for ``n_ctx`` tokens (0: the model's own, left to it).

    ``llama_cpp.Llama`` sizes its token and logit buffers by what it asked for, llama.cpp its KV cache by
    the padded size; asking for the padded size keeps the two the same (a prompt over the smaller one
    fails in numpy, past llama-cpp-python's own length check, otherwise). Bounded before anything is
    allocated: an integer in [0, MAX_N_CTX]."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or not 0 <= n_ctx <= MAX_N_CTX:
        raise UsageError(f"n_ctx {n_ctx!r}: give a number of tokens from 1 to {MAX_N_CTX} (0: the model's own)")
    return n_ctx if n_ctx == 0 else -(-n_ctx // N_CTX_PAD) * N_CTX_PAD


def decode_batch(n_ctx: int | None, n_batch: int = DEFAULT_N_BATCH) -> int:
    """The tokens one ``llama_decode`` may take in a context asked for ``n_ctx`` tokens (None: the model's
    training context, at least ``n_batch``): llama.cpp's own ``min(n_ctx, n_batch)``."""
    if n_batch < 1 or (n_ctx is not None and n_ctx < 1):
        raise UsageError(f"n_ctx ({n_ctx}) and n_batch ({n_batch}) must be at least 1")
    return n_batch if n_ctx is None else min(n_ctx, n_batch)


def check_prompt(n_tokens: int, n_ctx: int, what: str = "the prompt", room: int = 1,
                 hint: str = "raise --n-ctx or shorten it") -> None:
    """The rule: a prompt has at least one token and leaves ``room`` tokens (one generated token) in the
    context of ``n_ctx`` tokens."""
    if n_tokens < 1:
        raise UsageError(f"{what} is empty after tokenization")
    if n_tokens + room > n_ctx:
        answer = f" with room for {room} more" if room else ""
        raise ContextLengthError(f"{what}: {n_tokens} tokens do not fit n_ctx {n_ctx}{answer} ({hint})")
