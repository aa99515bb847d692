"""One request on the model: checks against the model, llama-cpp-python's call, timings and usage.

``check_*`` refuse what the model cannot do before the request queues
(unknown model name, n > 1, max_tokens, token ids and logit_bias keys out of
the vocabulary). ``Watch`` is the ``GenerationWatch`` of one request: it
refuses a prompt whose tokens plus max_tokens exceed the context, timestamps
tokens (TTFT, TPOT), counts them for the usage of a stream and stops the
generation when the client has gone. ``llama_kwargs`` turns a request body
into the keyword arguments of ``Llama.create_completion`` /
``create_chat_completion``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jinja2
import llama_cpp

from ggmoe.errors import GgmoeError
from ggmoe.serve.errors import APIError
from ggmoe.serve.schema import ChatRequest, CompletionRequest

MAX_LOGPROBS = 20  # OpenAI's cap on (top_)logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]

# Fields of the request types that are not Llama keyword arguments (handled here or ignored).
_NOT_KWARGS = {"n", "best_of", "logit_bias_type", "user", "min_tokens", "stream_options",
               "max_completion_tokens", "grammar", "logit_bias", "model"}


def context_error(message: str) -> APIError:
    return APIError(400, message, param="messages", code="context_length_exceeded")


def check_model(name: str | None, model_id: str) -> None:
    if name is not None and name != model_id:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")


def max_tokens_of(body: CompletionRequest | ChatRequest) -> int | None:
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def check_request(body: CompletionRequest | ChatRequest, n_ctx: int, n_vocab: int) -> None:
    """What a request asks that the model cannot give (400), before it waits for the model."""
    if body.n is not None and body.n != 1:
        raise APIError(400, f"n = {body.n} is not supported: this server generates one choice per request "
                            "(send n = 1 or leave it out)", param="n", code="unsupported_value")
    if isinstance(body, CompletionRequest) and body.best_of not in (None, 1):
        raise APIError(400, "best_of > 1 is not supported", param="best_of", code="unsupported_value")
    mt = max_tokens_of(body)
    if mt is not None and mt < 1:
        raise APIError(400, f"max_tokens must be at least 1 (got {mt})", param="max_tokens",
                       code="invalid_value")
    if mt is not None and mt >= n_ctx:
        raise APIError(400, f"max_tokens = {mt} does not fit the model's context of {n_ctx} tokens "
                            "(prompt included)", param="max_tokens", code="context_length_exceeded")
    if body.temperature < 0:
        raise APIError(400, "temperature must be >= 0", param="temperature", code="invalid_value")
    lp = body.top_logprobs if isinstance(body, ChatRequest) else body.logprobs
    if lp is not None and lp > MAX_LOGPROBS:
        raise APIError(400, f"at most {MAX_LOGPROBS} logprobs per token", param="logprobs", code="invalid_value")
    if isinstance(body, CompletionRequest):
        _check_prompt(body.prompt, n_vocab)
    if body.logit_bias and body.logit_bias_type != "tokens":
        for key, value in body.logit_bias.items():
            if not key.isdigit() or not 0 <= int(key) < n_vocab:
                raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {n_vocab})",
                               param="logit_bias", code="invalid_value")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise APIError(400, f"logit_bias values must lie in [-100, 100] (token {key}: {value})",
                               param="logit_bias", code="invalid_value")


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
        self.t_first: float | None = None
        self.t_last: float | None = None

    def on_prompt(self, n_prompt: int) -> None:
        self.n_prompt = n_prompt
        if self.max_tokens is not None and n_prompt + self.max_tokens > self.n_ctx:
            raise context_error(f"the prompt ({n_prompt} tokens) plus max_tokens ({self.max_tokens}) exceeds "
                                f"the model's context of {self.n_ctx} tokens")

    def on_token(self, token: int) -> bool:
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if not self.is_eog(token):
            self.n_tokens += 1
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


def llama_kwargs(body: CompletionRequest | ChatRequest, llama: llama_cpp.Llama, model_id: str) -> dict[str, Any]:
    """The request as keyword arguments of ``create_completion`` / ``create_chat_completion``."""
    kw = body.model_dump(exclude=_NOT_KWARGS)
    kw["model"] = model_id
    kw["max_tokens"] = max_tokens_of(body)
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and isinstance(body.prompt[0], str):
        kw["prompt"] = body.prompt[0]
    if body.logit_bias:
        kw["logit_bias"] = _logit_bias(body, llama)
    if body.grammar is not None:
        if not llama.grammar_parses(body.grammar):
            raise APIError(400, "grammar: llama.cpp could not parse this GBNF grammar (it needs a 'root' rule)",
                           param="grammar", code="invalid_value")
        try:
            kw["grammar"] = llama_cpp.LlamaGrammar.from_string(body.grammar, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise APIError(400, f"grammar: {e}", param="grammar", code="invalid_value") from e
    if body.min_tokens > 0:
        kw["logits_processor"] = llama_cpp.LogitsProcessorList(
            [llama_cpp.MinTokensLogitsProcessor(body.min_tokens, llama.token_eos())])
    return kw


def _logit_bias(body: CompletionRequest | ChatRequest, llama: llama_cpp.Llama) -> dict[int, float]:
    if body.logit_bias_type != "tokens":
        return {int(k): float(v) for k, v in body.logit_bias.items()}
    out: dict[int, float] = {}
    for text, value in body.logit_bias.items():  # keys are token texts
        for tok in llama.tokenize(text.encode("utf-8"), add_bos=False, special=True):
            out[tok] = float(value)
    return out


def api_error(e: BaseException) -> APIError:
    """An exception raised by a llama call, as the API error a client should see."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError) and str(e).startswith("Requested tokens"):
        # llama-cpp-python: "Requested tokens (N) exceed context window of M"
        return context_error(f"the prompt does not fit the model's context: {e}")
    if isinstance(e, ValueError) and "logits_all=False" in str(e):
        return APIError(400, "logprobs need the server started with --logprobs (it keeps every position's "
                             "logits)", param="logprobs", code="unsupported_value")
    if isinstance(e, jinja2.TemplateError):
        return APIError(500, f"the model's chat template failed to render: {type(e).__name__}",
                        type="server_error", code="chat_template_error")
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    if isinstance(e, GgmoeError):
        return APIError(500, f"engine error: {e}", type="server_error", code="engine_error")
    return APIError(500, "internal server error", type="server_error")
