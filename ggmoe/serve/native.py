"""llama-server's native completion routes: ``/completion`` (and ``/completions``) and ``/infill``.

The request is llama-server's (``NativeCompletionRequest``): a prompt as text, token ids, a mix of both or a
list of such prompts; ``n_predict``, the samplers llama-cpp-python has, ``grammar`` / ``json_schema``,
``n_probs``, ``return_tokens``, ``ignore_eos``, ``cache_prompt``. It runs through the same
``create_completion`` as the OpenAI routes; this module shapes the answer as llama-server does: ``content``,
``tokens``, ``stop_type`` (``eos``, ``word``, ``limit``) and ``stopping_word``, ``truncated``, ``timings``,
``completion_probabilities``, ``generation_settings``; a stream sends ``{"content", "tokens", "stop": false}``
objects and one final object with ``"stop": true`` and the rest (no ``[DONE]``).

``/infill`` builds a fill-in-the-middle prompt from the model's FIM tokens (the repo-level layout with
``<FIM_REP>`` / ``<FIM_SEP>`` when the model has them, else the context files before ``<FIM_PRE>``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import llama_cpp
import numpy as np

from ggmoe.serve import structured
from ggmoe.serve.errors import APIError, over_context
from ggmoe.serve.generation import Watch, grammar_of
from ggmoe.serve.logprobs import LogprobRecorder, TokenLogprob
from ggmoe.serve.schema import InfillRequest, NativeCompletionRequest

if TYPE_CHECKING:
    from ggmoe.engine.llama import GgmoeLlama

SEED_RANDOM = 4294967295  # the seed llama-server reports when none was given (LLAMA_DEFAULT_SEED)
SAMPLERS = ["penalties", "top_k", "typ_p", "top_p", "min_p", "temperature"]  # llama-cpp-python's chain


# -- prompts
def tokenize_text(llama: GgmoeLlama, text: str, bos: bool, param: str = "prompt") -> list[int]:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON
        raise APIError(400, f"{param} is not valid Unicode text (a lone surrogate at {e.start})", param=param,
                       code="invalid_value") from e
    return llama.tokenize(data, add_bos=bos, special=True)


def _one_prompt(prompt: str | list[Any], llama: GgmoeLlama, n_vocab: int) -> list[int]:
    """One prompt: text (with BOS when the model adds one) or ids and text mixed (BOS when text comes first)."""
    if isinstance(prompt, str):
        tokens = tokenize_text(llama, prompt, True)
    else:
        tokens = []
        for i, part in enumerate(prompt):
            if isinstance(part, list):
                raise APIError(400, "a prompt mixes token ids and strings, not lists", param="prompt",
                               code="invalid_value")
            if isinstance(part, str):
                tokens += tokenize_text(llama, part, i == 0)
            elif not 0 <= part < n_vocab:
                raise APIError(400, f"prompt token id {part} is outside the vocabulary [0, {n_vocab})",
                               param="prompt", code="invalid_value")
            else:
                tokens.append(part)
    if not tokens:
        raise APIError(400, "the prompt is empty and the model adds no BOS token", param="prompt",
                       code="invalid_value")
    return tokens


def prompt_tokens(prompt: str | list[Any], llama: GgmoeLlama, n_vocab: int) -> list[list[int]]:
    """llama-server's prompt forms: one prompt, or several (a list of lists, or of two or more strings)."""
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt is an empty list", param="prompt", code="invalid_value")
        several = any(isinstance(p, list) for p in prompt) or (
            len(prompt) > 1 and all(isinstance(p, str) for p in prompt))
        if several:
            if any(isinstance(p, int) for p in prompt):
                raise APIError(400, "several prompts are strings or lists; a bare token id belongs inside a list",
                               param="prompt", code="invalid_value")
            return [_one_prompt(p, llama, n_vocab) for p in prompt]
    return [_one_prompt(prompt, llama, n_vocab)]


