"""The ``ggmoe`` command line: one click group, thin commands, errors mapped once (``ggmoe.cli.edge``)."""

from ggmoe.cli.main import main

__all__ = ["main"]
