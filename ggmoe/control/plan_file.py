"""Plan files: the cache configuration ``ggmoe plan`` chose, as TOML that ``--config FILE`` loads.

    [cache]
    policy = "lru"
    miss_policy = "auto"
    hw = "pcie4"                 # the auto miss policy's cost model (optional)
    [cache.slots]                # slots per MoE layer: "il" = n
    "0" = 8
    "1" = 12
    [cache.theta]                # optional: MoEpic's split, the top share θ of each layer's experts that a
    "0" = 0.5                    # slot holds (the rest read from host memory or prefetched); 1: whole experts
    [cache.policy_options]       # optional: the policy's declared options (``ggmoe policies``), e.g.
    window = 16                  # fmoe's; checked against the policy's PARAMS (ggmoe.base.params)
    [prefetch]                   # optional: stride prefetching
    predictor = "reuse"
    stride = 1
    n_prefetch = 8               # optional
    [estimate]                   # what plan estimated (informative; never read back)
    tpot_s = 0.0123

Read with ``tomllib`` and validated field by field; written atomically.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import write_text_atomic
from ggmoe.base.params import check_params
from ggmoe.base.tomlfile import read_toml
from ggmoe.cache.config import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig

if TYPE_CHECKING:
    from ggmoe.control.prefetch import PrefetchConfig

MAX_PLAN_BYTES = 1 << 20
MAX_SLOTS, MAX_STRIDE, MAX_PREFETCH = 1 << 16, 1024, 4096  # the bounds of --cache-slots, --stride, --prefetch
PLAN_VERSION = 1


def read_plan(path: str | Path) -> RunConfig:
    """The ``RunConfig`` a plan file describes; UsageError naming the file and the field otherwise."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {p}: no such file")
    data = read_toml(p, f"--config {p}", "plan", MAX_PLAN_BYTES)

    def fail(msg: str) -> UsageError:
        return UsageError(f"--config {p}: {msg}")

    if data.get("version", PLAN_VERSION) != PLAN_VERSION:
        raise fail(f"plan version {data.get('version')!r}; this ggmoe reads version {PLAN_VERSION}")
    cache = data.get("cache")
    if not isinstance(cache, dict):
        raise fail("needs a [cache] table")
    # field by field, in the order of the file's tables, so the first bad field is the one named
    layer_slots = _layer_slots(cache, fail)
    layer_theta = _layer_theta(cache, layer_slots, fail)
    policy, options = _policy(cache, f"--config {p}", fail)
    miss, hw = _miss_policy(cache, fail)
    prefetch = _prefetch(data.get("prefetch"), fail)
    cache_config = CacheConfig(layer_slots=layer_slots, policy=policy, policy_options=options or None,
                               layer_theta=layer_theta or None)
    return RunConfig(cache_config, DecodeConfig(miss_policy=miss, hw_profile=hw), prefetch=prefetch)


Fail = Callable[[str], UsageError]  # a message -> the UsageError naming the plan file


def _layer(k: object) -> bool:
    """Whether a TOML key names a MoE layer: digits, at most 9 (an int, never a huge one)."""
    return isinstance(k, str) and k.isdigit() and len(k) <= 9


def _layer_slots(cache: dict, fail: Fail) -> dict[int, int]:
    """``[cache.slots]``: slots per MoE layer, each a positive integer (at most ``MAX_SLOTS``)."""
    slots = cache.get("slots")
    if not isinstance(slots, dict) or not slots:
        raise fail("[cache.slots] must map MoE layers to slot counts, e.g. \"0\" = 8")
    layer_slots: dict[int, int] = {}
    for k, v in slots.items():
        if not _layer(k) or isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SLOTS:
            raise fail(f"[cache.slots] {k!r} = {v!r}: layers are numbers, slots positive integers "
                       f"(at most {MAX_SLOTS})")
        layer_slots[int(k)] = v
    return layer_slots


def _layer_theta(cache: dict, layer_slots: dict[int, int], fail: Fail) -> dict[int, float]:
    """``[cache.theta]`` (optional): MoEpic's top share per layer, a finite number in [0, 1], only for layers
    that have slots."""
    theta = cache.get("theta", {})
    if not isinstance(theta, dict):
        raise fail("[cache.theta] must map MoE layers to top shares, e.g. \"0\" = 0.5")
    layer_theta: dict[int, float] = {}
    for k, v in theta.items():
        if not _layer(k) or isinstance(v, bool) or not isinstance(v, int | float) \
                or not math.isfinite(v) or not 0 <= v <= 1:
            raise fail(f"[cache.theta] {k!r} = {v!r}: layers are numbers, top shares numbers from 0 to 1")
        if int(k) not in layer_slots:
            raise fail(f"[cache.theta] names layer {k}, which [cache.slots] does not")
        layer_theta[int(k)] = float(v)
    return layer_theta


