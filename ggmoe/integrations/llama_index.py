"""llama-index's ``LlamaCPP`` on ggmoe's model.

``llama_index.llms.llama_cpp.LlamaCPP`` always builds its own ``Llama(model_path=...)`` in ``__init__`` (and
downloads a model when given none). This subclass takes a loaded model instead, ``LlamaCPP(ggmoe.load(...))``,
or loads one with ``ggmoe.load(model_path, n_ctx=context_window, **model_kwargs)`` (the embedded model when
``model_path`` is omitted; nothing is downloaded). Everything else is llama-index's code, unchanged:
``complete``, ``stream_complete``, ``chat``, ``stream_chat``, ``messages_to_prompt``, ``generate_kwargs``.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.constants import DEFAULT_NUM_OUTPUTS, DEFAULT_TEMPERATURE
from llama_index.core.llms.custom import CustomLLM
from llama_index.llms.llama_cpp import LlamaCPP as _LlamaCPP

__all__ = ["LlamaCPP"]


class LlamaCPP(_LlamaCPP):
    """``LlamaCPP`` whose model is ``llm`` (a ``ggmoe.load()`` model), or one ``ggmoe.load`` loads."""

    def __init__(self, llm: Any = None, *, model_path: str | None = None,
                 temperature: float = DEFAULT_TEMPERATURE, max_new_tokens: int = DEFAULT_NUM_OUTPUTS,
                 context_window: int | None = None, generate_kwargs: dict[str, Any] | None = None,
                 model_kwargs: dict[str, Any] | None = None, verbose: bool = False, **llm_fields: Any) -> None:
        if "model_url" in llm_fields:
            raise ValueError("model_url: ggmoe downloads nothing; give model_path, or a loaded model as llm")
        if llm is None:
            import ggmoe

            load_kwargs = {"verbose": verbose, **({"n_ctx": context_window} if context_window else {}),
                           **(model_kwargs or {})}
            llm = ggmoe.load(model_path, **load_kwargs)
        elif model_path is not None or context_window is not None or model_kwargs:
            raise ValueError("model_path, context_window and model_kwargs set how a model loads, and llm is "
                             "loaded already; give them to ggmoe.load() instead")
        generate_kwargs = {**(generate_kwargs or {}), "temperature": temperature, "max_tokens": max_new_tokens}
        # LlamaCPP.__init__ would load a second model: the fields it sets are set here, on the given one.
        CustomLLM.__init__(self, model_path=llm.model_path, model_url=None, temperature=temperature,
                           context_window=llm.n_ctx(), max_new_tokens=max_new_tokens,
                           generate_kwargs=generate_kwargs, model_kwargs=model_kwargs or {}, verbose=verbose,
                           **llm_fields)
        self._model = llm
