"""The HTTP surfaces on a ``GgmoeLlama``: the OpenAI, llama-server and Anthropic APIs, the terminal chat."""
