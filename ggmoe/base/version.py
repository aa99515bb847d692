"""ggmoe's version: written once, here (``ggmoe.__version__`` and ``pyproject.toml`` read it)."""

__version__ = "0.1.0"
