"""``ggmoe.load()``: a ``llama_cpp.Llama`` whose experts live in host RAM, with ggmoe's expert cache.

Everything a ``Llama`` does (completion, chat templates rendered by
llama-cpp-python's sandboxed Jinja2 formatter, streaming, stop strings, seeds,
logprobs, grammars, tokenization) is llama-cpp-python's own; this subclass adds
three things at the seams ``Llama`` leaves open:

1. **Experts on the host at load.** ``Llama.__init__`` builds
   ``self.model_params`` and hands it to llama.cpp in the same call, with no
   argument for ``tensor_buft_overrides``. ``model_params`` is therefore a
   property here: its setter (run by ``Llama.__init__``'s own assignment, before
   the model loads) points the parameters at ggmoe's override list. No
   llama_cpp module global is touched.
2. **The cache after load.** Once the context exists, the route callback and
   the slot tensors are attached to the raw ``llama_model *`` / ``llama_context *``
   (``ggmoe.engine.llama_attach``).
3. **Errors after each decode.** ``eval`` re-raises what the route callback
   stored (a callback never raises into C), so the error surfaces from the
   ``Llama`` call that ran the decode; ``generate`` offers a per-token hook the
   server uses for timings, usage in streams and cancellation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp
import numpy as np

from ggmoe.base.context import check_prompt, context_tokens
from ggmoe.base.errors import ModelFileError, UsageError
from ggmoe.base.hook import RouteObserver
from ggmoe.control.run_config import RunConfig

if TYPE_CHECKING:
    from ggmoe.control.planner import PlannerConfig
    from ggmoe.control.prefetch import Prefetcher
    from ggmoe.engine.pipeline import CachePipeline
    from ggmoe.engine.sequences import SeqEntry
    from ggmoe.inspect import ModelFacts

# Used when the GGUF carries no chat template: plain "Role: text" turns, which a base
# model trained on plain text (such as the embedded one) continues sensibly.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>"
    "{% endfor %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

MAX_SEQUENCES = 64  # n_seq_max at most (llama.cpp's LLAMA_MAX_SEQ is 256; more slots than this is a typo)

DEFAULT_CHAT_STOP = ("\nUser:", "\nSystem:")  # the next turn of the default template: stop before it


class _DefaultChatFormatter(llama_cpp.llama_chat_format.Jinja2ChatFormatter):
    """llama-cpp-python's sandboxed Jinja2 formatter on the default template, stopping at the next turn."""

    def __call__(self, **kwargs: Any) -> llama_cpp.llama_chat_format.ChatFormatterResponse:
        response = super().__call__(**kwargs)
        response.stop = [*response.stop, *DEFAULT_CHAT_STOP]
        return response


# llama-server's --chat-template names that llama-cpp-python holds as Jinja templates
NAMED_CHAT_TEMPLATES = {
    "chatml": llama_cpp.llama_chat_format.CHATML_CHAT_TEMPLATE,
    "llama3": llama_cpp.llama_chat_format.LLAMA3_INSTRUCT_CHAT_TEMPLATE,
    "mistral-v1": llama_cpp.llama_chat_format.MISTRAL_INSTRUCT_CHAT_TEMPLATE,
}


def chat_template_of(value: str) -> str:
    """``--chat-template``'s value as a Jinja template: a name llama-server knows and llama-cpp-python holds
    (chatml, llama3, mistral-v1), or the template itself."""
    if "{{" in value or "{%" in value:
        return value
    if value in NAMED_CHAT_TEMPLATES:
        return NAMED_CHAT_TEMPLATES[value]
    raise UsageError(f"chat template {value!r}: give a Jinja template, or one of {', '.join(NAMED_CHAT_TEMPLATES)}")


