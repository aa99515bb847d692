"""The ``ggmoe`` click group: built-in commands register here, plugins through entry points.

A plugin (``predictors`` adds ``train-predictor``) declares a click command in the
``ggmoe.commands`` entry-point group, as llm's plugins add commands; loading one
never imports torch here.
"""

from __future__ import annotations

import click

from ggmoe.base.version import __version__
from ggmoe.cli.edge import EdgeGroup


@click.group(cls=EdgeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ggmoe")
def main() -> None:
    """ggmoe: run GGUF Mixture-of-Experts models with experts in host RAM.

    \b
    Examples:
      ggmoe inspect model.gguf
      ggmoe run -p "def fib(n):" -n 32
      ggmoe trace model.gguf --prompts prompts.jsonl -o traces/
    """


def _builtin_commands() -> list[click.Command]:
    from ggmoe.cli.calibrate import calibrate
    from ggmoe.cli.engine import engine
    from ggmoe.cli.generate import run
    from ggmoe.cli.model import inspect, policies, verify_hook
    from ggmoe.cli.plan import plan
    from ggmoe.cli.predict import eval_predictor
    from ggmoe.cli.quant import compare_quants, quantize
    from ggmoe.cli.serve import chat, serve
    from ggmoe.cli.simulate import simulate
    from ggmoe.cli.trace_cmd import trace

    return [inspect, run, trace, policies, verify_hook, eval_predictor, serve, chat, calibrate, simulate, plan,
            quantize, compare_quants, engine]


@click.command("train-predictor", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               add_help_option=False)
def _train_predictor_missing() -> None:
    """Train ProMoE MLP predictors (needs the [train] extra: pip install 'ggmoe[train]')."""
    click.echo("error: train-predictor needs the training side of ggmoe (torch): "
               "pip install 'ggmoe[train]'", err=True)
    raise SystemExit(2)


def _plugin_commands() -> list[click.Command]:
    """Commands other packages add through the ``ggmoe.commands`` entry-point group."""
    from importlib.metadata import entry_points

    out = []
    for ep in entry_points(group="ggmoe.commands"):
        try:
            cmd = ep.load()
        except ImportError:
            continue  # the plugin's own dependencies are missing; its fallback (if any) stays
        if isinstance(cmd, click.Command):
            out.append(cmd)
    return out


for _cmd in _builtin_commands():
    main.add_command(_cmd)
main.add_command(_train_predictor_missing)
for _cmd in _plugin_commands():
    main.add_command(_cmd)  # replaces the fallback of the same name
