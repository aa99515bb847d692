"""LangChain's OpenAI chat model against the server: plain, streamed and structured output (json_schema)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel
from server_process import API_KEY

langchain_openai = pytest.importorskip("langchain_openai")  # in the dev extra; absent only in a bare install


class Mood(BaseModel):
    mood: Literal["happy", "sad"]
    certain: bool


@pytest.fixture()
def llm(server):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="gpt-4o-mini",
                                       max_tokens=24, temperature=0, max_retries=0)


def test_invoke_and_stream(llm):
    msg = llm.invoke([("system", "Be brief."), ("human", "Once upon a time")])
    assert isinstance(msg.content, str) and msg.content
    assert msg.usage_metadata["output_tokens"] > 0
    pieces = [c.content for c in llm.stream("Once upon a time")]
    assert "".join(pieces)


def test_structured_output(server):
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="gpt-4o-mini",
                                      max_tokens=200, temperature=0.8, seed=3, max_retries=0)
    out = llm.with_structured_output(Mood, method="json_schema", strict=True).invoke("How do you feel?")
    assert isinstance(out, Mood)
