"""ggmoe on a ``llama_cpp.Llama``: experts in host memory at load, the route hook and cache after.

Engine layer (ctypes allowed): ``ggmoe.serve`` uses these two pieces and never
touches ctypes itself. Both are the ``Engine``'s own parts, assembled on a
context that llama-cpp-python created:

- ``HostExpertOverride`` (``ggmoe.engine.loader``) fills
  ``llama_model_params.tensor_buft_overrides`` while ``Llama`` loads the model;
- ``LlamaAttachment`` is the engine's ``CachePipeline`` (``ggmoe.engine.pipeline``)
  on the loaded context (raw ``llama_model *`` / ``llama_context *``): route
  hook, cache runtime, decode mode, expert tables, controller and prefetcher,
  exactly as the engine builds them.
"""

from __future__ import annotations

from ggmoe.engine import ggml as B
from ggmoe.engine.loader import HostExpertOverride, no_read_ahead, resolve_tiers
from ggmoe.engine.pipeline import CachePipeline

__all__ = ["CachePipeline", "HostExpertOverride", "LlamaAttachment", "fim_tokens", "grammar_parses", "is_eog",
           "n_ctx_seq", "no_read_ahead", "resolve_tiers", "set_embeddings"]


def n_ctx_seq(ctx_ptr: int) -> int:
    """The tokens one sequence may hold in the context's KV cache (the whole context when unified)."""
    return int(B.llama_cpp.llama_n_ctx_seq(ctx_ptr))  # uint32_t llama_n_ctx_seq(const struct llama_context * ctx);


def set_embeddings(ctx_ptr: int, on: bool) -> None:
    """Whether the context's decodes output embeddings instead of logits."""
    B.llama_cpp.llama_set_embeddings(ctx_ptr, on)  # void llama_set_embeddings(struct llama_context * ctx, bool);


def is_eog(vocab_ptr: int, token: int) -> bool:
    """Whether ``token`` ends a generation (EOS, EOT ...)."""
    # bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
    return bool(B.llama_cpp.llama_vocab_is_eog(vocab_ptr, token))


def fim_tokens(vocab_ptr: int) -> dict[str, int]:
    """The vocabulary's fill-in-the-middle tokens (pre, suf, mid, pad, rep, sep); -1 where it has none."""
    c = B.llama_cpp  # llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab); and the other five
    return {name: int(getattr(c, f"llama_vocab_fim_{name}")(vocab_ptr))
            for name in ("pre", "suf", "mid", "pad", "rep", "sep")}


def grammar_parses(vocab_ptr: int, grammar: str, root: str = "root") -> bool:
    """Whether llama.cpp's GBNF parser accepts ``grammar`` (with rule ``root``) for this vocabulary.

    llama-cpp-python builds the grammar sampler without checking llama.cpp's NULL for a grammar that
    does not parse, and the process then crashes; a trial build here says so first.
    """
    llama_cpp = B.llama_cpp
    # struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab,
    #                                                   const char * grammar_str, const char * grammar_root);
    sampler = llama_cpp.llama_sampler_init_grammar(vocab_ptr, grammar.encode("utf-8"), root.encode("utf-8"))
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)  # void llama_sampler_free(struct llama_sampler * smpl);
    return True


# The pipeline an ``Engine`` builds, on a context llama-cpp-python created (the name ggmoe.load() uses).
LlamaAttachment = CachePipeline
