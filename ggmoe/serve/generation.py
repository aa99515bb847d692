"""One request on the model: checks, the prompt, llama-cpp-python's ``create_completion``, OpenAI's shapes.

``check_request`` refuses what the model cannot do before the request queues. ``prepare_chat`` /
``prepare_completion`` turn a body into a ``ReadyRequest``: the prompt's tokens (a chat rendered through the model's
own template by llama-cpp-python's sandboxed Jinja2 formatter, tools included), ``max_tokens`` clamped to
the context (llama-server's behaviour) unless strict, the grammar (GBNF, a JSON schema, a forced tool call)
and the ``create_completion`` keyword arguments. ``Run`` executes a ready request, streaming or not, ``n`` times,
and shapes the answer: logprobs from a ``LogprobRecorder``, tool calls parsed back out of the text,
``finish_reason`` ``tool_calls``, a first chunk with ``content: null`` (as llama-server sends it). ``Watch`` is the
``GenerationWatch`` of one request: timestamps tokens (TTFT, TPOT), counts them for the usage of a stream
and stops the generation when the client has gone.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import llama_cpp
import numpy as np

from ggmoe.base.errors import ContextLengthError, GgmoeError
from ggmoe.serve import structured
from ggmoe.serve.errors import APIError, domain_error, log, over_context
from ggmoe.serve.logprobs import LogprobRecorder, TokenLogprob, chat_logprobs, completion_logprobs, plain
from ggmoe.serve.schema import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from ggmoe.engine.llama import GgmoeLlama

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@functools.cache
def fingerprint() -> str:
    """``system_fingerprint``: the build that answers, as llama-server names its own: ggmoe's version,
    llama-cpp-python's and the installed engine build's key (``ggmoe engine status``)."""
    from ggmoe.base.engine_build import KEY_FILE
    from ggmoe.base.version import __version__

    key_file = Path(llama_cpp.__file__).with_name(KEY_FILE)
    key = key_file.read_text().strip()[:12] if key_file.is_file() else "unpatched"
    return f"ggmoe-{__version__}-llama-cpp-python-{llama_cpp.__version__}-{key}"


def context_error(message: str, param: str = "messages") -> APIError:
    """A prompt that does not fit the context: ``ggmoe.base.context``'s ``ContextLengthError``, as its 400."""
    return domain_error(ContextLengthError(message), param)


def max_tokens_of(body: CompletionRequest | ChatRequest) -> int | None:
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def check_request(body: CompletionRequest | ChatRequest, n_ctx: int, n_vocab: int, strict: bool) -> None:
    """What a request asks that the model cannot give (400), before it waits for the model."""
    mt = max_tokens_of(body)
    if strict and mt is not None and mt >= n_ctx:
        raise APIError(400, f"max_tokens = {mt} does not fit the model's context of {n_ctx} tokens "
                            "(prompt included)", param="max_tokens", code="context_length_exceeded")
    if isinstance(body, CompletionRequest):
        _check_prompt(body.prompt, n_vocab)
        if body.stream and body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported when streaming", param="echo",
                           code="unsupported_value")
    if body.logit_bias and body.logit_bias_type != "tokens":
        for key, value in body.logit_bias.items():
            if not key.isdigit() or not 0 <= int(key) < n_vocab:
                raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {n_vocab})",
                               param="logit_bias", code="invalid_value")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise APIError(400, f"logit_bias values must lie in [-100, 100] (token {key}: {value})",
                               param="logit_bias", code="invalid_value")
    if isinstance(body, ChatRequest) and body.grammar is not None and (
            body.response_format is not None and body.response_format.type != "text"):
        raise APIError(400, "give either grammar or response_format, not both", param="grammar",
                       code="invalid_value")


def _check_prompt(prompt: str | list[str] | list[int], n_vocab: int) -> None:
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt is an empty list", param="prompt", code="invalid_value")
        if isinstance(prompt[0], str) and len(prompt) > 1:
            raise APIError(400, "one prompt per request (a list of several prompts is not supported)",
                           param="prompt", code="unsupported_value")
        bad = [t for t in prompt if isinstance(t, int) and not 0 <= t < n_vocab]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {n_vocab})",
                           param="prompt", code="invalid_value")


