"""Options and helpers shared by the commands: the model argument, engine flags, cache flags."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ggmoe.base.context import MAX_N_CTX
from ggmoe.base.errors import ModelFileError, UsageError
from ggmoe.base.outputs import check_output, write_text_atomic
from ggmoe.cli.groups import option_group

if TYPE_CHECKING:
    from ggmoe.control.planner import PlannerConfig
    from ggmoe.control.prefetch import PrefetchConfig
    from ggmoe.control.run_config import RunConfig
    from ggmoe.engine import Engine
    from ggmoe.inspect import ModelFacts

MAX_THREADS = max(512, 4 * (os.cpu_count() or 1))  # more threads than this only hangs OpenMP or fails


class FiniteFloat(click.ParamType):
    """A float that is finite and within [min, max] (open ends with ``min_open``/``max_open``): click's
    FloatRange lets nan through, and inf where a bound is open-ended."""

    name = "float"

    def __init__(self, min: float | None = None, max: float | None = None,  # noqa: A002 - click's own naming
                 min_open: bool = False, max_open: bool = False) -> None:
        self.min, self.max, self.min_open, self.max_open = min, max, min_open, max_open

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(f):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.min is not None and (f <= self.min if self.min_open else f < self.min):
            self.fail(f"{value!r} is {'at or ' if self.min_open else ''}below {self.min}", param, ctx)
        if self.max is not None and (f >= self.max if self.max_open else f > self.max):
            self.fail(f"{value!r} is {'at or ' if self.max_open else ''}above {self.max}", param, ctx)
        return f


SEED = click.IntRange(min=0, max=2**32 - 1)  # what every seed flag takes (numpy and llama.cpp seeds alike)


def model_path(model: str | None, what: str = "MODEL") -> Path:
    """The GGUF a command runs on: ``model``, which must be an existing file, or the embedded model if None.

    An empty string is an error, not the embedded model: a variable that expanded to nothing is a mistake.
    """
    if model is not None:
        if not model.strip():
            raise UsageError(f"{what} is empty: give a GGUF file (or leave it out for the embedded model)")
        path = Path(model)
        if not path.exists():
            raise ModelFileError(f"{path}: no such file (model file not found)")
        if not path.is_file():
            raise ModelFileError(f"{path}: {'is a directory' if path.is_dir() else 'not a regular file'}, "
                                 "not a GGUF file")
        return path
    from ggmoe.models import default_model_path

    path = default_model_path()
    if path is None:
        raise UsageError("no MODEL given and this install has no embedded default model")
    return path


def model_facts(path: Path) -> ModelFacts:
    """The validated facts of the model: a bad file fails here, before any other work."""
    from ggmoe.inspect import inspect_model

    return inspect_model(path)


def toy_notice(path: Path) -> None:
    """The embedded model is a 15 M-parameter demo: say so once, on stderr."""
    from ggmoe.models import default_model_path

    default = default_model_path()
    if default is not None and path.resolve() == default.resolve():
        click.echo("note: the embedded tiny-moe model (15 M parameters) shows the mechanics; "
                   "its text is not meant to be good. Give a GGUF MoE model as MODEL for real output.", err=True)


def training_context(path: Path) -> int | None:
    """The model's training context (``{arch}.context_length``) from the GGUF header, or None."""
    from ggmoe.inspect.reader import read_header

    kv = read_header(path).kv
    n = kv.get(f"{kv.get('general.architecture')}.context_length")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def make_engine(model: Path, n_ctx: int | None, threads: int | None, verbose: bool,
                run: RunConfig | None = None) -> Engine:
    """The engine, fed in batches llama.cpp takes for the context asked for (``ggmoe.base.context``)."""
    from ggmoe.base.context import DEFAULT_N_BATCH, decode_batch
    from ggmoe.engine import Engine, EngineConfig

    kw = {"n_threads": threads} if threads else {}
    n_batch = decode_batch(n_ctx if n_ctx is not None else training_context(model), DEFAULT_N_BATCH)
    eng = Engine(EngineConfig(model_path=model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, verbose=verbose,
                              run=run, **kw))
    if n_ctx is not None and n_ctx > eng.n_ctx_train:
        click.echo(f"warning: --n-ctx {n_ctx} is above the {eng.n_ctx_train} tokens the model was trained "
                   "on; quality past that is not to be trusted", err=True)
    return eng


