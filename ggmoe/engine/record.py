"""Recording: prompts run through the engine, their routing written as a trace (``ggmoe.trace``'s format).

Three modes, because a tiny model decoding greedily soon repeats itself and
repeated tokens route to the same experts, which flatters caching:
- ``greedy``: prefill the prompt, then decode greedily;
- ``sample``: prefill, then sample (temperature, seed);
- ``teacher``: prefill the first ``prefill_tokens`` of a document, then feed its
  real continuation one token per decode step (teacher forcing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ggmoe.base.context import check_prompt
from ggmoe.base.errors import UsageError
from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.base.version import __version__
from ggmoe.engine.engine import Engine, Generation, StepCallback
from ggmoe.inspect.fingerprint import model_fingerprint
from ggmoe.trace.format import STAGE_DECODE, STAGE_PREFILL, TraceMeta, TraceWriter

MODES = ("greedy", "sample", "teacher")
# what a trace of the async decode lacks: it reads no router probabilities or MoE inputs (``LACKS``)
ASYNC_LACKS = ("hidden", "probs")
ASYNC_NOTE = ("the trace holds expert ids only: the async decode, which it measures, reads no router probabilities "
              "or MoE inputs (--decode-mode sync records them)")


@dataclass(frozen=True)
class RecordConfig:
    mode: str = "greedy"
    max_tokens: int = 64  # decode steps per prompt
    prefill_tokens: int = 64  # teacher mode: tokens of the document fed as the prefill
    temp: float = 0.8  # sample mode
    seed: int = 0
    keep_hidden: bool = True


def trace_meta(engine: Engine, mode: str, max_tokens: int, lacks: tuple[str, ...] = ()) -> TraceMeta:
    """The trace's header, from the engine's model facts (read once, at load)."""
    f = engine.facts
    return TraceMeta(
        model_fingerprint=model_fingerprint(engine.config.model_path),
        model_name=Path(engine.config.model_path).name, arch=f.arch, n_layer=f.n_layer,
        n_expert=f.n_expert, n_expert_used=f.n_expert_used, n_embd=f.n_embd,
        mode=mode, max_tokens=max_tokens, ggmoe_version=__version__, n_ubatch=engine.config.n_ubatch,
        gating=f.gating.func, lacks=lacks,
    )


def records_ids_only(engine: Engine) -> bool:
    """Whether ``record_trace`` on ``engine`` records expert ids only: its cache runs the async decode, which a
    server would run, and a recorder asking for probabilities or MoE inputs would turn it into the sync path
    (the route op at every layer), so the trace would measure another decode than the one it names."""
    return engine.decode_mode.get("decode_mode_in_effect") == "async"


def _step_writer(writer: TraceWriter, rec: RouteRecorder) -> StepCallback:
    """An ``on_step`` callback moving each decode's routing into the trace."""

    def on_step(tokens: list[int], pos0: int, prefill: bool) -> None:
        writer.add_step(tokens, pos0, STAGE_PREFILL if prefill else STAGE_DECODE, rec.take())

    return on_step


def record_trace(engine: Engine, prompts: Iterable[str], config: RecordConfig, out: str | Path,
                 progress: Callable[[int], None] | None = None) -> Path:
    """Trace every prompt and write ``out`` (a ``.npz`` path); returns the path written. On an engine whose
    cache runs the async decode the trace holds expert ids only (``records_ids_only``)."""
    if config.mode not in MODES:
        raise UsageError(f"unknown mode {config.mode!r}; choose one of {', '.join(MODES)}")
    if config.max_tokens < 1:
        raise UsageError("max_tokens must be at least 1")
    ids_only = records_ids_only(engine)  # the async decode's routing from its controller, table mode kept
    recorder = RouteRecorder(HookRequest(probs=False, hidden=False) if ids_only
                             else HookRequest(probs=True, hidden=config.keep_hidden))
    meta = trace_meta(engine, config.mode, config.max_tokens, ASYNC_LACKS if ids_only else ())
    writer = TraceWriter(meta, keep_hidden=config.keep_hidden and not ids_only)
    # Every prompt is checked before any runs: a bad one fails fast instead of losing the work before it.
    plans = [_plan(engine, i, prompt, config) for i, prompt in enumerate(prompts)]
    with engine.observing(recorder):
        for i, plan in enumerate(plans):
            _record_one(engine, plan, config, _step_writer(writer, recorder), seed=config.seed + i)
            writer.end_prompt()
            if progress:
                progress(1)
    return writer.save(out)


def trace_generation(engine: Engine, prompt: str, max_tokens: int, temp: float, seed: int, out: str | Path,
                     on_text: Callable[[str], None] | None = None) -> Generation:
    """``engine.generate`` that also writes its routing as a one-prompt trace (full prefill routing)."""
    recorder = RouteRecorder(HookRequest(probs=True, hidden=True))
    writer = TraceWriter(trace_meta(engine, "sample" if temp > 0 else "greedy", max_tokens), keep_hidden=True)
    with engine.observing(recorder):
        gen = engine.generate(prompt, max_tokens, temp=temp, seed=seed, all_logits=True,
                              on_step=_step_writer(writer, recorder), on_text=on_text)
    writer.end_prompt()
    writer.save(out)
    return gen


def _plan(engine: Engine, n: int, text: str, cfg: RecordConfig) -> tuple[list[int], list[int] | None]:
    """(prefill ids, forced continuation or None) of prompt ``n``; a prompt that cannot run is an error."""
    ids = engine.tokenize(text)
    forced = None
    if cfg.mode == "teacher":
        if len(ids) < cfg.prefill_tokens + 2:
            raise UsageError(f"prompt {n + 1}: teacher mode needs at least {cfg.prefill_tokens + 2} tokens, "
                             f"the text has {len(ids)}")
        forced = ids[cfg.prefill_tokens:]
        ids = ids[: cfg.prefill_tokens]
    check_prompt(len(ids), engine.n_ctx, f"prompt {n + 1}" + (" (its prefill)" if forced is not None else ""))
    return ids, forced


def _record_one(engine: Engine, plan: tuple[list[int], list[int] | None], cfg: RecordConfig,
                on_step: StepCallback, seed: int) -> None:
    engine.reset()
    ids, forced = plan
    budget = engine.n_ctx - len(ids)  # decode steps the KV cache still holds
    # max_tokens decode steps feed max_tokens tokens: one more is produced than is fed.
    steps = min(cfg.max_tokens, budget, len(forced) - 1 if forced is not None else cfg.max_tokens) + 1
    temp = cfg.temp if cfg.mode == "sample" else 0.0
    for _ in engine.stream(ids, steps, temp=temp, seed=seed, forced=forced, all_logits=True, on_step=on_step):
        pass
