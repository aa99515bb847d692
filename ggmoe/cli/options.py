"""Options and helpers shared by the commands: the model argument, engine flags, cache flags."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ggmoe.errors import UsageError


def model_path(model: str | None) -> Path:
    if model:
        return Path(model)
    from ggmoe.models import default_model_path

    path = default_model_path()
    if path is None:
        raise UsageError("no MODEL given and this install has no embedded default model")
    return path


def make_engine(model: Path, n_ctx: int, threads: int | None, verbose: bool, cache=None):
    from ggmoe.engine import Engine, EngineConfig

    kw = {"n_threads": threads} if threads else {}
    return Engine(EngineConfig(model_path=model, n_ctx=n_ctx, verbose=verbose, cache=cache, **kw))


def cache_config(cache_slots: int | None, vram: str | None, policy: str | None):
    """A CacheConfig from the flags, or None when no cache flag was given."""
    if cache_slots is None and vram is None:
        if policy is not None:
            raise UsageError("--policy needs a cache size: --cache-slots N or --vram BYTES")
        return None
    from ggmoe.cache import CacheConfig
    from ggmoe.cache.policies import POLICIES
    from ggmoe.units import parse_bytes

    if cache_slots is not None and vram is not None:
        raise UsageError("give either --cache-slots or --vram, not both")
    POLICIES.get(policy or "lru")  # an unknown name fails here, listing the choices
    return CacheConfig(n_slots=cache_slots, vram_bytes=parse_bytes(vram) if vram is not None else None,
                       policy=policy or "lru")


def cache_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--stats-json", type=click.Path(dir_okay=False),
                      help="Write cache statistics (hit rate per layer, bytes copied, copy waits) here.")(fn)
    fn = click.option("--policy", help="Cache eviction policy (default lru; see `ggmoe policies`).")(fn)
    fn = click.option("--vram", help="Expert cache budget in bytes over all layers, e.g. 4GiB.")(fn)
    fn = click.option("--cache-slots", type=click.IntRange(min=1),
                      help="Expert cache slots per MoE layer (needs the patched engine).")(fn)
    return fn


def write_stats(eng: Any, path: str | None, extra: dict) -> None:
    if path is None:
        return
    if eng.cache_stats is None:
        raise UsageError("--stats-json needs a cache: --cache-slots N or --vram BYTES")
    d = {"policy": eng.config.cache.policy, "slots_per_layer": {str(k): v for k, v in eng.cache_slots.items()},
         **extra, **eng.cache_stats.to_dict()}
    Path(path).write_text(json.dumps(d, indent=2))


model_arg = click.argument("model", required=False, type=click.Path(dir_okay=False))
ctx_opt = click.option("--n-ctx", default=1024, show_default=True, type=click.IntRange(min=8),
                        help="Context length in tokens.")
threads_opt = click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: all cores).")
verbose_opt = click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")