def run_config(cache_slots: int | None, vram: str | None, policy: str | None, facts: ModelFacts | None = None,
               miss_policy: str | None = None, prefetch: PrefetchConfig | None = None, hw: str | None = None,
               config: str | None = None, decode_mode: str | None = None,
               planner: PlannerConfig | None = None, host_ram: str | None = None) -> RunConfig | None:
    """A RunConfig from the flags or from a plan file (--config), or None when neither was given;
    --decode-mode, --plan-predictor and --host-ram apply to both."""
    from ggmoe.control.run_config import build_run_config

    if config is None:
        return build_run_config(cache_slots, vram, policy, facts, miss_policy, prefetch, hw, decode_mode, planner,
                                host_ram)
    given = [f for f, v in (("--cache-slots", cache_slots), ("--vram", vram), ("--policy", policy),
                            ("--miss-policy", miss_policy), ("--predictor", prefetch), ("--hw", hw)) if v is not None]
    if given:
        raise UsageError(f"--config sets the cache; drop {', '.join(given)} (or edit the plan file)")
    from ggmoe.control.plan_file import read_plan

    cfg = read_plan(config)
    if facts is not None:  # layers that do not match the model fail now, before it loads
        cfg.check_model(facts)
    if cfg.decode.hw_profile is not None:
        from ggmoe.cache.hardware import load_profile

        load_profile(cfg.decode.hw_profile)
    if decode_mode is not None:
        cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, mode=decode_mode))
    if planner is not None:
        cfg = dataclasses.replace(cfg, planner=planner)
    if host_ram is not None:
        from ggmoe.base.units import parse_bytes
        from ggmoe.cache.tiers import tier_sizes

        cfg = dataclasses.replace(cfg, tiers=dataclasses.replace(cfg.tiers, host_ram=parse_bytes(host_ram)))
        if facts is not None:
            tier_sizes(facts, 0, cfg.tiers.host_ram)
    return cfg


def prefetch_config(predictor: str | None, stride: int, n_prefetch: int | None, threshold: float | None,
                    train: tuple[str, ...], background: bool = False,
                    planner: str | None = None) -> PrefetchConfig | None:
    """A PrefetchConfig from the flags, or None without --predictor (``build_prefetch_config``); the predictor
    checked against the registry (or as a file) before any model loads. ``planner``: --plan-predictor, which
    may take the --predictor-train traces without a --predictor."""
    from ggmoe.control.prefetch import build_prefetch_config

    if predictor is not None:
        from ggmoe.predict.base import check_predictor

        check_predictor(predictor)
    elif planner is not None:
        train = ()
    return build_prefetch_config(predictor, stride, n_prefetch, threshold, train, background)


def planner_config(planner: str | None, train: tuple[str, ...] = ()) -> PlannerConfig | None:
    """A PlannerConfig from --plan-predictor (and the --predictor-train traces), or None; a name that cannot
    predict the next token, or a missing file, refused before any model loads (a file's mode is checked when
    it is read)."""
    if planner is None:
        return None
    from ggmoe.control.planner import PlannerConfig, check_planner

    check_planner(planner)
    return PlannerConfig(predictor=planner, train=tuple(train))


def check_stats_json(stats_json: str | None, run: RunConfig | None) -> None:
    """--stats-json needs a cache and a writable path: both checked before any work."""
    if stats_json is None:
        return
    if run is None:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    check_output(stats_json, "--stats-json", suffixes=(".json",))


@dataclasses.dataclass(frozen=True)
class CacheFlags:
    """The cache flags of ``run``, ``trace``, ``serve`` and ``chat``, as given (None: not given); what
    ``ggmoe.cli.cache_flags.cache_from_flags`` turns into a run configuration."""

    cache_slots: int | None = None  # slots per MoE layer
    vram: str | None = None  # a budget over all layers, e.g. "4GiB"
    policy: str | None = None
    stats_json: str | None = None  # where the cache statistics go (a .json path)
    host_ram: str | None = None  # the host tier's budget, e.g. "16GiB"
    decode_mode: str | None = None  # auto, async or sync
    host_threads: int | None = None  # the host part's worker threads (0: in the main graph)
    miss_policy: str | None = None  # wait, cpu or auto
    predictor: str | None = None  # a registered name or a PRED.npz
    plan_predictor: str | None = None  # a cross-token predictor for the planner
    stride: int = 2  # MoE layers ahead
    n_prefetch: int | None = None  # experts prefetched per layer
    prefetch_threshold: float | None = None
    predictor_train: tuple[str, ...] = ()  # training traces of a predictor that learns
    predict_background: bool = False
    hw: str | None = None  # auto's cost model: a profile name, GPU/LINK/HOST or a .toml file
    config: str | None = None  # a plan file from ``ggmoe plan``
    stats_in: str | None = None  # routing statistics to start warm from (.npz)
    stats_out_path: str | None = None  # where the routing statistics go when the command ends (.npz)


