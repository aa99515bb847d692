"""ggmoe's model inside the libraries people embed llama.cpp with.

``ggmoe.integrations.langchain`` and ``ggmoe.integrations.llama_index`` hold subclasses of those libraries'
llama.cpp classes that run on a ``ggmoe.load()`` model instead of loading a second, plain ``Llama``.
Each imports its library, so each is imported on its own; outlines needs no adapter
(``outlines.from_llamacpp(ggmoe.load())``). Recipes: docs/serving.md, "Libraries".
"""
