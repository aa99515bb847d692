"""``ggmoe compare-quants``'s option groups, each handed to the command as one record: the budget the levels are
compared at, the quality pass, the measured decode, and the output."""

from __future__ import annotations

from dataclasses import dataclass

import click

from ggmoe.cli.groups import option_group
from ggmoe.cli.options import threads_opt
from ggmoe.cli.simulate_flags import OutputFlags


@dataclass(frozen=True)
class BudgetFlags:
    """The one cache every level is compared with."""

    vram: str  # the experts' budget over all layers, e.g. "4GiB"
    hw: str  # the hardware profile of the estimates
    policy: str
    miss_policy: str


@dataclass(frozen=True)
class QualityFlags:
    """The quality pass: perplexity on a text and KL divergence against a reference."""

    text_path: str | None  # the text (None: no quality pass)
    n_ctx: int | None  # tokens per window (None: 512, or the training context when shorter)
    chunks: int | None  # windows at most (None: all the text fills)
    reference: str | None  # the level the KL divergence is measured against
    kl_base: str | None  # a saved reference instead of a reference level's pass
    save_kl_base: str | None  # where the reference's top tokens go (.npz)
    kl_top: int  # the reference's most likely tokens kept per position


@dataclass(frozen=True)
class MeasureFlags:
    """A decode measured on this machine at the budget, beside the estimate."""

    measure: bool
    measure_tokens: int  # tokens decoded one at a time
    threads: int | None


_BUDGET = (
    click.option("--miss-policy", default="wait", show_default=True),
    click.option("--policy", default="lru", show_default=True),
    click.option("--hw", default="pcie4", show_default=True, help="Hardware profile (pcie4, h100, egpu, GPU/LINK/HOST e.g. rtx4090/pcie4x16/ddr5-5600x2, a .toml)."),
    click.option("--vram", required=True, help="Budget for cached experts over all layers, e.g. 4GiB."),
)
_QUALITY = (
    click.option("--kl-top", type=click.IntRange(min=1, max=1 << 16), default=64, show_default=True,
                 help="The reference's most likely tokens kept per position (the rest is one outcome)."),
    click.option("--save-kl-base", type=click.Path(dir_okay=False),
                 help="Write the reference level's top tokens here (.npz), for another run's --kl-base."),
    click.option("--kl-base", type=click.Path(dir_okay=False),
                 help="A reference written by --save-kl-base, instead of a reference level's pass."),
    click.option("--reference", help="The level the KL divergence is measured against [default: the one with the "
                                     "most bytes per expert]."),
    click.option("--chunks", type=click.IntRange(min=1), help="At most this many windows [default: all the text fills]."),
    click.option("--ctx", "n_ctx", type=click.IntRange(min=8),
                 help="Window in tokens; the second half of each is scored [default: 512, or the model's training "
                      "context when shorter]."),
    click.option("--text", "text_path", type=click.Path(dir_okay=False),
                 help="A text file: each level's perplexity on it and KL divergence against the reference level."),
)
_MEASURE = (
    threads_opt,
    click.option("--measure-tokens", type=click.IntRange(min=1), default=64, show_default=True,
                 help="Tokens decoded one at a time by --measure."),
    click.option("--measure", is_flag=True, help="Also decode on this machine at the budget: TPOT and hit rate "
                                                 "measured, beside the estimate."),
)
_OUTPUT = (
    click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
                 help="Write a PNG: quality against speed with --text (Pareto levels marked), else hit rate and TPOT."),
    click.option("--json", "as_json", is_flag=True),
)

budget_options = option_group(BudgetFlags, "budget", *_BUDGET)
quality_options = option_group(QualityFlags, "quality", *_QUALITY)
measure_options = option_group(MeasureFlags, "measured", *_MEASURE)
output_options = option_group(OutputFlags, "output", *_OUTPUT)
