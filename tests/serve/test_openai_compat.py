"""OpenAI and llama-server conformance against a real server: what the openai SDK, LangChain, Open WebUI and
llama.cpp's web UI send every day (logprobs, structured output, content parts, n, usage in streams, any model
name, the un-prefixed and llama-server routes, max_tokens beyond the context)."""

from __future__ import annotations

import math
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from server_process import API_KEY, N_CTX
from test_protocol import sse_events

MSG = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _check_entry(e, n_top: int) -> None:
    assert isinstance(e["logprob"], float) and e["logprob"] <= 0 and math.isfinite(e["logprob"])
    assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    assert len(e["top_logprobs"]) == n_top
    lps = [t["logprob"] for t in e["top_logprobs"]]
    assert lps == sorted(lps, reverse=True)
    if n_top:
        assert e["logprob"] <= lps[0] + 1e-6  # nothing beats the best alternative


@pytest.mark.parametrize("top", [None, 0, 3])
def test_chat_logprobs_without_streaming(server, top):
    body = {"messages": MSG, "max_tokens": 6, "temperature": 0, "logprobs": True}
    if top is not None:
        body["top_logprobs"] = top
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert content, "logprobs: true without top_logprobs must not be null"
    for e in content:
        _check_entry(e, top or 0)
    assert "".join(e["token"] for e in content) == choice["message"]["content"]


def test_chat_logprobs_streamed_fill_bytes(server):
    with server.client() as c:
        events = sse_events(c, "/v1/chat/completions", {"messages": MSG, "max_tokens": 6, "temperature": 0,
                                                        "logprobs": True, "top_logprobs": 2})
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    entries = [e for ch in chunks for e in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    assert entries and "".join(e["token"] for e in entries) == text
    for e in entries:
        _check_entry(e, 2)


def test_completion_logprobs_and_the_sdk(oai):
    r = oai.completions.create(model="anything", prompt="The quick brown fox", max_tokens=5, temperature=0,
                               logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)  # N entries (fewer only when pieces coincide)
    assert all(isinstance(x, float) for x in lp.token_logprobs)


def test_sdk_logprobs_streaming_with_usage(oai):
    stream = oai.chat.completions.create(model="gpt-4o-mini", messages=MSG, max_tokens=5, temperature=0,
                                         stream=True, logprobs=True, top_logprobs=1,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.content is None and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    tokens = [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
              for e in ch.choices[0].logprobs.content or []]
    assert "".join(tokens) == "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


class Weather(BaseModel):
    sky: Literal["sunny", "cloudy", "rainy"]
    windy: bool


def test_structured_output_with_sdk_parse(oai):
    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    r = parse(model="tiny-moe", messages=[{"role": "user", "content": "Weather today?"}], response_format=Weather,
              max_tokens=64, temperature=0.8, seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather)


def test_json_object_is_json(server):
    import json

    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 48, "seed": 1,
                                                 "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].lstrip().startswith("{")


def test_content_parts_developer_role_and_the_same_prompt(server):
    parts = [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]
    with server.client() as c:
        as_parts = c.post("/v1/chat/completions", json={
            "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}],
            "max_tokens": 4, "temperature": 0}).json()
        as_text = c.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon\na time"}],
            "max_tokens": 4, "temperature": 0}).json()
    assert as_parts["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    assert as_parts["choices"][0]["message"]["content"] == as_text["choices"][0]["message"]["content"]


def test_assistant_content_parts_and_null_content_with_tool_calls_are_accepted(server):
    msgs = [*MSG, {"role": "assistant", "content": [{"type": "text", "text": "there was"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}, {"role": "user", "content": "go on"}]
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_n_choices(oai):
    r = oai.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=4, n=2, seed=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens <= 8  # both choices counted, 4 tokens each at most


def test_n_choices_streamed(server):
    with server.client() as c:
        events = sse_events(c, "/v1/completions", {"prompt": "Once", "max_tokens": 3, "n": 2})
    indexes = {e["choices"][0]["index"] for e in events if isinstance(e, dict) and e["choices"]}
    assert indexes == {0, 1}


def test_max_completion_tokens(oai):
    r = oai.chat.completions.create(model="tiny-moe", messages=MSG, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_max_tokens_beyond_the_context_is_clamped(server):
    prompt = [65] * (N_CTX - 6)
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10**6, "logit_bias": {"2": -100}})
        r2 = c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": N_CTX * 4, "stop": ["\n"]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] <= 6
    assert choice["finish_reason"] in ("length", "stop")
    assert r2.status_code == 200, r2.text


def test_any_model_name_and_models_created(server, oai):
    models = oai.models.list().data
    assert models[0].id == "tiny-moe" and models[0].created > 0
    r = oai.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    assert r.choices[0].message.content is not None


def test_routes_without_the_v1_prefix(server):
    """/chat/completions and /models are OpenAI's without the prefix too; /completions and /embeddings answer
    in llama-server's own shapes, as llama-server does (tests/serve/test_llama_server.py)."""
    with server.client() as c:
        r = c.post("/chat/completions", json={"messages": MSG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "chat.completion"
        assert c.get("/models").json()["data"][0]["id"] == "tiny-moe"
        r = c.post("/completions", json={"prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200 and "content" in r.json() and "choices" not in r.json()


def test_tokenize_detokenize_round_trip(server):
    with server.client() as c:
        toks = c.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert toks and all(isinstance(t, int) for t in toks)
        assert c.post("/detokenize", json={"tokens": toks}).json()["content"] == "Hello world"
        pieces = c.post("/tokenize", json={"content": "Hello", "with_pieces": True}).json()["tokens"]
        assert "".join(p["piece"] for p in pieces) == "Hello"


def test_props_and_health_variants(server):
    with server.client() as c:
        props = c.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == N_CTX
        assert props["model_alias"] == "tiny-moe" and props["total_slots"] == 1
        assert "messages" in props["chat_template"]
    with server.client(key=None) as c:
        for path in ("/health", "/v1/health", "/healthz"):
            assert c.get(path).json()["status"] == "ok"


def test_embeddings_then_generation_is_unchanged(server, oai):
    before = oai.completions.create(model="m", prompt="The quick brown fox", max_tokens=6, temperature=0)
    emb = oai.embeddings.create(model="m", input=["The quick brown fox", "jumps"])
    after = oai.completions.create(model="m", prompt="The quick brown fox", max_tokens=6, temperature=0)
    vecs = [d.embedding for d in emb.data]
    assert len(vecs) == 2 and len(vecs[0]) == len(vecs[1]) > 0
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-3  # normalised
    assert vecs[0] != vecs[1]
    assert emb.usage.prompt_tokens > 0
    assert before.choices[0].text == after.choices[0].text  # the context was reset after embedding


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_answer(server, stream):
    with server.client() as c:
        toks = c.post("/tokenize", json={"content": "Once upon"}).json()["tokens"]
        for prompt, want in (("Once upon", "Once upon"), (toks, "Once upon")):
            body = {"prompt": prompt, "max_tokens": 3, "echo": True, "temperature": 0}
            if stream:
                text = "".join(e["choices"][0]["text"] for e in sse_events(c, "/v1/completions", body)
                               if isinstance(e, dict))
            else:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["text"]
            assert text.startswith(want) and len(text) > len(want)
