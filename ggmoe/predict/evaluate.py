"""Offline evaluation of expert predictors on held-out traces.

Each held-out prompt is replayed token by token through the ``Predictor`` interface
exactly as the live engine drives it (``ggmoe.predict``): for every MoE layer at
position j the predictor observes the routing, then predicts position j + stride.
Targets among the first ``stride`` positions are asked at the token start, before
any layer of the token is seen (only predictors that can answer there score them).

Metrics per target layer (k = n_expert_used, m = prefetch set size):

- accuracy (ProMoE): |top-k(predicted) ∩ actual| / k;
- recall@m: |top-m(predicted) ∩ actual| / k, the share of needed experts a
  prefetch of m experts would have brought in;
- precision@m: |top-m(predicted) ∩ actual| / m, the share of prefetched experts used;
- latency: wall time of ``observe(source) + predict(target)`` for one token, p50/p99 µs
  (numpy on this CPU; ``predict`` only at the token start).

``overall`` pools every scored prediction of the layers that have a source layer
(positions >= stride), so predictors that cannot predict at the token start compare
on the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ggmoe.base.errors import UsageError
from ggmoe.base.outputs import atomic_write
from ggmoe.base.params import check_params
from ggmoe.predict.base import ModelShape, Predictor, check_trace_inputs, make_predictor, predictor_class
from ggmoe.trace.format import STAGE_DECODE, STAGE_PREFILL, Trace

STAGES = {"all": None, "prefill": STAGE_PREFILL, "decode": STAGE_DECODE}


@dataclass(frozen=True)
class LayerScore:
    il: int  # target MoE layer (-1: overall)
    n: int  # predictions scored
    accuracy: float  # mean |top-k ∩ actual| / k
    recall: float  # mean |top-m ∩ actual| / k
    precision: float  # mean |top-m ∩ actual| / m
    latency_us_p50: float  # µs per token: observe(source) + predict(target)
    latency_us_p99: float
    token_start: bool  # predicted before the token's first layer


@dataclass(frozen=True)
class EvalResult:
    predictor: str  # name or file
    stride: int
    prefetch: int  # m
    n_expert_used: int  # k
    n_prompts: int
    n_tokens: int  # tokens replayed
    layers: tuple[LayerScore, ...]  # per target layer, ascending
    overall: LayerScore

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Acc:
    """Running sums of one target position."""

    n: int = 0
    hit_k: int = 0  # sum of |top-k ∩ actual|
    hit_m: int = 0  # sum of |top-m ∩ actual|
    lat_ns: list[np.ndarray] = field(default_factory=list)  # latencies of scored predictions, ns


def _check(pred: Predictor, trace: Trace, prefetch: int) -> None:
    shape = pred.shape
    if tuple(int(il) for il in trace.layers) != shape.layers:
        raise UsageError(f"the trace's MoE layers {trace.layers.tolist()} are not the predictor's {list(shape.layers)}")
    if trace.meta.model_fingerprint != shape.model_fingerprint:
        raise UsageError("the trace was recorded with another model than the predictor was built for")
    check_trace_inputs(pred, trace.meta)
    if pred.needs_hidden and trace.hidden is None:
        raise UsageError(f"predictor {pred.name!r} needs MoE input hidden states; the trace has none "
                         "(recorded with --no-hidden)")
    if not shape.n_expert_used <= prefetch <= shape.n_expert:
        raise UsageError(f"prefetch {prefetch} must be between n_expert_used {shape.n_expert_used} "
                         f"and n_expert {shape.n_expert}")


def _replay_prompt(pred: Predictor, trace: Trace, sl: slice) -> tuple[np.ndarray, np.ndarray]:
    """Scores [T_p, L, E] float32 (NaN where not predicted) and latency [T_p, L] ns of one prompt."""
    shape, s = pred.shape, pred.stride
    layers, n_l = shape.layers, shape.n_layer
    ids = trace.ids[sl].astype(np.int64)  # [T_p, L, k]
    probs = trace.probs[sl].astype(np.float32)  # [T_p, L, E]
    hidden = trace.hidden[sl].astype(np.float32) if trace.hidden is not None else None  # [T_p, L, n_embd]
    toks = trace.token_ids[sl]
    scores = np.full((ids.shape[0], n_l, shape.n_expert), np.nan, dtype=np.float32)
    lat = np.zeros((ids.shape[0], n_l), dtype=np.int64)
    clock = time.perf_counter_ns
    pred.begin_request()
    for t in range(ids.shape[0]):
        pred.begin_token(int(toks[t]))
        if pred.needs_truth:
            pred.reveal(ids[t])  # type: ignore[attr-defined]
        for jt in range(s):
            t0 = clock()
            out = pred.predict(layers[jt])
            lat[t, jt] = clock() - t0
            if out is not None:
                scores[t, jt] = out
        for j in range(n_l):
            t0 = clock()
            pred.observe(layers[j], ids[t, j], probs[t, j], hidden[t, j] if hidden is not None else None)
            if j + s < n_l:
                out = pred.predict(layers[j + s])
                lat[t, j + s] = clock() - t0
                if out is not None:
                    scores[t, j + s] = out
    pred.end_request()
    return scores, lat


def evaluate(pred: Predictor, trace: Trace, prefetch: int, stage: str = "all", label: str | None = None) -> EvalResult:
    """Replay every prompt of ``trace`` (held-out) through ``pred``; the metrics of the module docstring."""
    _check(pred, trace, prefetch)
    if stage not in STAGES:
        raise UsageError(f"stage {stage!r}: choose one of {', '.join(STAGES)}")
    shape, k, m = pred.shape, pred.shape.n_expert_used, prefetch
    accs = [_Acc() for _ in shape.layers]
    for p in range(trace.n_prompts):
        sl = trace.prompt_slice(p)
        scores, lat = _replay_prompt(pred, trace, sl)
        rows = np.ones(sl.stop - sl.start, dtype=bool) if STAGES[stage] is None else trace.stage[sl] == STAGES[stage]
        actual = np.zeros(scores.shape, dtype=bool)  # [T_p, L, E]
        np.put_along_axis(actual, trace.ids[sl].astype(np.int64), True, axis=2)
        order = np.argsort(-np.nan_to_num(scores, nan=-np.inf), axis=2, kind="stable")[..., :m]  # [T_p, L, m]
        hit = np.take_along_axis(actual, order, axis=2)
        valid = ~np.isnan(scores[..., 0]) & rows[:, None]  # [T_p, L]
        for j, acc in enumerate(accs):
            v = valid[:, j]
            acc.n += int(v.sum())
            acc.hit_k += int(hit[v, j, :k].sum())
            acc.hit_m += int(hit[v, j].sum())
            acc.lat_ns.append(lat[v, j])
    per_layer = tuple(_score(il, [a], k, m, token_start=j < pred.stride) for j, (il, a) in
                      enumerate(zip(shape.layers, accs, strict=True)))
    overall = _score(-1, accs[pred.stride:], k, m, token_start=False)
    return EvalResult(predictor=label or pred.name, stride=pred.stride, prefetch=m, n_expert_used=k,
                      n_prompts=trace.n_prompts, n_tokens=trace.n_tokens, layers=per_layer, overall=overall)


def _score(il: int, accs: list[_Acc], k: int, m: int, token_start: bool) -> LayerScore:
    n = sum(a.n for a in accs)
    lat = np.concatenate([x for a in accs for x in a.lat_ns]) if n else np.zeros(0)
    p50, p99 = (np.percentile(lat, [50, 99]) / 1e3).tolist() if lat.size else (float("nan"), float("nan"))
    hk, hm = sum(a.hit_k for a in accs), sum(a.hit_m for a in accs)
    nan = float("nan")
    return LayerScore(il=il, n=n, accuracy=hk / (n * k) if n else nan, recall=hm / (n * k) if n else nan,
                      precision=hm / (n * m) if n else nan, latency_us_p50=p50, latency_us_p99=p99,
                      token_start=token_start)


def build_predictor(spec: str, shape: ModelShape, stride: int, train: Trace | None,
                    options: dict[str, object]) -> Predictor:
    """A predictor from a name or .npz path, given the ``options`` it declares (others are for other
    predictors), fitted if it must be."""
    declared = {p.name for p in predictor_class(spec).PARAMS}
    pred = make_predictor(spec, shape, stride, **{k: v for k, v in options.items() if k in declared})
    if pred.needs_fit:
        if train is None or train.n_prompts == 0:
            raise UsageError(f"predictor {spec!r} learns from training traces; none given")
        pred.fit(train)
    return pred


def check_options(specs: list[str], options: Mapping[str, str]) -> dict[str, object]:
    """``--opt`` text for the predictors ``specs``: each option converted to the type a predictor declares
    for it and checked against the bounds of every predictor that takes it; an option none takes fails."""
    classes = {spec: predictor_class(spec) for spec in specs}
    out: dict[str, object] = {}
    for key, text in options.items():
        takers = [(spec, cls) for spec, cls in classes.items()
                  if any(p.name == key and not p.internal for p in cls.PARAMS)]
        if not takers:
            known = sorted({p.describe() for cls in classes.values() for p in cls.PARAMS if not p.internal})
            raise UsageError(f"--opt {key} is not accepted by {', '.join(specs)}; "
                             + (f"they take {', '.join(known)}" if known else "they take no options"))
        for spec, cls in takers:
            out[key] = check_params(f"--opt for predictor {spec!r}", cls.PARAMS, {key: text}, from_text=True)[key]
    return out


MIN_HELD_OUT_PROMPTS = 5  # fewer held-out prompts (or tokens) than this and the figures are noise
MIN_HELD_OUT_TOKENS = 200


def held_out_warning(trace: Trace) -> str | None:
    """A one-line warning when the held-out prompts are too few to score predictors, else None."""
    if trace.n_prompts >= MIN_HELD_OUT_PROMPTS and trace.n_tokens >= MIN_HELD_OUT_TOKENS:
        return None
    return (f"warning: only {trace.n_prompts} held-out prompt(s) / {trace.n_tokens} tokens (fewer than "
            f"{MIN_HELD_OUT_PROMPTS} prompts or {MIN_HELD_OUT_TOKENS} tokens): the scores are noisy; trace more "
            "prompts, raise --val-frac or give --train")


def default_model(fingerprint: str) -> Path | None:
    """The embedded model (``ggmoe.models``) when the traces were recorded with it, else None."""
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.models import default_model_path

    path = default_model_path()
    if path is None or model_fingerprint(path) != fingerprint:
        return None
    return path


def render_summary(results: list[EvalResult]) -> str:
    """One row per predictor, side by side: the overall accuracy, recall@m, precision@m and p50 latency."""
    r0 = results[0]
    width = max(9, *(len(r.predictor) for r in results))
    head = (f"{'predictor':<{width}} {'accuracy':>9} {f'recall@{r0.prefetch}':>10} "
            f"{f'prec@{r0.prefetch}':>9} {'p50 us':>8}")
    lines = [f"summary: stride {r0.stride}, k={r0.n_expert_used}, prefetch m={r0.prefetch}, "
             f"{r0.n_prompts} held-out prompts, {r0.n_tokens} tokens", head]
    for r in results:
        o = r.overall
        if o.n == 0:
            lines.append(f"{r.predictor:<{width}} {'-':>9} {'-':>10} {'-':>9} {'-':>8}")
            continue
        lines.append(f"{r.predictor:<{width}} {o.accuracy:>9.3f} {o.recall:>10.3f} {o.precision:>9.3f} "
                     f"{o.latency_us_p50:>8.1f}")
    return "\n".join(lines)


def render_text(r: EvalResult) -> str:
    """A table: one row per target layer and the overall row."""
    lines = [f"{r.predictor}: stride {r.stride}, k={r.n_expert_used}, prefetch m={r.prefetch}, "
             f"{r.n_prompts} held-out prompts, {r.n_tokens} tokens",
             f"  {'il':>5} {'n':>7} {'accuracy':>9} {f'recall@{r.prefetch}':>10} {f'prec@{r.prefetch}':>9} "
             f"{'p50 us':>8} {'p99 us':>8}"]
    for s in (*r.layers, r.overall):
        name = "all" if s.il < 0 else f"{s.il}{'*' if s.token_start else ''}"
        if s.n == 0:
            lines.append(f"  {name:>5} {0:>7} {'-':>9} {'-':>10} {'-':>9} {'-':>8} {'-':>8}")
            continue
        lines.append(f"  {name:>5} {s.n:>7} {s.accuracy:>9.3f} {s.recall:>10.3f} {s.precision:>9.3f} "
                     f"{s.latency_us_p50:>8.1f} {s.latency_us_p99:>8.1f}")
    if any(s.token_start for s in r.layers):
        lines.append("  * predicted at the token start (no layer of the token seen); not in 'all'")
    return "\n".join(lines)


def plot_accuracy(results: list[EvalResult], path: str | Path) -> Path:
    """Grouped bars: accuracy per target layer, one bar per predictor (matplotlib, Agg backend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    first = results[0].layers
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(first) * len(results) + 4), 4))
    x = np.arange(len(first))
    for i, r in enumerate(results):
        acc = [s.accuracy if s.n else 0.0 for s in r.layers]
        ax.bar(x + (i - (len(results) - 1) / 2) * width, acc, width,
               label=f"{r.predictor} (all {r.overall.accuracy:.2f})")
    ax.set_xticks(x, [f"{s.il}{'*' if s.token_start else ''}" for s in first])
    ax.set_xlabel(f"target MoE layer il (stride {results[0].stride}; * predicted at the token start)")
    ax.set_ylabel(f"accuracy |top-k ∩ actual| / k, k={results[0].n_expert_used}")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    with atomic_write(path) as f:  # a crash or Ctrl-C leaves no half-written image
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return path


def json_safe(obj: object) -> object:
    """NaN (nothing scored) as null, recursively, so that the JSON is standard."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
