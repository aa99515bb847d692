"""``ggmoe simulate``'s option groups, each handed to the command as one record: the sweep (every combination is
simulated), the predictors' settings, the machine modelled, and the output."""

from __future__ import annotations

from dataclasses import dataclass

import click

from ggmoe.cli.groups import option_group
from ggmoe.cli.options import FiniteFloat


@dataclass(frozen=True)
class SweepFlags:
    """What varies between the rows: each flag a repeatable or comma list, every combination simulated."""

    cache_slots: tuple[str, ...]  # slots per layer
    cache_fraction: tuple[str, ...]  # shares of each layer's experts
    vram: tuple[str, ...]  # budgets over all layers, e.g. "4GiB"
    policy: tuple[str, ...]
    predictor: tuple[str, ...]  # stride predictors ("none": no prefetching)
    plan_predictor: tuple[str, ...]  # planners between tokens ("none": no planner)
    miss_policy: tuple[str, ...]
    decode_mode: tuple[str, ...]  # sync, async, async-fill, hybrid
    theta: tuple[str, ...]  # MoEpic's top shares in (0, 1]


@dataclass(frozen=True)
class PredictorFlags:
    """How the predictors run and what they learn from: the same for every row."""

    stride: int  # MoE layers ahead
    n_prefetch: int | None  # experts prefetched per layer (None: 2 x top-k)
    predictor_train: tuple[str, ...]  # training traces of predictors that learn
    predictor_s: float | None  # seconds per predictor call on the critical path (None: measured here)
    stats_in: str | None  # routing statistics saved by --stats-out


@dataclass(frozen=True)
class MachineFlags:
    """The machine the rows are estimated on, and the workers that simulate them."""

    hw: str  # a hardware profile, GPU/LINK/HOST, a .toml, or "none" (counts only)
    host_ram: str | None  # the host tier's budget, e.g. "24GiB" (None: every expert in host memory)
    jobs: int | None  # worker processes (None: the CPUs this process may use)


@dataclass(frozen=True)
class OutputFlags:
    """Where the results go besides the table."""

    as_json: bool  # every result as JSON
    plot_path: str | None  # a PNG of hit rate and TPOT


_SWEEP = (
    click.option("--theta", multiple=True,
                 help="MoEpic's split: the top share θ of every MoE layer's experts that a slot holds, in (0, 1] "
                      "(repeat or comma list; default 1, whole experts). At each size the split layers get as many "
                      "tops as the whole experts' bytes hold."),
    click.option("--decode-mode", multiple=True,
                 help="sync, async, async-fill (repeat or comma list; default sync): async reads misses over the link "
                      "with no route hook and admits between tokens; async-fill is async with in-graph fills (each "
                      "miss copied into a fill slot inside its layer and read there: one crossing, no admission); "
                      "with miss policy cpu or auto their host part computes some misses on the CPU beside the "
                      "GPU (the engine's patch 0016). hybrid is sync with each layer's misses split between the "
                      "link and the CPU, both at once, so that both finish together; its rows need miss policy auto."),
    click.option("--miss-policy", multiple=True, help="wait, cpu, auto (repeat or comma list; default wait)."),
    click.option("--plan-predictor", "plan_predictor", multiple=True,
                 help="Planners between tokens (none, reuse, eam, expert-map, PRED.npz trained with --mode token); "
                      "repeat or comma list; default none."),
    click.option("--predictor", multiple=True, help="Predictors (none, reuse, skip-gate, token, eam, expert-map, transition, "
                                                    "oracle, PRED.npz); repeat or comma list; default none."),
    click.option("--policy", multiple=True, help="Eviction policies (repeat or comma list; default lru)."),
    click.option("--vram", multiple=True, help="Cache budget over all layers, e.g. 4GiB (repeat or comma list)."),
    click.option("--cache-fraction", multiple=True,
                 help="Share of each layer's experts cacheable, e.g. 0.25,0.5 (repeat or comma list)."),
    click.option("--cache-slots", multiple=True, help="Slots per layer (repeat or comma list)."),
)
_PREDICTORS = (
    click.option("--stats-in", type=click.Path(dir_okay=False),
                 help="Routing statistics saved by --stats-out: --policy static pins their hottest experts; the "
                      "predictor they were saved with starts from what it learnt."),
    click.option("--predictor-s", type=FiniteFloat(min=0.0),
                 help="Seconds per predictor call on the critical path (default: measured on this machine)."),
    click.option("--predictor-train", multiple=True, type=click.Path(),
                 help="Training traces for predictors that learn (eam, expert-map, token, transition)."),
    click.option("--prefetch", "n_prefetch", type=click.IntRange(1, 4096),
                 help="Experts prefetched per layer (default 2 x top-k)."),
    click.option("--stride", default=2, show_default=True, type=click.IntRange(1, 1024)),
)
_MACHINE = (
    click.option("--jobs", type=click.IntRange(1, 256),
                 help="Worker processes, one configuration each at a time (default: the CPUs this process may use)."),
    click.option("--host-ram", "host_ram", help="Host RAM for the experts, e.g. 24GiB: experts beyond it stay on disk "
                 "under a host tier of that size, read from the profile's disk (--hw .../nvme4); default: every "
                 "expert in host memory."),
    click.option("--hw", default="pcie4", show_default=True,
                 help="Hardware profile (pcie4, h100, egpu, GPU/LINK/HOST e.g. rtx4090/pcie4x16/ddr5-5600x2, a .toml from ggmoe calibrate), or none: counts only."),
)
_OUTPUT = (
    click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of hit rate and TPOT."),
    click.option("--json", "as_json", is_flag=True, help="Print every result as JSON."),
)

sweep_options = option_group(SweepFlags, "sweep", *_SWEEP)
predictor_options = option_group(PredictorFlags, "predictors", *_PREDICTORS)
machine_options = option_group(MachineFlags, "machine", *_MACHINE)
output_options = option_group(OutputFlags, "output", *_OUTPUT)