def check_chat_template(template: str) -> None:
    """A ``UsageError`` (one line) for a chat template Jinja cannot parse."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=[llama_cpp.llama_chat_format.Jinja2ChatFormatter.IgnoreGenerationTags,
                                                  "jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"the chat template does not parse (line {e.lineno}): {e.message}") from e


class GenerationWatch(Protocol):
    """Sees every generation of a ``GgmoeLlama`` (the server's timings, usage and cancellation)."""

    def on_prompt(self, n_prompt: int) -> None:
        """The prompt (tokens) about to be evaluated; raise to refuse it before any decode."""

    def on_token(self, token: int) -> bool:
        """A sampled token; return False to stop the generation before it is returned."""


class GgmoeLlama(llama_cpp.Llama):
    """A ``llama_cpp.Llama`` with the experts in host memory and, optionally, ggmoe's expert cache."""

    def __init__(self, model_path: str, *, run: RunConfig | None = None, experts_on_host: bool = True,
                 observers: Sequence[RouteObserver] = (), n_seq_max: int = 1, kv_unified: bool = True,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        from ggmoe.engine.llama_attach import HostExpertOverride, no_read_ahead, resolve_tiers
        from ggmoe.inspect import inspect_model

        if run is not None and not experts_on_host:
            raise UsageError("the expert cache needs the experts in host memory (experts_on_host=True)")
        if isinstance(n_seq_max, bool) or not isinstance(n_seq_max, int) or not 1 <= n_seq_max <= MAX_SEQUENCES:
            raise UsageError(f"n_seq_max {n_seq_max!r}: give 1 to {MAX_SEQUENCES} sequences")
        if chat_template is not None:
            chat_template = chat_template_of(chat_template)
            check_chat_template(chat_template)  # before the model loads
        self._chat_template = chat_template  # a Jinja chat template instead of the GGUF's
        self._n_seq_max = n_seq_max  # read by the context_params setter, before the context is made
        self._kv_unified = kv_unified
        self._ggmoe: CachePipeline | None = None  # the pipeline on the context, once the context exists
        facts = inspect_model(Path(model_path)) if run is not None or observers else None
        run, on_disk = resolve_tiers(run, facts) if facts is not None else (run, False)
        self._placement = HostExpertOverride(on_disk=on_disk) if experts_on_host else None
        self.watch: GenerationWatch | None = None
        if experts_on_host:
            # llama.cpp recommends no mmap for overridden tensors: they are copied anyway (on disk: the mapping
            # is where the experts stay)
            kwargs["use_mmap"] = on_disk if on_disk else kwargs.get("use_mmap", False)
        kwargs["n_ctx"] = context_tokens(kwargs.get("n_ctx", 512))  # Llama's buffers as llama.cpp's context
        with no_read_ahead(on_disk):
            super().__init__(model_path, **kwargs)
        self._placement = None  # llama.cpp has read the override list
        self.run_config = run
        if chat_template is not None or (not self.metadata.get("tokenizer.chat_template")
                                         and not kwargs.get("chat_format") and not kwargs.get("chat_handler")):
            self.chat_handler = self._default_chat_handler()
        try:
            if run is not None or observers:
                from ggmoe.engine.llama_attach import LlamaAttachment

                self._ggmoe = LlamaAttachment(self._model.model, self._ctx.ctx, facts,
                                              Path(model_path), run, observers, n_threads=self.context_params.n_threads,
                                              n_batch=self.n_batch, n_ubatch=self.context_params.n_ubatch)
        except BaseException:
            self.close()
            raise

    # -- the load-time seam: Llama.__init__ assigns self.model_params, then loads the model with it
    @property
    def model_params(self) -> llama_cpp.llama_model_params:
        return self.__dict__["_ggmoe_model_params"]

    @model_params.setter
    def model_params(self, params: llama_cpp.llama_model_params) -> None:
        placement = self.__dict__.get("_placement")
        if placement is not None:
            placement.apply(params)
        self.__dict__["_ggmoe_model_params"] = params

    # -- the context-time seam: Llama.__init__ assigns self.context_params, then fills it and makes the context
    @property
    def context_params(self) -> llama_cpp.llama_context_params:
        return self.__dict__["_ggmoe_context_params"]

    @context_params.setter
    def context_params(self, params: llama_cpp.llama_context_params) -> None:
        # Several sequences: in one unified KV cache (llama-server's --kv-unified; each slot's share of n_ctx
        # is enforced by the server), or each in its own stream of n_ctx / n_seq_max cells (padded to 256).
        params.n_seq_max = self.__dict__.get("_n_seq_max", 1)
        params.kv_unified = self.__dict__.get("_kv_unified", True)
        self.__dict__["_ggmoe_context_params"] = params

    def n_ctx_seq(self) -> int:
        """The tokens one sequence may hold in llama.cpp's KV cache (the whole context when unified)."""
        from ggmoe.engine.llama_attach import n_ctx_seq

        return n_ctx_seq(self._ctx.ctx)

    def decode_sequences(self, entries: Sequence[SeqEntry]) -> list[np.ndarray]:
        """One ``llama_decode`` of several sequences' tokens (``ggmoe.engine.sequences.SeqEntry``), the
        pipeline around it as around ``eval``'s; each entry's last logits row. On an error the caller
        forgets those sequences (their KV entries from this decode are meaningless)."""
        from ggmoe.engine.sequences import SeqBatch

        batch = self.__dict__.get("_ggmoe_seq_batch")
        if batch is None:
            batch = self.__dict__["_ggmoe_seq_batch"] = SeqBatch(self.n_batch, self._n_vocab)
        if self._ggmoe is None:
            return batch.decode(self._ctx.ctx, entries)
        with self._ggmoe.step([t for e in entries for t in e.tokens]):
            return batch.decode(self._ctx.ctx, entries)

    def _default_chat_handler(self) -> llama_cpp.llama_chat_format.LlamaChatCompletionHandler:
        return self.chat_formatter().to_chat_handler()

    def chat_formatter(self) -> llama_cpp.llama_chat_format.Jinja2ChatFormatter:
        """The formatter of this model's chat template (the one given at load, else the GGUF's, else ggmoe's
        plain default), built as ``Llama`` builds it for ``chat_template.default``; the server renders prompts
        (tools included) with it."""
        formatter = self.__dict__.get("_ggmoe_formatter")
        if formatter is None:
            eos, bos = self.token_eos(), self.token_bos()
            template = self.__dict__.get("_chat_template") or self.metadata.get("tokenizer.chat_template")
            kind = llama_cpp.llama_chat_format.Jinja2ChatFormatter if template else _DefaultChatFormatter
            formatter = kind(template=template or DEFAULT_CHAT_TEMPLATE,
                             eos_token=self._model.token_get_text(eos) if eos != -1 else "",
                             bos_token=self._model.token_get_text(bos) if bos != -1 else "",
                             stop_token_ids=[eos])
            self.__dict__["_ggmoe_formatter"] = formatter
        return formatter

    # -- decode: re-raise the route callback's error
    def eval(self, tokens: Sequence[int]) -> None:
        if self._ggmoe is None:
            super().eval(tokens)
            return
        # Batch by batch as Llama.eval does, so the prefetcher sees each llama_decode's tokens first; Llama.eval
        # reads the logits, so the device is done with each decode when the pipeline's step goes on.
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i : i + self.n_batch]
            with self._ggmoe.step(batch, on_error=self._forget):
                llama_cpp.Llama.eval(self, batch)

    def _forget(self) -> None:
        """A decode's stored error is about to be raised: its KV entries are meaningless, forget the sequence."""
        self.reset()
        self.n_tokens = 0

    def _raise_route_error(self) -> None:
        err = self._ggmoe.take_error() if self._ggmoe is not None else None
        if err is not None:
            self._forget()
            raise err

    # -- generate: one hook per sampled token (timings, usage, cancellation)
    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Any, None]:
        watch = self.watch
        if watch is not None:
            watch.on_prompt(len(tokens))
        n_ctx = min(self.n_ctx(), self.context_params.n_ctx)  # llama.cpp's context and Llama's buffers
        check_prompt(len(tokens), n_ctx, hint="a longer n_ctx or a shorter prompt")  # ggmoe.base.context
        inner = super().generate(tokens, *args, **kwargs)
        try:
            sent = None
            first = True
            while True:
                # The next token needs the last one evaluated: none fits once the context is full.
                # (``_create_completion`` checks max_tokens only after a complete UTF-8 character, so a
                # model emitting stray multi-byte starts would otherwise decode past the context.)
                if not first and self.n_tokens >= self._n_ctx:
                    return
                first = False
                token = inner.send(sent)
                if watch is not None and not watch.on_token(token):
                    return
                sent = yield token
        except StopIteration:
            return
        finally:
            inner.close()

    # -- ggmoe's additions
    def grammar_parses(self, grammar: str) -> bool:
        """Whether llama.cpp parses this GBNF grammar (a grammar that does not would crash the sampler)."""
        from ggmoe.engine.llama_attach import grammar_parses

        return grammar_parses(self._model.vocab, grammar)

    def embed_mean(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        """Mean-pooled, L2-normalised final hidden states of each text, and the tokens read.

        The generation context is switched to embeddings output for this call only; ``Llama.embed`` clears
        the KV cache and resets the sequence, so the next generation starts from an empty context.
        """
        for i, text in enumerate(texts):
            if not self.tokenize(text.encode("utf-8")):  # an empty batch fails in llama_decode and then
                raise UsageError(f"input {i} has no tokens")  # corrupts llama-cpp-python's batch
        from ggmoe.engine.llama_attach import set_embeddings

        set_embeddings(self._ctx.ctx, True)
        self.context_params.embeddings = True
        try:
            out, n = self.embed(list(texts), normalize=False, truncate=False, return_count=True)
        finally:
            set_embeddings(self._ctx.ctx, False)
            self.context_params.embeddings = False
        self._raise_route_error()
        pooled = []
        for e in out:
            v = np.asarray(e, dtype=np.float64)
            if v.ndim == 2:  # pooling NONE (a causal model): one vector per token
                v = v.mean(axis=0)
            norm = float(np.linalg.norm(v))
            pooled.append((v / norm if norm > 0 else v).tolist())
        return pooled, n

    def fim_tokens(self) -> dict[str, int]:
        """The fill-in-the-middle tokens (pre, suf, mid, pad, rep, sep); -1 where the model has none."""
        from ggmoe.engine.llama_attach import fim_tokens

        return fim_tokens(self._model.vocab)

    def add_bos_token(self) -> bool:
        """Whether the model's tokenizer puts a BOS token before a text prompt."""
        return bool(self._model.add_bos_token())

    def eog_tokens(self) -> list[int]:
        """Every token that ends a generation (what ``ignore_eos`` masks), found once and kept."""
        eog = self.__dict__.get("_ggmoe_eog")
        if eog is None:
            eog = self.__dict__["_ggmoe_eog"] = [t for t in range(self.n_vocab()) if self.is_eog(t)]
        return eog

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, EOT...), as ``_create_completion`` tests it."""
        from ggmoe.engine.llama_attach import is_eog

        return is_eog(self._model.vocab, token)

    def reconfigure(self, run: RunConfig) -> None:
        """Replace the expert cache between generations (MoEpic's reconfiguration: other slot counts and top
        shares for this model); the KV cache and the prompt cache stay, the new expert cache starts empty."""
        att = self._ggmoe
        if att is None or att.runtime is None:
            raise UsageError("reconfiguring needs a model loaded with a cache")
        run.check_model(att.facts)  # a configuration for another model fails before the old cache goes
        att.reconfigure(run)
        self.run_config = run

    def add_observer(self, obs: RouteObserver) -> None:
        """Give ``obs`` every MoE layer's routing from now on (needs a model loaded with a cache or observers)."""
        if self._ggmoe is None:
            raise UsageError("route observers need a model loaded with a cache (or observers at load)")
        self._ggmoe.observers.add(obs)

    def stats(self) -> dict[str, Any]:
        """Cache statistics since load: {"cache": None} without a cache, else policy, slots, totals, layers."""
        report = self._ggmoe.report() if self._ggmoe is not None else {}
        return {"cache": report or None}

    @property
    def prefetcher(self) -> Prefetcher | None:
        """The cache's prefetcher, or None."""
        return self._ggmoe.prefetcher if self._ggmoe is not None else None

    @property
    def attachment(self) -> CachePipeline | None:
        """The engine-side attachment (route callback, cache runtime), or None without a cache."""
        return self._ggmoe

    def close(self) -> None:
        """Free the context, the model and the cache now (idempotent)."""
        # One ExitStack, its steps registered last to first: each runs even when an earlier one raises.
        att, own = self.__dict__.get("_ggmoe"), self.__dict__.get("_stack")
        batch = self.__dict__.pop("_ggmoe_seq_batch", None)
        with contextlib.ExitStack() as stack:
            if att is not None:
                self._ggmoe = None
                stack.callback(att.close)  # 4: slot tensors after the context that computed with them
            if batch is not None:
                stack.callback(batch.close)  # 3: the multi-sequence batch
            if own is not None:
                stack.callback(own.close)  # 2: llama-cpp-python's own stack: the context, then the model
            if att is not None:
                stack.callback(att.detach)  # 1: the pipeline off the context before it goes

    def __enter__(self) -> GgmoeLlama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _planner_config(planner: str | None, train: Sequence[str]) -> PlannerConfig | None:
    """``load()``'s plan_predictor as a PlannerConfig (None without one)."""
    if planner is None:
        return None
    from ggmoe.control.planner import PlannerConfig, check_planner

    check_planner(planner)  # before the model loads
    return PlannerConfig(predictor=planner, train=tuple(train))