def _policy(cache: dict, where: str, fail: Fail) -> tuple[str, dict[str, Any]]:
    """The eviction policy's name and its options, checked against the policy's declared ``PARAMS``."""
    from ggmoe.cache.policies import POLICIES

    policy = cache.get("policy", "lru")
    if not isinstance(policy, str):
        raise fail("[cache] policy must be a string")
    options = cache.get("policy_options", {})
    if not isinstance(options, dict):
        raise fail("[cache.policy_options] must be a table of the policy's options")
    options = check_params(f"{where}: [cache.policy_options] of policy {policy!r}",
                           POLICIES.get(policy).PARAMS, options, external=True)
    return policy, options


def _miss_policy(cache: dict, fail: Fail) -> tuple[str, str | None]:
    """The miss policy and, for ``auto``, the hardware profile of its cost model (None: measured)."""
    from ggmoe.cache.miss import check_miss_policy

    miss = cache.get("miss_policy", "wait")
    if not isinstance(miss, str):
        raise fail("[cache] miss_policy must be a string")
    check_miss_policy(miss)
    hw = cache.get("hw")
    if hw is not None and (not isinstance(hw, str) or miss != "auto"):
        raise fail("[cache] hw is a profile name or file, for miss_policy = \"auto\"")
    return miss, hw


def _prefetch(pre: object, fail: Fail) -> PrefetchConfig | None:
    """``[prefetch]`` (optional): the predictor, its stride and experts per layer; None without the table."""
    from ggmoe.control.prefetch import PrefetchConfig

    if pre is None:
        return None
    if not isinstance(pre, dict) or not isinstance(pre.get("predictor"), str):
        raise fail("[prefetch] needs predictor = \"NAME\"")
    stride, n = pre.get("stride", 2), pre.get("n_prefetch")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= MAX_STRIDE:
        raise fail(f"[prefetch] stride must be an integer in [1, {MAX_STRIDE}]")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PREFETCH):
        raise fail(f"[prefetch] n_prefetch must be an integer in [1, {MAX_PREFETCH}]")
    if not pre["predictor"].strip():
        raise fail("[prefetch] predictor is empty")
    return PrefetchConfig(predictor=pre["predictor"], stride=stride, n_prefetch=n)


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _value(v: object) -> str:
    """A policy option as TOML: a bool, int, finite float or string (what a plan file can hold)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _num(v)
    return _q(str(v))


def _num(x: float) -> str:
    return repr(float(x)) if math.isfinite(x) else "0.0"


def render_plan(run: RunConfig, estimate: Mapping[str, float], comment: str = "") -> str:
    cache, decode = run.cache, run.decode
    lines = [f"# {line}" for line in comment.splitlines()] + [f"version = {PLAN_VERSION}", "", "[cache]",
                                                             f"policy = {_q(cache.policy)}",
                                                             f"miss_policy = {_q(decode.miss_policy)}"]
    if decode.hw_profile is not None:
        lines.append(f"hw = {_q(str(decode.hw_profile))}")
    lines += ["", "[cache.slots]", *(f'"{il}" = {n}' for il, n in sorted((cache.layer_slots or {}).items()))]
    if cache.layer_theta:
        lines += ["", "[cache.theta]", *(f'"{il}" = {_num(t)}' for il, t in sorted(cache.layer_theta.items()))]
    if cache.policy_options:
        lines += ["", "[cache.policy_options]", *(f"{k} = {_value(v)}" for k, v in cache.policy_options.items())]
    pre = run.prefetch
    if pre is not None:
        lines += ["", "[prefetch]", f"predictor = {_q(pre.predictor)}", f"stride = {pre.stride}"]
        if pre.n_prefetch is not None:
            lines.append(f"n_prefetch = {pre.n_prefetch}")
    if estimate:
        lines += ["", "[estimate]", *(f"{k} = {_num(v)}" for k, v in estimate.items())]
    return "\n".join(lines) + "\n"


def write_plan(path: str | Path, run: RunConfig, estimate: Mapping[str, float], comment: str = "") -> Path:
    write_text_atomic(path, render_plan(run, estimate, comment))
    return Path(path)
