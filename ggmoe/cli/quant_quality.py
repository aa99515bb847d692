"""``ggmoe compare-quants``' live passes: each level's quality (perplexity, KL divergence against a reference
level, ``ggmoe.simulate.quality``) and, with ``--measure``, its decode speed and hit rate on this machine; both
through the engine with the expert cache at the budget the simulator estimates."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggmoe.base.errors import UsageError

if TYPE_CHECKING:
    from ggmoe.control.run_config import RunConfig
    from ggmoe.engine import Engine
    from ggmoe.inspect import ModelFacts
    from ggmoe.simulate.quality import Quality, Reference, Windows

MEASURE_PROMPT = 32  # text tokens prefilled before the measured decode
FALLBACK_PROMPT = "def main():"  # the measured decode's prompt without --text


@dataclass(frozen=True)
class DecodeMeasured:
    """A decode measured on this machine: tokens fed one at a time after a prompt."""

    decode_tokens: int
    decode_s: float
    tpot_s: float  # the median of the tokens' times: a busy machine's pauses do not move it
    hit_rate: float | None  # over the prompt and the decode, from a cold cache (None: no cache)
    forced: bool  # the text's own tokens were fed (the same for every level), not the level's greedy ones

    def to_dict(self) -> dict[str, Any]:
        return {"decode_tokens": self.decode_tokens, "decode_s": self.decode_s, "tpot_s": self.tpot_s,
                "tpot_mean_s": self.decode_s / self.decode_tokens, "tokens_per_s": 1 / self.tpot_s,
                "hit_rate": self.hit_rate, "teacher_forced": self.forced}


@dataclass(frozen=True)
class QualitySpec:
    """What the quality pass reads: the text, the window, how much of it, and the reference's top tokens."""

    text: str
    source: str  # where the text came from, for messages
    n_ctx: int
    max_windows: int | None
    top_k: int


@dataclass(frozen=True)
class LevelRun:
    """One level's live figures."""

    quality: Quality | None
    measured: DecodeMeasured | None
    reference: Reference | None  # the reference this level built (it was the reference level)


def check_same_model(paths: list[Path], facts: list[ModelFacts]) -> None:
    """Every level must be the same model: the GGUF facts quantization does not change must agree."""
    from ggmoe.simulate.quality import key_difference, model_key

    first = model_key(facts[0])
    for path, f in zip(paths[1:], facts[1:], strict=True):
        diff = key_difference(first, model_key(f))
        if diff is not None:
            raise UsageError(f"{paths[0].name} and {path.name} are not levels of one model ({diff})")


def open_level(path: Path, n_ctx: int, run: RunConfig | None, threads: int | None) -> Engine:
    from ggmoe.engine import Engine, EngineConfig

    kw = {"n_threads": threads} if threads else {}
    return Engine(EngineConfig(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, run=run, **kw))


def windows_of(engine: Engine, spec: QualitySpec) -> Windows:
    from ggmoe.simulate.quality import make_windows

    ids = engine.tokenize(spec.text, add_bos=False)
    try:
        return make_windows(ids, engine.tokenize("", add_bos=True), spec.n_ctx, spec.max_windows)
    except UsageError as e:
        raise UsageError(f"--text {spec.source}: {e}") from None


def quality_pass(engine: Engine, windows: Windows, spec: QualitySpec, ref: Reference | None,
                 key: dict[str, Any]) -> tuple[Quality, Reference | None]:
    """The level's pass over the windows: against ``ref``, or as the reference (then built and returned)."""
    from ggmoe.inspect.fingerprint import model_fingerprint
    from ggmoe.simulate.quality import Scorer, score

    scorer = Scorer(spec.top_k, ref)
    quality = score(engine, windows, scorer)
    if ref is not None:
        return quality, None
    path = Path(engine.config.model_path)
    meta = {"model": {"name": path.name, "fingerprint": model_fingerprint(path), "key": key},
            "n_vocab": engine.n_vocab}
    return quality, scorer.reference(windows, meta)


