"""llama-server's behaviours beyond its routes' shapes: ``system_fingerprint`` names the build, a prompt over the
context is ``exceed_context_size_error`` with its counts, ``--chat-template-file`` and ``--chat-template-kwargs``
render prompts as the user's template says, ``chat_template_kwargs`` per request (``enable_thinking``)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_process import start_server, stop_server

N_CTX = 256
THINK = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>"
         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
         "{% endif %}")
HI = [{"role": "user", "content": "Hi"}]
LONG = "word " * (2 * N_CTX)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    (tmp / "think.jinja").write_text(THINK)
    s = start_server(tmp, "--n-ctx", str(N_CTX), "--chat-template-file", str(tmp / "think.jinja"),
                     "--chat-template-kwargs", '{"enable_thinking": true}')
    yield s
    assert stop_server(s) == 0, open(s.log).read()


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_system_fingerprint_names_the_build(oai):
    chat = oai.chat.completions.create(model="x", messages=HI, max_tokens=2)
    text = oai.completions.create(model="x", prompt="Once", max_tokens=2)
    streamed = [c.system_fingerprint for c in oai.completions.create(model="x", prompt="Once", max_tokens=2,
                                                                     stream=True)]
    prints = {chat.system_fingerprint, text.system_fingerprint, *streamed}
    assert len(prints) == 1 and next(iter(prints)).startswith("ggmoe-0.")
    assert "llama-cpp-python-" in chat.system_fingerprint


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/completion", {"prompt": LONG}, "prompt"),
])
def test_a_prompt_over_the_context_is_llama_servers_error(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == "context_length_exceeded"
    assert err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX and err["param"] == param
    assert "exceeds the available context size" in err["message"]


def test_the_sdks_see_a_context_error(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="x", prompt=LONG, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as a:
        client.messages.create(model="x", max_tokens=2, messages=[{"role": "user", "content": LONG}])
    assert a.value.body["error"]["type"] == "invalid_request_error"  # Anthropic's own types only


def test_the_chat_template_file_and_its_kwargs_render_the_prompt(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/props").json()["chat_template"] == THINK
        default = c.post("/apply-template", json={"messages": HI}).json()["prompt"]
        off = c.post("/apply-template", json={"messages": HI, "chat_template_kwargs": {"enable_thinking": False}})
        bad = c.post("/apply-template", json={"messages": HI, "chat_template_kwargs": {"messages": []}})
    assert default == "<|user|>Hi\n<|assistant|><think>"  # --chat-template-kwargs: enable_thinking true
    assert off.json()["prompt"] == "<|user|>Hi\n<|assistant|><think></think>"  # the request's own win
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("chat_template_kwargs: may not set")


def test_chat_template_kwargs_reach_a_chat_completion(oai):
    on = oai.chat.completions.create(model="x", messages=HI, max_tokens=1)
    off = oai.chat.completions.create(model="x", messages=HI, max_tokens=1,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # "</think>" rendered


@pytest.mark.parametrize("budget,want", [(-1, {}), (0, {"enable_thinking": False})])
def test_reasoning_budget_zero_turns_thinking_off(budget, want):
    """llama-server's --reasoning-budget: 0 renders every chat with enable_thinking false, -1 changes nothing."""
    from ggmoe.cli.serve import _reasoning

    assert _reasoning(budget, {}) == want
    assert _reasoning(budget, {"x": 1}) == {"x": 1, **want}
