"""LangChain's ``ChatLlamaCpp`` and ``LlamaCpp`` on ggmoe's model.

langchain-community's classes build their own ``llama_cpp.Llama`` in a validator and overwrite a ``client=``
given to them, so ``ChatLlamaCpp(client=ggmoe.load())`` would load the model a second time, without ggmoe.
These subclasses replace that validator: ``client=`` a loaded model (``ggmoe.load(...)``) is used as it is;
without one, the model is loaded once with ``ggmoe.load(model_path, ...)`` from the fields given
(``n_ctx``, ``n_threads``, ... and ``model_kwargs``, where ggmoe's own options such as ``cache_slots`` go).
Everything else (invoke, stream, tools, structured output) is LangChain's code, unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

from langchain_community.chat_models.llamacpp import ChatLlamaCpp as _ChatLlamaCpp
from langchain_community.llms.llamacpp import LlamaCpp as _LlamaCpp
from pydantic import PydanticDeprecatedSince20, model_validator, root_validator
from typing_extensions import Self

__all__ = ["ChatLlamaCpp", "LlamaCpp"]

# The fields LangChain hands to ``Llama(...)``: they describe the load, so they mean nothing beside ``client=``.
LOAD_FIELDS = ("rope_freq_scale", "rope_freq_base", "lora_path", "lora_base", "n_ctx", "n_parts", "seed",
               "f16_kv", "logits_all", "vocab_only", "use_mlock", "n_threads", "n_batch", "use_mmap",
               "last_n_tokens_size", "verbose", "n_gpu_layers")


def _attach_or_load(model: Any) -> None:
    """Use ``model.client`` when given (refusing load fields beside it), else load through ``ggmoe.load``.

    Only the fields the caller set are passed on: LangChain's defaults (``n_batch=8``, ``rope_freq_base=10000``,
    ``verbose=True``) would override the model's own settings and ggmoe's defaults.
    """
    given = sorted(f for f in LOAD_FIELDS if f in model.model_fields_set and f != "model_kwargs")
    given += [f"model_kwargs {sorted(model.model_kwargs)}"] if model.model_kwargs else []
    if model.client is not None:
        if given:
            raise ValueError(f"{', '.join(given)}: these set how a model loads, and client= is loaded already; "
                             "give them to ggmoe.load() instead")
        if not model.model_path:
            model.model_path = model.client.model_path
        return
    import ggmoe

    params = {f: getattr(model, f) for f in given if not f.startswith("model_kwargs")}
    params.update(model.model_kwargs)
    model.client = ggmoe.load(model.model_path, **params)
    model.model_path = model.client.model_path


def _grammar(model: Any) -> None:
    """LangChain's own grammar handling: ``grammar`` (GBNF text) or ``grammar_path``, parsed once."""
    from llama_cpp import LlamaGrammar

    if model.grammar and model.grammar_path:
        raise ValueError("give grammar or grammar_path, not both")
    if isinstance(model.grammar, str):
        model.grammar = LlamaGrammar.from_string(model.grammar)
    elif model.grammar_path:
        model.grammar = LlamaGrammar.from_file(model.grammar_path)


class ChatLlamaCpp(_ChatLlamaCpp):
    """``langchain_community.chat_models.ChatLlamaCpp`` on ``client=ggmoe.load(...)``, or loading through ggmoe."""

    model_path: str | None = None
    """The GGUF; the client's when ``client`` is given, ggmoe's embedded model when neither is."""

    @model_validator(mode="after")
    def validate_environment(self) -> Self:  # replaces the parent's validator of this name
        _attach_or_load(self)
        _grammar(self)
        return self


class LlamaCpp(_LlamaCpp):
    """``langchain_community.llms.LlamaCpp`` on ``client=ggmoe.load(...)``, or loading through ggmoe."""

    model_path: str | None = None
    """The GGUF; the client's when ``client`` is given, ggmoe's embedded model when neither is."""

    with warnings.catch_warnings():  # the parent's is a v1 root validator: only one of that kind replaces it
        warnings.simplefilter("ignore", PydanticDeprecatedSince20)

        @root_validator(pre=True)
        def validate_environment(cls, values: dict[str, Any]) -> dict[str, Any]:
            return values  # replaces the parent's validator of this name, which loads a plain Llama

    @model_validator(mode="after")
    def attach_ggmoe_model(self) -> Self:
        _attach_or_load(self)
        _grammar(self)
        return self
