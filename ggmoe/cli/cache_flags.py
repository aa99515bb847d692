"""--stats-in / --stats-out: routing statistics that make a restart start warm (run, trace, serve, chat).

``--stats-in`` is read and checked against the model before it loads; the cache
configuration then takes what it can use (``warm_start``). ``--stats-out``
attaches a ``RoutingStatsCollector`` to the model's route observers and writes
the counts and the predictor's state when the command ends, through
``StatsOut.save``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import check_output
from ggmoe.cli.options import CacheFlags, check_stats_json, planner_config, prefetch_config, run_config
from ggmoe.trace.routing_stats import RoutingStats, RoutingStatsCollector, load_stats, save_stats

if TYPE_CHECKING:
    from ggmoe.control.prefetch import Prefetcher
    from ggmoe.control.run_config import RunConfig
    from ggmoe.inspect import ModelFacts


def read_stats_in(path: str | None, facts: ModelFacts, model: Path) -> RoutingStats | None:
    """The --stats-in file, validated and checked against the model (None without the flag)."""
    if path is None:
        return None
    from ggmoe.inspect.fingerprint import model_fingerprint

    stats = load_stats(path)
    stats.check_model(model_fingerprint(model), tuple(facts.moe_layers), facts.n_expert)
    return stats


def warm_start(run: RunConfig | None, stats: RoutingStats | None) -> RunConfig | None:
    """The run's configuration with what ``stats`` gives it: static's counts, the predictor's state."""
    if run is None:
        return None
    if run.cache.policy == "static":
        if stats is None:
            raise UsageError("--policy static pins the hottest experts of saved routing statistics: give "
                             "--stats-in FILE (written by --stats-out)")
        run = dataclasses.replace(run, cache=dataclasses.replace(run.cache,
                                                                 policy_options={"counts": stats.counts_by_layer()}))
    if stats is not None:  # auto's weighing of the decode modes reads each layer's skew from them
        counts = {il: tuple(int(x) for x in c) for il, c in stats.counts_by_layer().items()}
        run = dataclasses.replace(run, decode=dataclasses.replace(run.decode, routing_counts=counts))
    pre = run.prefetch
    if stats is not None and pre is not None and stats.predictor == pre.predictor and stats.predictor_state:
        run = dataclasses.replace(run, prefetch=dataclasses.replace(pre, state=dict(stats.predictor_state)))
    return run


class StatsOut:
    """The --stats-out file: a collector to attach now, ``save`` when the command ends."""

    def __init__(self, path: str, start: RoutingStats | None, facts: ModelFacts, model: Path) -> None:
        from ggmoe.inspect.fingerprint import model_fingerprint

        self.path = check_output(path, "--stats-out", suffixes=(".npz",))
        if start is None:
            start = RoutingStats.empty(model_fingerprint(model), tuple(facts.moe_layers), facts.n_expert)
        self.collector = RoutingStatsCollector(start)

    def save(self, prefetcher: Prefetcher | None = None, predictor_name: str | None = None) -> None:
        """Write the counts and, with a prefetcher, its predictor's learnt state (the prefetcher stops)."""
        state = prefetcher.final_state() if prefetcher is not None else {}
        save_stats(self.path, self.collector.snapshot(predictor_name if state else None, state))


def stats_out(path: str | None, start: RoutingStats | None, facts: ModelFacts, model: Path) -> StatsOut | None:
    return StatsOut(path, start, facts, model) if path is not None else None


def with_host_threads(run: RunConfig | None, threads: int | None) -> RunConfig | None:
    """``--host-threads`` on the cache; refused where no host path can run (no cache, ``--miss-policy wait``)."""
    if threads is None:
        return run
    if run is None:
        raise UsageError("--host-threads sets the host path's CPU threads: it needs a cache (--cache-slots N or "
                         "--vram BYTES) and --miss-policy cpu or auto")
    if run.decode.miss_policy == "wait":
        raise UsageError("--host-threads sets the host path's CPU threads, and --miss-policy wait has no host path: "
                         "use --miss-policy cpu or auto, or drop --host-threads")
    return dataclasses.replace(run, decode=dataclasses.replace(run.decode, host_threads=threads))


def cache_from_flags(path: Path, facts: ModelFacts, flags: CacheFlags) -> tuple[RunConfig | None, StatsOut | None]:
    """The run configuration the cache flags ask for, started warm from --stats-in, and the --stats-out writer:
    every flag checked before the model loads. The one place ``run``, ``trace``, ``serve`` and ``chat`` build
    their cache."""
    f = flags
    prefetch = prefetch_config(f.predictor, f.stride, f.n_prefetch, f.prefetch_threshold, f.predictor_train,
                               f.predict_background, f.plan_predictor)
    run = run_config(f.cache_slots, f.vram, f.policy, facts, f.miss_policy, prefetch, f.hw, f.config,
                     f.decode_mode, planner_config(f.plan_predictor, f.predictor_train), f.host_ram)
    run = with_host_threads(run, f.host_threads)
    warm = read_stats_in(f.stats_in, facts, path)
    run = warm_start(run, warm)
    out = stats_out(f.stats_out_path, warm, facts, path)
    check_stats_json(f.stats_json, run)
    return run, out
