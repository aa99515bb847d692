"""LangChain's ChatLlamaCpp and LlamaCpp (langchain-community) on a ggmoe model, loaded once."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_community")  # in the dev extra; absent only in a bare install
from ggmoe.integrations.langchain import ChatLlamaCpp, LlamaCpp  # noqa: E402


def test_chat_model_runs_on_the_given_client(model, llama_inits):
    chat = ChatLlamaCpp(client=model, max_tokens=8, temperature=0)
    assert chat.client is model and chat.model_path == model.model_path
    msg = chat.invoke([("system", "Be brief."), ("human", "Once upon a time")])
    assert isinstance(msg.content, str) and msg.content
    streamed = "".join(c.content for c in chat.stream("Once upon a time"))
    assert streamed == chat.invoke("Once upon a time").content
    assert llama_inits == []  # nothing loaded a second model


def test_text_model_runs_on_the_given_client(model, llama_inits):
    llm = LlamaCpp(client=model, max_tokens=6, temperature=0)
    text = llm.invoke("Once upon a time")
    assert text == model.create_completion("Once upon a time", max_tokens=6, temperature=0,
                                           top_p=0.95, top_k=40, repeat_penalty=1.1)["choices"][0]["text"]
    assert "".join(llm.stream("Once upon a time")) == text
    assert llm.get_num_tokens("Once upon a time") == len(model.tokenize(b"Once upon a time"))
    assert llama_inits == []


def test_without_a_client_it_loads_once_through_ggmoe(llama_inits):
    llm = LlamaCpp(n_ctx=512, max_tokens=2, model_kwargs={"cache_slots": 8})  # ggmoe.load's own options
    try:
        assert llama_inits == ["GgmoeLlama"]
        assert llm.client.n_ctx() == 512 and llm.client.stats()["cache"]["slots_per_layer"]["0"] == 8
        assert llm.client.n_batch == 512  # llama.cpp's default batch, not LangChain's default 8
        assert llm.invoke("Once") is not None
    finally:
        llm.client.close()


def test_load_fields_beside_a_client_are_one_clear_error(model):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="n_ctx: these set how a model loads, and client= is loaded"):
        ChatLlamaCpp(client=model, n_ctx=1024)
    with pytest.raises(ValidationError, match=r"model_kwargs \['cache_slots'\]"):
        LlamaCpp(client=model, model_kwargs={"cache_slots": 8})


def test_grammar_is_applied(model):
    chat = ChatLlamaCpp(client=model, max_tokens=8, temperature=0, streaming=False,
                        grammar='root ::= "yes" | "no"')
    assert chat.invoke("Answer yes or no").content in ("yes", "no")