class Watch:
    """The ``GenerationWatch`` of one request (used by one thread at a time)."""

    def __init__(self, arrival: float, n_ctx: int, max_tokens: int | None, is_eog: Callable[[int], bool]) -> None:
        self.arrival = arrival  # time.monotonic() when the request arrived
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        self.is_eog = is_eog
        self.cancel = threading.Event()  # set when the client has gone
        self.n_prompt = 0  # tokens
        self.n_tokens = 0  # generated tokens, end-of-generation tokens not counted (as in usage)
        self.n_run = 0  # the same, in the current generation (one choice of n)
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.on_each: Callable[[int], None] | None = None  # also told every sampled token (logprobs)
        self.last: int | None = None  # the last sampled token (an end token included)
        self.sampled: list[int] = []  # every sampled token (which stop sequence ended a generation)

    def on_prompt(self, n_prompt: int) -> None:
        self.n_prompt = n_prompt
        self.n_run = 0
        if self.max_tokens is not None and n_prompt + self.max_tokens > self.n_ctx:
            raise context_error(f"the prompt ({n_prompt} tokens) plus max_tokens ({self.max_tokens}) exceeds "
                                f"the model's context of {self.n_ctx} tokens")

    def on_token(self, token: int) -> bool:
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.last = token
        self.sampled.append(token)
        if not self.is_eog(token):
            if self.max_tokens is not None and self.n_run >= self.max_tokens:
                return False  # llama-cpp-python can overrun max_tokens while it completes a UTF-8 character
            self.n_tokens += 1
            self.n_run += 1
        if self.on_each is not None:
            self.on_each(token)
        return not self.cancel.is_set()

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per token after the first (None below two tokens)."""
        if self.t_first is None or self.n_tokens < 2:
            return None
        return (self.t_last - self.t_first) / (self.n_tokens - 1)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_tokens,
                "total_tokens": self.n_prompt + self.n_tokens}


# -- ready requests
@dataclass
class ReadyRequest:
    """One request made ready for ``create_completion``."""

    chat: bool
    prompt: list[int]  # tokens
    kwargs: dict[str, Any]  # create_completion keyword arguments but prompt, stream and logits_processor
    processors: list[llama_cpp.LogitsProcessor]  # logits processors after the logprob recorder
    n: int = 1
    seed: int | None = None
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token
    echo_logprobs: bool = False  # completions with echo: llama-cpp-python's logprobs (needs logits_all)
    echo: str | None = None  # completions: the prompt text put before the answer (echo without logprobs)
    prompt_text: str | None = None  # given to llama-cpp-python instead of the tokens (its echo with logprobs)
    family: str | None = None  # tool-call format, when tools may be called
    tool_names: set[str] = field(default_factory=set)
    forced_tool: bool = False  # a grammar forces a call
    parallel_tools: bool = False  # parallel_tool_calls: true (llama-server's default: false)
    # a forced call of one tool: its fixed start, given after the prompt, and its end, added once the grammar
    # (the arguments) is complete; the answer's text is parsed with them
    call: tuple[str, str] = ("", "")


    def called(self, text: str, finish: str | None) -> str:
        """The generated ``text`` with a forced call's start and, when the grammar completed (``stop``), its end."""
        return self.call[0] + text + (self.call[1] if finish == "stop" else "")


def _sampling(body: CompletionRequest | ChatRequest) -> dict[str, Any]:
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    return {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
            "stop": stop, "presence_penalty": body.presence_penalty or 0.0,
            "frequency_penalty": body.frequency_penalty or 0.0, "repeat_penalty": body.repeat_penalty,
            "mirostat_mode": body.mirostat_mode, "mirostat_tau": body.mirostat_tau,
            "mirostat_eta": body.mirostat_eta}


def _fit(prompt_ids: list[int], body: CompletionRequest | ChatRequest, n_ctx: int, strict: bool) -> int:
    """max_tokens for this prompt: clamped to what the context leaves (finish_reason "length"), or 400 when
    strict; a prompt that leaves no room is 400 either way."""
    n = len(prompt_ids)
    if n >= n_ctx:
        raise over_context(n, n_ctx, "prompt" if isinstance(body, CompletionRequest) else "messages", strict)
    mt = max_tokens_of(body)
    if mt is None:
        return n_ctx - n
    if n + mt > n_ctx:
        if strict:
            raise context_error(f"the prompt ({n} tokens) plus max_tokens ({mt}) exceeds the model's context "
                                f"of {n_ctx} tokens")
        return n_ctx - n
    return mt


