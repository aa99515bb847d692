"""The surfaces on llama-cpp-python: ``load()`` (a ``llama_cpp.Llama``), the OpenAI server, the terminal chat."""

from ggmoe.serve.llama import GgmoeLlama, load

__all__ = ["GgmoeLlama", "load"]
