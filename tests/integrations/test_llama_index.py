"""llama-index's LlamaCPP (llama-index-llms-llama-cpp) on a ggmoe model, loaded once."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.llms.llama_cpp")  # in the dev extra; absent only in a bare install
from ggmoe.integrations.llama_index import LlamaCPP  # noqa: E402


def test_complete_stream_and_chat_on_the_given_model(model, llama_inits):
    from llama_index.core.llms import ChatMessage

    llm = LlamaCPP(model, max_new_tokens=6, temperature=0)
    assert llm._model is model and llm.metadata.context_window == model.n_ctx()
    text = llm.complete("Once upon a time", formatted=True).text
    assert text == model.create_completion("Once upon a time", max_tokens=6, temperature=0)["choices"][0]["text"]
    assert "".join(r.delta for r in llm.stream_complete("Once upon a time", formatted=True)) == text
    reply = llm.chat([ChatMessage(role="user", content="Hello")])
    assert reply.message.role == "assistant" and isinstance(reply.message.content, str)
    assert llama_inits == []


def test_without_a_model_it_loads_once_through_ggmoe(llama_inits):
    llm = LlamaCPP(context_window=512, max_new_tokens=2, model_kwargs={"cache_slots": 8})
    try:
        assert llama_inits == ["GgmoeLlama"]
        assert llm.metadata.context_window == 512 and llm._model.stats()["cache"]["slots_per_layer"]["0"] == 8
        assert llm.complete("Once").text is not None
    finally:
        llm._model.close()


def test_load_options_beside_a_model_and_model_url_are_one_clear_error(model):
    with pytest.raises(ValueError, match="llm is loaded already; give them to ggmoe.load"):
        LlamaCPP(model, context_window=64)
    with pytest.raises(ValueError, match="ggmoe downloads nothing"):
        LlamaCPP(model_url="https://example.invalid/model.gguf")
