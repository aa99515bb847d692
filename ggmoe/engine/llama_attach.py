"""ggmoe on a ``llama_cpp.Llama``: experts in host memory at load, the route hook and cache after.

Engine layer (ctypes allowed): ``ggmoe.serve`` uses these two pieces and never
touches ctypes itself. Both are the ``Engine``'s own parts, assembled on a
context that llama-cpp-python created:

- ``HostExpertOverride`` (``ggmoe.engine.loader``) fills
  ``llama_model_params.tensor_buft_overrides`` while ``Llama`` loads the model;
- ``LlamaAttachment`` installs the ``RouteOpHook`` on the loaded context (raw
  ``llama_model *`` / ``llama_context *``), builds the ``CacheRuntime`` and the
  ``Prefetcher`` as the engine does, and re-raises after a decode what the
  callback or the prefetch worker stored (a callback never raises into C).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ggmoe.cache import CacheConfig, CacheStats
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.graph_predictor import attach_graph_predictor
from ggmoe.engine.hooks import RouteOpHook
from ggmoe.engine.loader import HostExpertOverride
from ggmoe.engine.slots import CacheRuntime
from ggmoe.hook import RouteObserver
from ggmoe.inspect.facts import ModelFacts

__all__ = ["HostExpertOverride", "LlamaAttachment", "grammar_parses"]


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


class LlamaAttachment:
    """The route hook and its observers, and with a config the expert cache and its prefetcher, on a context."""

    def __init__(self, model_ptr: int, ctx_ptr: int, facts: ModelFacts, model_path: Path,
                 cache: CacheConfig | None, observers: Sequence[RouteObserver] = ()) -> None:
        _patched.load()  # EngineNotPatchedError names the fix when the engine lacks the patch
        self._ctx_ptr = ctx_ptr
        self.hook = RouteOpHook()
        self.runtime: CacheRuntime | None = None
        self.prefetcher = None  # ggmoe.cache.prefetch.Prefetcher when the cache prefetches
        self.graph_predictor = None  # its nets in the graph (ggmoe.engine.graph_predictor), when it has any
        self.hook.install(ctx_ptr)
        try:
            for obs in observers:
                self.hook.observers.add(obs)
            if cache is None:
                return
            self.runtime = CacheRuntime.for_model(model_ptr, ctx_ptr, cache, facts)
            self.hook.cache = self.runtime.cache
            if cache.prefetch is not None:
                from ggmoe.cache.prefetch import make_prefetcher

                self.prefetcher = make_prefetcher(self.runtime.cache, cache.prefetch, facts, str(model_path))
                if cache.prefetch.in_graph:
                    self.graph_predictor = attach_graph_predictor(ctx_ptr, self.prefetcher.predictor,
                                                                  facts.moe_layers)
                    if self.graph_predictor is not None:
                        self.prefetcher.scores_from_graph()
                self.hook.observers.add(self.prefetcher)
        except BaseException:
            self.detach()
            self.close()
            raise

    @property
    def stats(self) -> CacheStats | None:
        return self.runtime.cache.stats if self.runtime is not None else None

    @property
    def n_slots(self) -> dict[int, int]:
        return dict(self.runtime.cache.n_slots) if self.runtime is not None else {}

    def occupancy(self) -> dict[int, int]:
        """Resident experts per cached layer (0 .. n_slots)."""
        if self.runtime is None:
            return {}
        return {il: len(t.resident()) for il, t in self.runtime.cache.tables.items()}

    def begin_step(self, tokens: Sequence[int]) -> None:
        """Before each ``llama_decode``: the tokens of the batch (the token-based predictors read them)."""
        if self.prefetcher is not None:
            self.prefetcher.begin_step(list(tokens))

    def take_error(self) -> BaseException | None:
        """What the callback, the route op or the prefetch worker stored during the last decode (cleared)."""
        err = self.hook.take_error(self._ctx_ptr) if self._ctx_ptr else None
        if err is None and self.prefetcher is not None:
            err = self.prefetcher.take_error()
        return err

    def detach(self) -> None:
        """Stop the prefetch worker and remove the callback from the context (before it is freed)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._ctx_ptr:
            self.hook.uninstall(self._ctx_ptr)
            if self.graph_predictor is not None:  # out of the context's graphs before its tensors go
                self.graph_predictor.close(ctx_alive=True)
                self.graph_predictor = None
            self._ctx_ptr = 0

    def close(self) -> None:
        """Free the slot tensors and the copy stream (after the context that computed with them)."""
        self.detach()
        if self.graph_predictor is not None:
            self.graph_predictor.close()
            self.graph_predictor = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
