"""``python -m ggmoe``: the ``ggmoe`` command."""

from ggmoe.cli import main

main(prog_name="ggmoe")