def _processors(body: CompletionRequest | ChatRequest, llama: GgmoeLlama) -> list[llama_cpp.LogitsProcessor]:
    out: list[llama_cpp.LogitsProcessor] = []
    if body.logit_bias:
        bias = _logit_bias(body, llama)
        ids = np.fromiter(bias.keys(), dtype=np.intc, count=len(bias))
        vals = np.fromiter(bias.values(), dtype=np.single, count=len(bias))

        def apply(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
            scores[ids] += vals
            return scores

        out.append(apply)
    if body.min_tokens > 0:
        out.append(llama_cpp.MinTokensLogitsProcessor(body.min_tokens, llama.token_eos()))
    return out


def grammar_of(llama: GgmoeLlama, text: str, param: str) -> llama_cpp.LlamaGrammar:
    if not llama.grammar_parses(text):
        raise APIError(400, f"{param}: llama.cpp could not parse this GBNF grammar (it needs a 'root' rule)",
                       param=param, code="invalid_value")
    try:
        return llama_cpp.LlamaGrammar.from_string(text, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from e


def prepare_completion(body: CompletionRequest, llama: GgmoeLlama, n_ctx: int, strict: bool) -> ReadyRequest:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    tokens = (list(prompt) if isinstance(prompt, list)
              else llama.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))
    if not tokens:
        raise APIError(400, "the prompt is empty and the model adds no BOS token", param="prompt",
                       code="invalid_value")
    kw = _sampling(body)
    kw["max_tokens"] = _fit(tokens, body, n_ctx, strict)
    if body.suffix is not None:
        kw["suffix"] = body.suffix
    if body.grammar is not None:
        kw["grammar"] = grammar_of(llama, body.grammar, "grammar")
    echo_lp = body.echo and body.logprobs is not None
    echo = None
    if echo_lp:
        # The prompt's logprobs are llama-cpp-python's (every position's logits: --logprobs); its echo
        # concatenates the prompt as given to the text, so it must be given as text.
        if not isinstance(prompt, str):
            raise APIError(400, "echo with logprobs needs the prompt as text, not token ids", param="echo",
                           code="unsupported_value")
        if not _keeps_all_logits(llama):
            raise APIError(400, "logprobs with echo (the prompt's logprobs) need the server started with "
                                "--logprobs (it keeps every position's logits)", param="logprobs",
                           code="unsupported_value")
        kw.update(echo=True, logprobs=body.logprobs)
    elif body.echo:
        echo = prompt if isinstance(prompt, str) else llama.detokenize(tokens).decode("utf-8", "replace")
    return ReadyRequest(chat=False, prompt=tokens, kwargs=kw, processors=_processors(body, llama), n=body.n or 1,
                seed=body.seed, top_logprobs=None if echo_lp else body.logprobs, echo_logprobs=echo_lp,
                echo=echo, prompt_text=prompt if echo_lp else None)


def _keeps_all_logits(llama: GgmoeLlama) -> bool:
    """Whether ``llama`` keeps every position's logits: the flag llama-cpp-python itself checks (and raises a
    ``ValueError`` on) before a completion with logprobs; it keeps it as ``_logits_all``."""
    return bool(getattr(llama, "_logits_all", False))


def prepare_chat(body: ChatRequest, llama: GgmoeLlama, n_ctx: int, strict: bool) -> ReadyRequest:
    formatter = llama.chat_formatter()
    template = getattr(formatter, "template", None)
    messages = [m.for_template() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    use_tools = bool(tools) and choice != "none"
    family = structured.family_of(template) if use_tools else None
    render_kw: dict[str, Any] = {}
    if use_tools:
        if structured.template_renders_tools(template):
            render_kw["tools"] = tools
            render_kw["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        else:
            text = structured.tools_system_text(tools)
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
            else:
                messages.insert(0, {"role": "system", "content": text})
    result = formatter(messages=messages, **render_kw, **(body.chat_template_kwargs or {}))
    tokens = llama.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
    kw = _sampling(body)
    rstop = result.stop if isinstance(result.stop, list) else [result.stop] if result.stop else []
    kw["stop"] = kw["stop"] + [s for s in rstop if s]
    if result.stopping_criteria is not None:
        kw["stopping_criteria"] = result.stopping_criteria
    forced = use_tools and (choice == "required" or not isinstance(choice, str))
    parallel = bool(body.parallel_tool_calls)
    prefix = suffix = ""
    if forced:
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice.function.name]
        grammar = structured.tool_grammar(family, chosen, parallel)
        if len(chosen) == 1 and not parallel:  # the call's fixed start goes in as prompt, sampled: the arguments
            prefix, grammar, suffix = structured.forced_call(family, chosen[0])
            tokens = tokens + llama.tokenize(prefix.encode("utf-8"), add_bos=False, special=True)
        kw["grammar"] = grammar_of(llama, grammar, "tools")
    else:
        _output_grammar(body, llama, kw)
    kw["max_tokens"] = _fit(tokens, body, n_ctx, strict)
    top = (body.top_logprobs or 0) if body.logprobs else None
    return ReadyRequest(chat=True, prompt=tokens, kwargs=kw, processors=_processors(body, llama), n=body.n or 1,
                seed=body.seed, top_logprobs=top, family=family,
                tool_names={t["function"]["name"] for t in tools} if use_tools else set(), forced_tool=forced,
                parallel_tools=parallel, call=(prefix, suffix))


def _output_grammar(body: ChatRequest, llama: GgmoeLlama, kw: dict[str, Any]) -> None:
    """``response_format``'s grammar (a JSON schema, any JSON object) or the request's own, into ``kw``."""
    if body.response_format is not None and body.response_format.type != "text":
        rf = body.response_format
        if rf.type == "json_schema":
            text = structured.schema_grammar(rf.json_schema.schema_, rf.json_schema.strict)
        elif rf.schema_ is not None:
            text = structured.schema_grammar(rf.schema_, False, refuse=True)
        else:
            text = structured.json_object_grammar()
        kw["grammar"] = grammar_of(llama, text, "response_format")
    elif body.grammar is not None:
        kw["grammar"] = grammar_of(llama, body.grammar, "grammar")


def _logit_bias(body: CompletionRequest | ChatRequest, llama: GgmoeLlama) -> dict[int, float]:
    if body.logit_bias_type != "tokens":
        return {int(k): float(v) for k, v in body.logit_bias.items()}
    out: dict[int, float] = {}
    for text, value in body.logit_bias.items():  # keys are token texts
        for tok in llama.tokenize(text.encode("utf-8"), add_bos=False, special=True):
            out[tok] = float(value)
    return out


# -- running a ready request
class Run:
    """A ready request on the model: ``result()`` (one response) or ``chunks()`` (the stream's chunk objects)."""

    def __init__(self, ready: ReadyRequest, llama: GgmoeLlama, watch: Watch, model_id: str) -> None:
        self.ready = ready
        self.llama = llama
        self.watch = watch
        self.model_id = model_id
        self.id = ("chatcmpl-" if ready.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if ready.chat else "text_completion"
        self.recorder: LogprobRecorder | None = None

    id_slot: int  # the slot the server runs it on (set with llama before it runs; not read here)

    def _piece(self, token: int) -> bytes:
        return self.llama.detokenize([token])

    def _call(self, i: int, stream: bool) -> Any:
        p = self.ready
        procs = list(p.processors)
        self.recorder = None
        if p.top_logprobs is not None:
            self.recorder = LogprobRecorder(p.top_logprobs, self._piece, self.llama.is_eog)
            procs.insert(0, self.recorder)
        self.watch.on_each = self.recorder.on_token if self.recorder is not None else None
        seed = None if p.seed is None else (p.seed + i) % (1 << 32)
        kw = dict(p.kwargs)
        return self.llama.create_completion(prompt=p.prompt_text if p.prompt_text is not None else p.prompt,
                                            stream=stream, seed=seed,
                                            logits_processor=llama_cpp.LogitsProcessorList(procs) if procs else None,
                                            model=self.model_id, **kw)

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_id}

    # -- one response
    def result(self) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        prompt_tokens = len(self.ready.prompt)
        for i in range(self.ready.n):
            out = self._call(i, stream=False)
            c = out["choices"][0]
            completion_tokens += out["usage"]["completion_tokens"]
            prompt_tokens = out["usage"]["prompt_tokens"]
            choices.append(self._chat_choice(i, c) if self.ready.chat else self._completion_choice(i, c))
        return {**self._head(), "choices": choices, "system_fingerprint": fingerprint(),
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _entries(self, text: str) -> list[TokenLogprob]:
        if self.recorder is None:
            return []
        return self.recorder.covering(0, len(text.encode("utf-8")))[0]

    def _chat_choice(self, i: int, c: dict[str, Any]) -> dict[str, Any]:
        text = c["text"]
        finish = c["finish_reason"]
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.ready.family is not None:
            parsed = structured.parse_tool_calls(self.ready.family, self.ready.called(text, finish),
                                                 self.ready.tool_names, self.ready.parallel_tools)
            message["content"] = parsed.content  # the markup (a partial tag included) never reaches it
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
                finish = "tool_calls"
        lp = chat_logprobs(self._entries(text)) if self.recorder is not None else None
        return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}

    def _completion_choice(self, i: int, c: dict[str, Any]) -> dict[str, Any]:
        if self.ready.echo_logprobs:
            lp = _trim_top(plain(c["logprobs"]), self.ready.kwargs.get("logprobs") or 0)
        elif self.recorder is not None:
            lp = completion_logprobs(self._entries(c["text"]), 0)
        else:
            lp = None
        return {"index": i, "text": (self.ready.echo or "") + c["text"], "logprobs": lp,
                "finish_reason": c["finish_reason"]}

    # -- a stream
    def chunks(self) -> Iterator[dict[str, Any]]:
        for i in range(self.ready.n):
            yield from (self._chat_chunks(i) if self.ready.chat else self._completion_chunks(i))

    def _completion_chunks(self, i: int) -> Iterator[dict[str, Any]]:
        sent = 0  # bytes of text sent
        covered = 0  # bytes of the recorder entries whose logprobs went out
        used = 0  # recorder entries sent
        echo = self.ready.echo
        for chunk in self._call(i, stream=True):
            c = chunk["choices"][0]
            lp = None
            if self.recorder is not None:
                sent += len(c["text"].encode("utf-8"))
                entries, used = self.recorder.covering(used, sent - covered)
                covered += sum(len(e.text) for e in entries)
                lp = completion_logprobs(entries, 0)
            text = (echo or "") + c["text"]
            echo = None
            yield {**self._head(), "system_fingerprint": fingerprint(),
                   "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": c["finish_reason"]}]}

    def _chat_chunk(self, i: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                    finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "system_fingerprint": fingerprint(),
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def _chat_chunks(self, i: int) -> Iterator[dict[str, Any]]:
        stream = self._call(i, stream=True)
        first = next(stream, None)  # the prefill and first token, before anything is sent
        yield self._chat_chunk(i, {"role": "assistant", "content": None})
        family = self.ready.family
        text = ""  # everything generated
        emitted = 0  # characters of text sent as content
        used = 0  # recorder entries sent
        spare = 0  # bytes sent whose tokens' logprobs have not gone out yet
        finish = "stop"

        def content(upto: int) -> Iterator[dict[str, Any]]:
            nonlocal emitted, used, spare
            piece = text[emitted:upto]
            emitted = upto
            lp = None
            if self.recorder is not None:
                entries, used = self.recorder.covering(used, spare + len(piece.encode("utf-8")))
                spare += len(piece.encode("utf-8")) - sum(len(e.text) for e in entries)
                lp = chat_logprobs(entries)
            yield self._chat_chunk(i, {"content": piece}, lp)

        chunk = first
        while chunk is not None:
            c = chunk["choices"][0]
            text += c["text"]
            if c["finish_reason"] is not None:
                finish = c["finish_reason"]
            upto = len(text) if family is None else (0 if self.ready.forced_tool else
                                                     structured.safe_prefix(family, text))
            if upto > emitted:
                yield from content(upto)
            chunk = next(stream, None)
        if family is not None:
            parsed = structured.parse_tool_calls(family, self.ready.called(text, finish), self.ready.tool_names,
                                                 self.ready.parallel_tools)
            if parsed.tool_calls:
                calls = [{"index": k, **call} for k, call in enumerate(parsed.tool_calls)]
                yield self._chat_chunk(i, {"tool_calls": calls})
                yield self._chat_chunk(i, {}, None, "tool_calls")
                return
            text = parsed.content or ""  # the markup (a partial tag included) never reaches the content
        if len(text) > emitted:
            yield from content(len(text))
        yield self._chat_chunk(i, {}, None, finish)


def _trim_top(lp: dict[str, Any] | None, n: int) -> dict[str, Any] | None:
    """llama-cpp-python's top_logprobs maps hold the sampled token beside the top n: keep the n best."""
    if lp is None:
        return None
    tops = []
    for top in lp.get("top_logprobs") or []:
        if top is None:
            tops.append(None)
        else:
            tops.append(dict(sorted(top.items(), key=lambda kv: -kv[1])[:n]))
    return {**lp, "top_logprobs": tops}


def api_error(e: BaseException) -> APIError:
    """An exception raised by a llama call, as the API error a client should see: mapped by class, never by
    its text. ggmoe checks what llama-cpp-python would refuse (the context, ``echo`` with ``logprobs``) before
    the call; a ``ValueError`` still raised there is llama-cpp-python refusing an argument (400)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, GgmoeError):  # before ValueError: a ContextLengthError is both
        return domain_error(e)
    if isinstance(e, jinja2.TemplateError):
        return APIError(500, f"the model's chat template failed to render: {type(e).__name__}",
                        type="server_error", code="chat_template_error")
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    log.error("internal error in a generation", exc_info=e)  # the details go to the server log only
    return APIError(500, "internal server error", type="server_error")
