"""The server's one error edge (``ggmoe.serve.errors``), seen through the real clients: a domain error raised
while serving a request becomes its status in the route's own shape (OpenAI's, llama-server's, Anthropic's),
mapped by class: a ``UsageError`` is the request's 400, never a 500.

The routes here raise each error where a route's code would (directly, or through ``api_error`` as the app
does for what a llama call raised); the app around them is a bare FastAPI app with the edge installed, so
no model is needed. The clients are the openai and anthropic SDKs and raw httpx (llama-server's routes).
A real server started with ``--logprobs`` checks the other side of a refusal no longer mapped from text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from server_process import N_CTX, Server, start_server, stop_server

from ggmoe.base.errors import ContextLengthError, EngineError, ModelFileError, UsageError
from ggmoe.serve import errors
from ggmoe.serve.generation import api_error

# (id, the exception a request's code raises, status, OpenAI type, code, Anthropic type)
CASES = [
    ("usage", UsageError("n_ctx 7: too small"), 400, "invalid_request_error", "invalid_value",
     "invalid_request_error"),
    ("context", ContextLengthError("the prompt: 300 tokens do not fit n_ctx 256"), 400, "invalid_request_error",
     "context_length_exceeded", "invalid_request_error"),
    ("engine", EngineError("llama_decode failed (-3)"), 500, "server_error", "engine_error", "api_error"),
    ("model-file", ModelFileError("x.gguf: cannot read"), 500, "server_error", "server_error", "api_error"),
    ("llama-cpp-value", ValueError("Tool choice 'g' not found in tools."), 400, "invalid_request_error",
     "invalid_value", "invalid_request_error"),
]
BY_ID = {c[0]: c[1] for c in CASES}


def _app() -> FastAPI:
    """Routes at the three shapes' paths; ``?via=api_error`` raises as the app does after a llama call."""
    app = FastAPI()
    errors.install(app)

    def fail(case: str, via: str) -> Any:
        e = BY_ID[case]
        if via == "api_error":
            raise api_error(e) from e
        raise e

    @app.post("/v1/chat/completions")
    @app.post("/completion")
    @app.post("/v1/messages")
    async def route(case: str, via: str = "raise") -> Any:
        return fail(case, via)

    return app


@pytest.fixture(scope="module")
def http() -> TestClient:
    return TestClient(_app(), raise_server_exceptions=False)


# a bare ValueError is mapped only where a llama call raised it (api_error); raised by the server's own code
# it is a bug: a 500 with the details in the log
PARAMS = [(c[0], via, *c[2:]) for c in CASES for via in ("raise", "api_error")
          if via == "api_error" or isinstance(c[1], errors.GgmoeError)]
IDS = [f"{p[0]}-{p[1]}" for p in PARAMS]


@pytest.mark.parametrize("case,via,status,etype,code,atype", PARAMS, ids=IDS)
def test_openai_sdk_sees_the_openai_shape(http, case, via, status, etype, code, atype):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       extra_query={"case": case, "via": via})
    err = info.value
    assert err.status_code == status
    assert err.body["type"] == etype and err.body["code"] == code  # the SDK's body is the "error" object
    assert err.body["message"] == str(BY_ID[case])


@pytest.mark.parametrize("case,via,status,etype,code,atype", PARAMS, ids=IDS)
def test_native_route_sees_the_llama_server_shape(http, case, via, status, etype, code, atype):
    r = http.post("/completion", params={"case": case, "via": via}, json={"prompt": "a"})
    assert r.status_code == status
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == etype and body["error"]["code"] == code
    assert body["error"]["message"] == str(BY_ID[case])


@pytest.mark.parametrize("case,via,status,etype,code,atype", PARAMS, ids=IDS)
def test_anthropic_sdk_sees_the_anthropic_shape(http, case, via, status, etype, code, atype):
    client = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=http, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_query={"case": case, "via": via})
    err = info.value
    assert err.status_code == status
    assert err.body == {"type": "error", "error": {"type": atype, "message": str(BY_ID[case])}}


@pytest.mark.parametrize("e,status,code", [(c[1], c[2], c[4]) for c in CASES[:4]], ids=[c[0] for c in CASES[:4]])
def test_domain_error_maps_by_class_not_text(e, status, code):
    """The class decides: the same class with another text maps the same, another class with this text
    maps as that class; a server error names no request field."""
    again = errors.domain_error(type(e)("Requested tokens (300) exceed context window of 256"), param="messages")
    assert (again.status, again.code) == (status, code)
    got = errors.domain_error(e, param="messages")
    assert (got.status, got.code, got.message) == (status, code, str(e))
    assert got.param == ("messages" if status == 400 else None)


def _schema_app() -> FastAPI:
    """The real request types behind the edge: their validators' refusals as the routes answer them."""
    from ggmoe.serve.anthropic import MessagesRequest, chat_request
    from ggmoe.serve.schema import ChatRequest, NativeCompletionRequest

    app = FastAPI()
    errors.install(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> dict:
        return {}

    @app.post("/completion")
    async def native(body: NativeCompletionRequest) -> dict:
        return {}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest) -> dict:
        chat_request(body)
        return {}

    return app


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": "hi"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [USER], "tool_choice": {"type": "tool"}}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [USER], "stop_sequences": [""]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}),
    ("/v1/chat/completions", {"messages": [USER], "tool_choice": "required"}),
    ("/completion", {"prompt": "a", "grammar": "root ::= \"a\"", "json_schema": {}}),
], ids=["anthropic-prefill", "anthropic-tool-choice", "anthropic-stop", "assistant-empty", "required-no-tools",
        "grammar-and-schema"])
def test_validation_messages_carry_no_pydantic_prefix(path, body):
    r = TestClient(_schema_app(), raise_server_exceptions=False).post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message and "Value error" not in message and "Assertion failed" not in message, message


@pytest.fixture(scope="module")
def logprobs_server(tmp_path_factory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("logprobs"), "--n-ctx", str(N_CTX), "--logprobs")
    yield s
    assert stop_server(s) == 0, open(s.log).read()


def test_echo_logprobs_run_with_the_flag(logprobs_server):
    """The other side of the 400 that ``echo`` with ``logprobs`` gets without ``--logprobs`` (checked before
    llama-cpp-python, not mapped from its ValueError's text): with the flag the prompt's logprobs come back."""
    client = openai.OpenAI(base_url=logprobs_server.url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=2, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The quick brown fox")
    assert len(lp.tokens) == len(lp.token_logprobs) > 2 and lp.token_logprobs[0] is None  # the first has no context