def _stats_flag_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--stats-in and --stats-out: routing statistics that make a restart start warm."""
    fn = click.option("--stats-out", "stats_out_path", type=click.Path(dir_okay=False),
                      help="When the command ends, save routing statistics here (.npz): per-layer expert "
                           "counts, co-activation and the predictor's learnt state.")(fn)
    fn = click.option("--stats-in", type=click.Path(dir_okay=False),
                      help="Start warm from statistics saved by --stats-out: counts continue, --policy static "
                           "pins their hottest experts, an eam or expert-map predictor keeps what it learnt.")(fn)
    return fn


def _cache_flag_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The cache's click options (``CacheFlags``'s fields but the statistics files)."""
    fn = click.option("--config", "config", type=click.Path(dir_okay=False),
                      help="A plan file from `ggmoe plan` (slots per layer, policy, predictor, miss policy) "
                           "instead of the cache flags.")(fn)
    fn = click.option("--hw", help="Hardware profile (pcie4, h100, egpu, GPU/LINK/HOST such as rtx4090/pcie4x16/ddr5-5600x2, or a .toml file) as the cost model of "
                                   "--miss-policy auto, instead of measuring this machine at startup.")(fn)
    fn = click.option("--predict-in-background", "predict_background", is_flag=True,
                      help="Run the predictor on a worker thread, off the route callback's critical path.")(fn)
    fn = click.option("--predictor-train", "predictor_train", multiple=True, type=click.Path(),
                      help="Training traces for a predictor that learns (token, eam, expert-map, transition); repeat.")(fn)
    fn = click.option("--prefetch-threshold", type=FiniteFloat(),
                      help="Prefetch only experts whose predicted score reaches this (fMoE's threshold).")(fn)
    fn = click.option("--prefetch", "n_prefetch", type=click.IntRange(min=1, max=4096),
                      help="Experts prefetched per layer ahead (default: 2 x the model's top-k).")(fn)
    fn = click.option("--stride", default=2, show_default=True, type=click.IntRange(min=1, max=1024),
                      help="Predict and prefetch the MoE layer this many layers ahead.")(fn)
    fn = click.option("--plan-predictor", "plan_predictor",
                      help="Plan the next token between tokens with this cross-token predictor: reuse, eam, "
                           "expert-map, or PRED.npz from `ggmoe train-predictor --mode token`; its predicted "
                           "experts are admitted first and not evicted.")(fn)
    fn = click.option("--predictor",
                      help="Prefetch with this predictor: reuse, skip-gate, token, eam, expert-map, transition, or PRED.npz "
                           "from `ggmoe train-predictor`.")(fn)
    fn = click.option("--miss-policy", type=click.Choice(["wait", "cpu", "auto"]),
                      help="An expert not on the device: wait for its copy (default), compute it on the CPU "
                           "(the host path), or whichever is sooner by the measured cost model (the sync decode "
                           "splits each layer call's misses; the async decode gives a layer's misses all to the CPU "
                           "or none).")(fn)
    fn = click.option("--host-threads", type=click.IntRange(min=0, max=MAX_THREADS),
                      help="Threads of the worker that computes the host path's CPU part beside the GPU's part of "
                           "each layer (0: after it, in llama.cpp's graph). Default: --threads on a GPU build, 0 on "
                           "a CPU-only build. Where the worker's threads and the graph's fit the cores, each layer's "
                           "hand-off spins instead of sleeping (GGMOE_HOST_SPIN_US sets it).")(fn)
    fn = click.option("--decode-mode", type=click.Choice(["auto", "async", "sync"]),
                      help="async: experts read through a device-side table, no sync per MoE layer, the cache "
                           "managed between tokens; sync: the route op answers every layer (needed by the host "
                           "path and prefetching); auto (default): async unless something needs sync or, on a GPU, "
                           "the cost model estimates sync faster (async's graph copies each miss into a free slot "
                           "and reads it there: one crossing of the link).")(fn)
    fn = click.option("--host-ram",
                      help="Host tier budget, e.g. 16GiB: a model whose experts do not fit it keeps them in the "
                           "GGUF file and reads them from disk into this many bytes of pinned RAM (default: what "
                           "the machine can pin, less a margin; `ggmoe inspect --host-ram` shows the tiers).")(fn)
    fn = click.option("--stats-json", type=click.Path(),
                      help="Write cache statistics (hit rate per layer, bytes copied, copy waits) here.")(fn)
    fn = click.option("--policy", help="Cache eviction policy (default lru; see `ggmoe policies`).")(fn)
    fn = click.option("--vram", help="Expert cache budget in bytes over all layers, e.g. 4GiB "
                                     "(`ggmoe inspect` shows what N slots per layer take).")(fn)
    fn = click.option("--cache-slots", type=click.IntRange(min=1, max=1 << 16),
                      help="Expert cache slots per MoE layer (needs the patched engine).")(fn)
    return fn