def _plan_file_cache(config: str | os.PathLike, facts: ModelFacts, decode_mode: str | None, plan_predictor: str | None,
                     predictor_train: Sequence[str]) -> RunConfig:
    """The run a plan file (``ggmoe plan``) sets, checked against the model; ``decode_mode`` and a planner
    still apply on top of it."""
    from ggmoe.control.plan_file import read_plan

    run = read_plan(config)
    run.check_model(facts)
    if decode_mode is not None:
        from ggmoe.cache.decode_mode import check_decode_mode

        run = dataclasses.replace(run, decode=dataclasses.replace(run.decode, mode=check_decode_mode(decode_mode)))
    if plan_predictor is not None:
        run = dataclasses.replace(run, planner=_planner_config(plan_predictor, predictor_train))
    return run


def _model_file(path: str | os.PathLike | None, model_path: str | os.PathLike | None) -> Path:
    """The model file ``load()`` was given as ``path`` or ``model_path``, or the embedded model; it must exist."""
    if model_path is not None:
        if path is not None:
            raise UsageError("give the model as path or as model_path, not both")
        path = model_path
    if path is None:
        from ggmoe.models import default_model_path

        path = default_model_path()
        if path is None:
            raise UsageError("no model path given and this install has no embedded default model")
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {p}")
    return p