def infill_tokens(body: InfillRequest, llama: GgmoeLlama, n_ctx: int) -> list[int]:
    """The FIM prompt of an ``/infill`` request, cut to leave room for the answer (400 without FIM tokens)."""
    fim = llama.fim_tokens()
    if fim["pre"] < 0 or fim["suf"] < 0 or fim["mid"] < 0:
        raise APIError(400, "this model has no fill-in-the-middle tokens (FIM_PRE, FIM_SUF, FIM_MID): /infill "
                            "needs a code model trained for infilling", param="input_prefix",
                       code="unsupported_value")
    prefix = tokenize_text(llama, body.input_prefix, False, "input_prefix")
    suffix = tokenize_text(llama, body.input_suffix, False, "input_suffix")
    middle = tokenize_text(llama, body.prompt, False)
    extra: list[int] = []
    if fim["rep"] >= 0 and fim["sep"] >= 0:
        extra = [fim["rep"], *tokenize_text(llama, "myproject\n", False)]
        for chunk in body.input_extra:
            extra += [fim["sep"], *tokenize_text(llama, f"{chunk.filename}\n{chunk.text}", False, "input_extra")]
        extra += [fim["sep"], *tokenize_text(llama, "filename\n", False)]
    else:
        for chunk in body.input_extra:
            extra += tokenize_text(llama, f"{chunk.filename}\n{chunk.text}", False, "input_extra")
    reserve = body.n_predict if body.n_predict > 0 else min(n_ctx // 4, 256)
    avail = max(0, n_ctx - reserve - len(middle) - 4)
    suffix = suffix[:min(len(suffix), avail // 4)]
    prefix = prefix[max(0, len(prefix) - (avail - len(suffix))):]
    room = avail - len(suffix) - len(prefix)
    extra = extra[max(0, len(extra) - room):] if room > 0 else []
    bos = [llama.token_bos()] if llama.add_bos_token() and llama.token_bos() >= 0 else []
    return [*bos, *extra, fim["pre"], *prefix, fim["suf"], *suffix, fim["mid"], *middle]


# -- sampling
def sampling_kwargs(body: NativeCompletionRequest, llama: GgmoeLlama) -> dict[str, Any]:
    """``create_completion`` keyword arguments of a native request (max_tokens is set per prompt)."""
    kw: dict[str, Any] = {
        "temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p,
        "typical_p": body.typical_p, "repeat_penalty": body.repeat_penalty,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "mirostat_mode": body.mirostat, "mirostat_tau": body.mirostat_tau, "mirostat_eta": body.mirostat_eta,
        "stop": list(body.stop)}
    if body.grammar is not None:
        kw["grammar"] = grammar_of(llama, body.grammar, "grammar")
    elif body.json_schema is not None:
        text = structured.schema_grammar(body.json_schema, False, "json_schema", refuse=True)
        kw["grammar"] = grammar_of(llama, text, "json_schema")
    return kw


def _bias(body: NativeCompletionRequest, llama: GgmoeLlama, n_vocab: int) -> dict[int, float]:
    """``logit_bias`` as llama-server takes it: [[id or text, bias or false], ...] or {"id or text": bias}."""
    pairs = body.logit_bias.items() if isinstance(body.logit_bias, dict) else body.logit_bias or []
    out: dict[int, float] = {}
    for key, value in pairs:
        bias = float("-inf") if value is False else float(value)
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        ids = [key] if isinstance(key, int) else tokenize_text(llama, key, False, "logit_bias")
        for t in ids:
            if not 0 <= t < n_vocab:
                raise APIError(400, f"logit_bias token id {t} is outside the vocabulary [0, {n_vocab})",
                               param="logit_bias", code="invalid_value")
            out[t] = bias
    return out


def processors(body: NativeCompletionRequest, llama: GgmoeLlama, n_vocab: int,
               eog: list[int]) -> list[llama_cpp.LogitsProcessor]:
    """Logits processors: the bias, and ``ignore_eos`` as llama-server does it (end tokens never sampled)."""
    bias = _bias(body, llama, n_vocab)
    if body.ignore_eos:
        bias.update({t: float("-inf") for t in eog})
    if not bias:
        return []
    ids = np.fromiter(bias.keys(), dtype=np.intc, count=len(bias))
    vals = np.fromiter(bias.values(), dtype=np.single, count=len(bias))

    def apply(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[ids] += vals
        return scores

    return [apply]


# -- running
def pick_fields(out: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: only the named fields; ``a/b`` is b of a, keyed ``a/b``; missing
    fields are left out."""
    picked: dict[str, Any] = {}
    for name in fields:
        value: Any = out
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[name] = value
    return picked


T = TypeVar("T")  # what _cover counts


def _cover(items: list[T], start: int, n_bytes: int, size: Callable[[T], int]) -> tuple[list[T], int]:
    """The items from ``start`` whose pieces fit in ``n_bytes`` bytes of text, and the next index."""
    out = []
    i = start
    while i < len(items) and size(items[i]) <= n_bytes:
        n_bytes -= size(items[i])
        out.append(items[i])
        i += 1
    return out, i


def _prob(e: TokenLogprob) -> dict[str, Any]:
    text = e.text.decode("utf-8", "replace")
    return {"id": e.token, "token": text, "logprob": e.logprob, "bytes": list(e.text),
            "top_logprobs": [{"id": t, "token": p.decode("utf-8", "replace"), "logprob": lp, "bytes": list(p)}
                             for t, p, lp in e.top]}


@dataclass
class _Gen:
    """One prompt's generation: what was sampled and when."""

    tokens: list[int]  # the prompt
    cached: int = 0  # prompt tokens reused from the KV cache
    max_tokens: int = 0
    sampled: list[tuple[int, bytes]] = field(default_factory=list)  # (token, piece), end tokens excluded
    last: int | None = None  # the last sampled token (an end token included)
    t0: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    recorder: LogprobRecorder | None = None
    limited: bool = False  # n_indent or t_max_predict_ms stopped it

    def text(self) -> str:
        return b"".join(p for _, p in self.sampled).decode("utf-8", "replace")


def _timings(g: _Gen) -> dict[str, Any]:
    """llama-server's ``timings`` of a generation so far: the prompt's and the predicted tokens'."""
    n_pred = len(g.sampled)
    prompt_ms = ((g.t_first or time.monotonic()) - g.t0) * 1e3
    pred_ms = ((g.t_last or 0.0) - (g.t_first or 0.0)) * 1e3
    n_eval = len(g.tokens) - g.cached
    return {"cache_n": g.cached, "prompt_n": n_eval, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(n_eval, 1),
            "prompt_per_second": 1e3 * n_eval / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": n_pred, "predicted_ms": pred_ms, "predicted_per_token_ms": pred_ms / max(n_pred, 1),
            "predicted_per_second": 1e3 * n_pred / pred_ms if pred_ms > 0 else 0.0}


class NativeRun:
    """A native request on the model: ``result()`` or ``chunks()`` (llama-server's shapes)."""

    def __init__(self, body: NativeCompletionRequest, prompts: list[list[int]], llama: GgmoeLlama, watch: Watch,
                 model_id: str, n_ctx: int, procs: list[llama_cpp.LogitsProcessor]) -> None:
        self.body = body
        self.prompts = prompts
        self.llama = llama
        self.watch = watch
        self.model_id = model_id
        self.n_ctx = n_ctx
        self.procs = procs
        self.id_slot = 0  # the slot the server runs it on (set with llama before it runs)
        self.kwargs = sampling_kwargs(body, llama)
        for tokens in prompts:
            if len(tokens) >= n_ctx:
                raise over_context(len(tokens), n_ctx, "prompt")

    def settings(self) -> dict[str, Any]:
        b = self.body
        return {"n_ctx": self.n_ctx, "n_predict": b.n_predict, "model": self.model_id,
                "seed": SEED_RANDOM if b.seed < 0 else b.seed, "temperature": b.temperature, "top_k": b.top_k,
                "top_p": b.top_p, "min_p": b.min_p, "typical_p": b.typical_p, "repeat_penalty": b.repeat_penalty,
                "presence_penalty": b.presence_penalty, "frequency_penalty": b.frequency_penalty,
                "mirostat": b.mirostat, "mirostat_tau": b.mirostat_tau, "mirostat_eta": b.mirostat_eta,
                "stop": list(b.stop), "max_tokens": b.n_predict, "n_probs": b.n_probs, "ignore_eos": b.ignore_eos,
                "stream": b.stream, "grammar": b.grammar or "", "samplers": SAMPLERS, "cache_prompt": b.cache_prompt,
                "n_indent": b.n_indent, "t_max_predict_ms": b.t_max_predict_ms}

    def _begin(self, tokens: list[int]) -> _Gen:
        llama = self.llama
        if not self.body.cache_prompt:
            llama.reset()
        g = _Gen(tokens)
        common = 0
        for a, b in zip(llama._input_ids.tolist(), tokens, strict=False):
            if a != b:
                break
            common += 1
        g.cached = min(common, len(tokens) - 1)
        room = self.n_ctx - len(tokens)
        g.max_tokens = room if self.body.n_predict < 0 else min(self.body.n_predict, room)
        self.watch.max_tokens = g.max_tokens
        if self.body.n_probs > 0:
            g.recorder = LogprobRecorder(self.body.n_probs, lambda t: llama.detokenize([t]), llama.is_eog)

        def on_token(token: int) -> None:
            g.t_first = g.t_first or time.monotonic()
            g.t_last = time.monotonic()
            g.last = token
            if not llama.is_eog(token):
                g.sampled.append((token, llama.detokenize([token])))
            if g.recorder is not None:
                g.recorder.on_token(token)

        self.watch.on_each = on_token
        g.t0 = time.monotonic()
        return g

    def _call(self, g: _Gen, stream: bool) -> Any:
        """``create_completion`` for ``g`` (None for n_predict 0: the prompt is only evaluated)."""
        if g.max_tokens == 0:
            self.llama.n_tokens = g.cached
            self.llama.eval(g.tokens[g.cached:])
            return None
        procs = ([g.recorder] if g.recorder is not None else []) + self.procs
        seed = None if self.body.seed < 0 else self.body.seed % (1 << 32)
        kw = dict(self.kwargs)
        if self.body.n_indent > 0 or self.body.t_max_predict_ms > 0:
            kw["stopping_criteria"] = llama_cpp.StoppingCriteriaList([lambda ids, logits: self._limit(g)])
        return self.llama.create_completion(
            prompt=g.tokens, max_tokens=g.max_tokens, stream=stream, seed=seed, model=self.model_id,
            logits_processor=llama_cpp.LogitsProcessorList(procs) if procs else None, **kw)

    def _limit(self, g: _Gen) -> bool:
        """llama-server's code-completion limits: ``t_max_predict_ms`` once a new line was generated, and
        ``n_indent``: a new line indented less than that ends the generation (the line is cut off)."""
        text = g.text()
        nl = text.rfind("\n")
        if nl < 0:
            return False
        b = self.body
        if b.t_max_predict_ms > 0 and g.t_first is not None and \
                (time.monotonic() - g.t_first) * 1e3 > b.t_max_predict_ms:
            g.limited = True
        line = text[nl + 1:]
        body = line.lstrip(" \t")
        if b.n_indent > 0 and body and len(line) - len(body) < b.n_indent:
            g.limited = True
        return g.limited

    def _stop_of(self, g: _Gen, content: str, finish: str | None) -> tuple[str, str, bool]:
        """stop_type, stopping_word and truncated, as llama-server reports them."""
        if finish == "length" or g.max_tokens == 0 or g.limited:
            full = len(g.tokens) + len(g.sampled) >= self.n_ctx
            return "limit", "", full
        if g.last is not None and self.llama.is_eog(g.last):
            return "eos", "", False
        rest = b"".join(p for _, p in g.sampled).decode("utf-8", "replace")[len(content):]
        return "word", next((s for s in self.body.stop if rest.startswith(s)), ""), False

    def _final(self, k: int, g: _Gen, content: str, finish: str | None, stream: bool) -> dict[str, Any]:
        stop_type, word, truncated = self._stop_of(g, content, finish)
        if g.limited and self.body.n_indent > 0 and not stream:
            content = content[:content.rfind("\n") + 1]  # the line indented too little is cut off
        n_bytes = len(content.encode("utf-8"))
        covered, _ = _cover(g.sampled, 0, n_bytes, lambda s: len(s[1]))
        n_pred = len(g.sampled)
        out = {"index": k, "content": "" if stream else content,
               "tokens": [t for t, _ in covered] if self.body.return_tokens and not stream else [],
               "id_slot": self.id_slot, "stop": True, "model": self.model_id, "tokens_predicted": n_pred,
               "tokens_evaluated": len(g.tokens), "generation_settings": self.settings(),
               "prompt": self.llama.detokenize(g.tokens, special=True).decode("utf-8", "replace"),
               "has_new_line": "\n" in content, "truncated": truncated, "stop_type": stop_type,
               "stopping_word": word, "tokens_cached": g.cached,
               "timings": _timings(g)}
        if g.recorder is not None and not stream:
            out["completion_probabilities"] = [_prob(e) for e in g.recorder.covering(0, n_bytes)[0]]
        return pick_fields(out, self.body.response_fields) if self.body.response_fields else out

    def result(self) -> dict[str, Any] | list[dict[str, Any]]:
        results = []
        for k, tokens in enumerate(self.prompts):
            g = self._begin(tokens)
            out = self._call(g, stream=False)
            c = out["choices"][0] if out is not None else {"text": "", "finish_reason": "length"}
            results.append(self._final(k, g, c["text"], c["finish_reason"], stream=False))
        return results[0] if len(results) == 1 else results

    def chunks(self) -> Iterator[dict[str, Any]]:
        for k, tokens in enumerate(self.prompts):
            yield from self._prompt_chunks(k, tokens)

    def _prompt_chunks(self, k: int, tokens: list[int]) -> Iterator[dict[str, Any]]:
        g = self._begin(tokens)
        stream = self._call(g, stream=True)
        text = ""
        finish = "length"
        sent_tokens = sent_probs = 0  # g.sampled / recorder entries sent
        spare_t = spare_p = 0  # bytes sent whose tokens (probabilities) have not gone out yet
        for chunk in stream or ():
            c = chunk["choices"][0]
            finish = c["finish_reason"] or finish
            piece = c["text"]
            if not piece:
                continue
            text += piece
            n = len(piece.encode("utf-8"))
            toks, sent_tokens = _cover(g.sampled, sent_tokens, spare_t + n, lambda s: len(s[1]))
            spare_t += n - sum(len(p) for _, p in toks)
            out = {"index": k, "content": piece, "tokens": [t for t, _ in toks], "stop": False, "id_slot": self.id_slot,
                   "tokens_predicted": len(g.sampled), "tokens_evaluated": len(tokens)}
            if g.recorder is not None:
                entries, sent_probs = g.recorder.covering(sent_probs, spare_p + n)
                spare_p += n - sum(len(e.text) for e in entries)
                out["completion_probabilities"] = [_prob(e) for e in entries]
            if self.body.timings_per_token:
                out["timings"] = _timings(g)
            if self.body.return_progress and len(text) == len(piece):  # the first chunk: the prompt is in
                out["prompt_progress"] = {"total": len(tokens), "cache": g.cached, "processed": len(tokens),
                                          "time_ms": ((g.t_first or time.monotonic()) - g.t0) * 1e3}
            yield out
        yield self._final(k, g, text, finish, stream=True)