def measure(engine: Engine, run: RunConfig | None, text_ids: list[int] | None, n_tokens: int) -> DecodeMeasured:
    """Decode ``n_tokens`` one at a time after a prompt, from a cold cache: the text's own tokens when it has
    enough (the same for every level), else the level's greedy ones after a fixed prompt."""
    if run is not None:
        engine.reconfigure(run)  # a cold cache, its statistics from zero
    engine.reset()
    forced = text_ids is not None and len(text_ids) > MEASURE_PROMPT + n_tokens
    if forced:  # stream yields the prefill's time first, then one decode per token it feeds
        prompt, follow = text_ids[:MEASURE_PROMPT], text_ids[MEASURE_PROMPT:MEASURE_PROMPT + n_tokens + 1]
    else:
        prompt, follow = engine.tokenize(FALLBACK_PROMPT), None
    times = [dt for i, (_tok, dt) in enumerate(engine.stream(prompt, n_tokens + 1, forced=follow)) if i > 0]
    if not times:
        raise UsageError("--measure: the model stopped before decoding a token; give --text")
    stats = engine.cache_stats
    return DecodeMeasured(len(times), sum(times), statistics.median(times),
                    stats.total().hit_rate if stats is not None else None, forced)


def check_ctx(path: Path, facts: ModelFacts, n_ctx: int | None) -> int:
    """The window: --ctx, at most the model's training context; 512 tokens (or that context) when not given."""
    from ggmoe.inspect.reader import read_header

    trained = read_header(path).kv.get(f"{facts.arch}.context_length")
    trained = int(trained) if isinstance(trained, int) and trained >= 8 else None
    if n_ctx is None:
        return min(512, trained or 512)
    if trained is not None and n_ctx > trained:
        raise UsageError(f"--ctx {n_ctx} is longer than {path.name}'s training context ({trained} tokens)")
    return n_ctx


def reference_index(paths: list[Path], facts: list[ModelFacts], named: str | None) -> int:
    """The reference level: the one ``--reference`` names, else the most bytes per expert (then file size)."""
    if named is not None:
        want = Path(named).resolve()
        for i, p in enumerate(paths):
            if p.resolve() == want or p.name == named:
                return i
        raise UsageError(f"--reference {named}: not one of the levels given ({', '.join(p.name for p in paths)})")
    size = [(sum(f.bytes_per_expert(il) for il in f.moe_layers), f.file_bytes) for f in facts]
    return max(range(len(paths)), key=lambda i: size[i])


@dataclass(frozen=True)
class LiveSpec:
    """The live passes asked for: quality (None: no --text), the reference, and the measured decode."""

    quality: QualitySpec | None
    n_ctx: int  # the engine's context: the quality window, or the measured decode's
    reference: int | None  # the reference level's index; None with a reference file
    kl_base: Reference | None  # the reference read from --kl-base
    kl_base_path: str | None
    measure_tokens: int | None  # None: no --measure
    threads: int | None


def run_levels(paths: list[Path], facts: list[ModelFacts], caches: list[RunConfig | None],
               spec: LiveSpec) -> list[LevelRun]:
    """Each level through the engine once, the reference level first (the others are scored against it)."""
    from ggmoe.simulate.quality import check_reference, model_key

    order = list(range(len(paths)))
    if spec.reference is not None:
        order.remove(spec.reference)
        order.insert(0, spec.reference)
    key = model_key(facts[0])
    runs: dict[int, LevelRun] = {}
    first: tuple[Path, Windows] | None = None
    ref = spec.kl_base
    for i in order:
        with open_level(paths[i], spec.n_ctx, caches[i], spec.threads) as engine:
            quality, built, ids = None, None, None
            if spec.quality is not None:
                windows = windows_of(engine, spec.quality)
                if first is None:
                    first = (paths[i], windows)
                    if ref is not None:
                        check_reference(ref, windows, key, engine.n_vocab, str(spec.kl_base_path))
                elif not (windows.tokens.shape == first[1].tokens.shape
                          and (windows.tokens == first[1].tokens).all()):
                    raise UsageError(f"{paths[i].name} tokenizes the text differently from {first[0].name}: "
                                     "not levels of one model")
                quality, built = quality_pass(engine, windows, spec.quality, ref, key)
                ref = ref if built is None else built
                ids = engine.tokenize(spec.quality.text, add_bos=False)
            measured = (measure(engine, caches[i], ids, spec.measure_tokens)
                        if spec.measure_tokens is not None else None)
        runs[i] = LevelRun(quality, measured, built)
    return [runs[i] for i in range(len(paths))]