def load(path: str | os.PathLike | None = None, *, model_path: str | os.PathLike | None = None,
         vram: int | str | None = None,
         cache_slots: int | None = None, policy: str | None = None, predictor: str | None = None,
         stride: int = 2, n_prefetch: int | None = None, prefetch_threshold: float | None = None,
         predictor_train: Sequence[str] = (), miss_policy: str | None = None, hw: str | None = None,
         decode_mode: str | None = None, run: RunConfig | None = None, config: str | os.PathLike | None = None,
         plan_predictor: str | None = None, host_ram: int | str | None = None, **llama_kwargs: Any) -> GgmoeLlama:
    """Load a GGUF MoE model as a ``llama_cpp.Llama`` with its experts in host RAM.

    ``path`` (or ``model_path``, ``llama_cpp.Llama``'s name for it) defaults to the embedded model. ``cache_slots`` (slots per MoE layer) or ``vram`` (bytes, or
    a size such as ``"4GiB"``) turn on the expert cache, with eviction ``policy`` (default lru, see
    ``ggmoe policies``), stride prefetching from ``predictor`` (``stride`` MoE layers ahead, ``n_prefetch``
    experts per layer, trained on ``predictor_train`` traces when it learns), ``miss_policy`` (wait, cpu,
    auto) and the ``hw`` profile as auto's cost model, ``decode_mode`` (auto, async: the expert table and no
    sync per MoE layer, sync: the route op per layer); or pass a ready ``run`` (a ``RunConfig``), or
    ``config``: a plan file from ``ggmoe plan`` (slots and, with ``--moepic``, MoEpic's top shares per layer;
    ``decode_mode`` still applies). ``plan_predictor`` (reuse, eam, expert-map, or a PRED.npz trained with
    ``--mode token``) plans the next token between tokens: its predicted experts are admitted first and not
    evicted (``ggmoe.control.planner``). ``host_ram`` (bytes or a size; default: what the machine can pin, less
    a margin): experts beyond it stay in the file and are read from disk into the host tier.
    Other keyword arguments go to ``llama_cpp.Llama`` (``n_ctx``, ``seed``, ``chat_format``...); ggmoe's
    defaults differ in two: ``verbose=False`` and ``n_gpu_layers=-1`` (every dense layer on the GPU).
    """
    from ggmoe.control.prefetch import build_prefetch_config
    from ggmoe.control.run_config import build_run_config
    from ggmoe.inspect import inspect_model

    p = _model_file(path, model_path)
    if "cache" in llama_kwargs:
        raise UsageError("load() takes a ready configuration as run=RunConfig(CacheConfig(...)), or the cache's "
                         "options (cache_slots=, vram=, ...)")
    facts = inspect_model(p)  # the bounded reader validates the file before llama.cpp sees it
    if config is not None:
        if run is not None or any(v is not None for v in (cache_slots, vram, policy, predictor, miss_policy, hw)):
            raise UsageError("config= (a plan file) sets the cache; give no other cache options with it")
        run = _plan_file_cache(config, facts, decode_mode, plan_predictor, predictor_train)
    elif run is None:
        prefetch = build_prefetch_config(predictor, stride, n_prefetch, prefetch_threshold,
                                         tuple(predictor_train) if predictor is not None or plan_predictor is None
                                         else ())
        run = build_run_config(cache_slots, vram, policy, facts, miss_policy, prefetch, hw, decode_mode,
                               _planner_config(plan_predictor, predictor_train), host_ram)
    elif any(v is not None for v in (cache_slots, vram, policy, predictor, miss_policy, hw, decode_mode,
                                     plan_predictor, host_ram)):
        raise UsageError("give the cache either as run=RunConfig(...) or as its options, not both")
    llama_kwargs.setdefault("verbose", False)
    llama_kwargs.setdefault("n_gpu_layers", -1)
    try:
        return GgmoeLlama(str(p), run=run, **llama_kwargs)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        raise ModelFileError(f"llama.cpp could not load {p}: {e}") from e
