"""The integrations tier: ggmoe's model inside LangChain, llama-index and outlines (the real packages)."""

from __future__ import annotations

import pytest


@pytest.fixture()
def llama_inits(monkeypatch):
    """The class name of every ``llama_cpp.Llama`` built while the test runs: a second load shows up here."""
    import llama_cpp

    built: list[str] = []
    original = llama_cpp.Llama.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(llama_cpp.Llama, "__init__", counting_init)
    return built


@pytest.fixture(scope="module")
def model():
    """One ``ggmoe.load()`` of the embedded model per module."""
    import ggmoe

    with ggmoe.load(n_ctx=256) as llm:
        yield llm
