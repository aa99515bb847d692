"""Option groups (``ggmoe.cli.groups``): a command gets one typed record per group, holding the flags' values, and
its --help still lists every flag of every group."""

from __future__ import annotations

import dataclasses
import inspect

import click
import pytest
from click.testing import CliRunner

from ggmoe.cli.options import CacheFlags, cache_options
from ggmoe.cli.quant_flags import (
    BudgetFlags,
    MeasureFlags,
    QualityFlags,
    budget_options,
    measure_options,
    quality_options,
)
from ggmoe.cli.serve_flags import (
    EngineFlags,
    HttpFlags,
    ServerFlags,
    TemplateFlags,
    engine_options,
    http_options,
    server_options,
    template_options,
)
from ggmoe.cli.simulate_flags import (
    MachineFlags,
    OutputFlags,
    PredictorFlags,
    SweepFlags,
    machine_options,
    output_options,
    predictor_options,
    sweep_options,
)

# (group decorator, the parameter it fills, its record, flags given, fields the record must then hold)
CASES = [
    (cache_options, "cache", CacheFlags, ["--cache-slots", "4", "--miss-policy", "cpu", "--stats-in", "s.npz"],
     {"cache_slots": 4, "miss_policy": "cpu", "stats_in": "s.npz", "stride": 2, "vram": None}),
    (http_options, "http", HttpFlags, ["--port", "9000", "--alias", "a", "--alias", "b"],
     {"port": 9000, "aliases": ("a", "b"), "host": "127.0.0.1", "max_body": "1MiB"}),
    (server_options, "server", ServerFlags, ["-np", "3", "--no-kv-unified"],
     {"parallel": 3, "kv_unified": False, "reconfigure_every": None, "reconfigure_hw": "pcie4"}),
    (template_options, "template", TemplateFlags, ["--chat-template", "chatml", "--reasoning-budget", "0"],
     {"chat_template": "chatml", "thinking": 0, "chat_template_file": None}),
    (engine_options, "engine", EngineFlags, ["--n-ctx", "64", "--threads", "2"],
     {"n_ctx": 64, "threads": 2, "verbose": False}),
    (sweep_options, "sweep", SweepFlags, ["--policy", "lru,lfu", "--decode-mode", "sync"],
     {"policy": ("lru,lfu",), "decode_mode": ("sync",), "cache_slots": ()}),
    (predictor_options, "predictors", PredictorFlags, ["--stride", "1", "--prefetch", "3"],
     {"stride": 1, "n_prefetch": 3, "predictor_s": None}),
    (machine_options, "machine", MachineFlags, ["--hw", "h100", "--jobs", "2"],
     {"hw": "h100", "jobs": 2, "host_ram": None}),
    (output_options, "output", OutputFlags, ["--json"], {"as_json": True, "plot_path": None}),
    (budget_options, "budget", BudgetFlags, ["--vram", "4MiB"],
     {"vram": "4MiB", "hw": "pcie4", "policy": "lru", "miss_policy": "wait"}),
    (quality_options, "quality", QualityFlags, ["--text", "t.txt", "--ctx", "64"],
     {"text_path": "t.txt", "n_ctx": 64, "kl_top": 64, "reference": None}),
    (measure_options, "measured", MeasureFlags, ["--measure", "--threads", "1"],
     {"measure": True, "measure_tokens": 64, "threads": 1}),
]


def _command(group, name: str, got: dict):
    @click.command()
    @click.option("--other", default="x")
    @group
    def cmd(other: str, **records) -> None:
        assert other == "x" and set(records) == {name}  # the group's flags arrive as one parameter
        got.update(records)

    return cmd


@pytest.mark.parametrize("group, name, record, argv, want", CASES, ids=[c[1] for c in CASES])
def test_a_group_hands_the_command_one_record_of_its_flags(group, name, record, argv, want):
    got: dict = {}
    result = CliRunner().invoke(_command(group, name, got), argv)
    assert result.exit_code == 0, result.output
    rec = got[name]
    assert type(rec) is record and dataclasses.is_dataclass(rec)
    assert {k: getattr(rec, k) for k in want} == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(rec, next(iter(want)), None)


@pytest.mark.parametrize("group, name, record, argv, want", CASES, ids=[c[1] for c in CASES])
def test_help_lists_every_flag_of_the_group(group, name, record, argv, want):
    cmd = _command(group, name, {})
    dests = {p.name for p in cmd.params}
    assert {f.name for f in dataclasses.fields(record)} <= dests  # one option per field, named as the field
    out = CliRunner().invoke(cmd, ["--help"]).output
    for p in cmd.params:
        assert p.opts[-1] in out, p.opts


def test_the_largest_commands_take_a_few_groups_not_twenty_parameters():
    from ggmoe.cli.quant import compare_quants
    from ggmoe.cli.serve import serve
    from ggmoe.cli.simulate import simulate

    for cmd, want in ((serve, ["model", "http", "server", "template", "fit", "engine", "cache"]),
                      (simulate, ["traces", "model", "sweep", "predictors", "machine", "output"]),
                      (compare_quants, ["models", "traces", "budget", "quality", "measured", "output"])):
        fn = inspect.unwrap(cmd.callback)
        assert list(inspect.signature(fn).parameters) == want