# the cache and statistics flags, handed to the command as ``cache: CacheFlags``
cache_options = option_group(CacheFlags, "cache", _stats_flag_options, _cache_flag_options)


def stats_summary(eng: Engine) -> str | None:
    """One line: the cache's hit rate and bytes copied (None without a cache)."""
    stats = eng.cache_stats
    if stats is None:
        return None
    from ggmoe.base.units import format_bytes

    t = stats.total()
    host = f", {t.host_computed} computed on the CPU" if t.host_computed else ""
    pre = (f", prefetch {t.prefetch_hits}/{t.prefetch_issued} used ({t.prefetch_wasted} wasted, "
           f"{t.prefetch_late} late), predictor {t.pred_accuracy:.1%} accurate" if t.prefetch_issued else "")
    note = (eng.miss_policy or (None, None))[1]
    mode = eng.decode_mode
    reads = f", {t.host_reads} read from host memory" if t.host_reads else ""
    pre += f", planner {t.plan_accuracy:.1%} accurate for the next token" if t.plan_total else ""
    split = (f", {t.top_hits} top-only hits (split layers: {t.top_hit_rate:.1%} found at least the top; "
             f"{format_bytes(t.bottom_read_bytes)} of bottoms read, {format_bytes(t.bottom_prefetch_bytes)} "
             "prefetched)" if t.top_hits or t.bottom_prefetches else "")
    return (f"cache: {t.hit_rate:.1%} hits ({t.hits} of {t.hits + t.top_hits + t.misses} expert uses){split}, "
            f"{format_bytes(t.bytes_copied)} copied{host}{reads}{pre}, {t.native_calls} native calls"
            + (f"; {note}" if note else "") + _host_tier_line(eng) + reader_behind_line(eng)
            + (f"\ndecode mode: {mode['decode_mode_in_effect']} ({mode['decode_mode_reason']}); copy stream: "
               f"{mode['copy_stream']}" if mode else ""))


def reader_behind_line(eng: Engine) -> str:
    """``reader_behind_note`` of the run as one more line of its summary (else empty)."""
    from ggmoe.control.prefetch import reader_behind_note

    note = reader_behind_note(eng.report().get("prefetch"))
    return f"\n{note}" if note else ""


def _host_tier_line(eng: Engine) -> str:
    """Under a disk tier: one more line with the host tier's hits and the disk's reads (else empty)."""
    tier = eng.report().get("host_tier")
    if not tier:
        return ""
    from ggmoe.base.units import format_bytes

    reads = tier["reads"]
    predicted = f", {tier['predicted_reads'] / reads:.0%} started by a prediction" if reads else ""
    return (f"\nhost tier: {tier['host_slots_per_layer']} slots/layer, {tier['hits']} hits; disk: {reads} experts "
            f"read ({format_bytes(tier['bytes_read'])}){predicted}, {tier['in_place']} read in place")


def write_stats(eng: Engine, path: str | None, extra: dict) -> None:
    if path is None:
        return
    report = eng.report()
    if not report:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    write_text_atomic(path, json.dumps({**extra, **report}, indent=2))


model_arg = click.argument("model", required=False, type=click.Path(dir_okay=False))
ctx_opt = click.option("--n-ctx", type=click.IntRange(min=8, max=MAX_N_CTX),
                       help="Context length in tokens (default: the model's training context).")
threads_opt = click.option("--threads", type=click.IntRange(min=1, max=MAX_THREADS),
                           help="CPU threads (default: all cores).")
verbose_opt = click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")
