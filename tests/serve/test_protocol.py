"""The OpenAI protocol against a real server: the official client, raw HTTP and SSE details.

What llama.cpp's own server tests check (tools/server/tests): the first streamed delta carries the role,
every chunk the same id, the last a finish_reason; usage when stream_options asks; logit_bias honoured;
401 with authentication_error while /health stays public.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from server_process import API_KEY

CHAT = [{"role": "user", "content": "Once upon a time"}]


def sse_events(client, path: str, body: dict) -> list[dict | str]:
    """The data fields of a streamed response, JSON-decoded except the final [DONE]."""
    out: list[dict | str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_model(oai):
    models = [m.id for m in oai.models.list()]
    assert models == ["tiny-moe"]


def test_chat_completion_with_the_official_client(oai):
    r = oai.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_with_the_official_client(oai):
    r = oai.completions.create(model="tiny-moe", prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "The quick brown fox"}),
])
def test_streaming_equals_non_streaming_for_one_seed(server, path, body):
    body = {**body, "max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 1234}
    with server.client() as c:
        whole = c.post(path, json=body).json()
        events = sse_events(c, path, body)
    chunks = [e for e in events if isinstance(e, dict)]
    if path == "/v1/chat/completions":
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        assert text == whole["choices"][0]["text"]
    assert text


def test_stream_protocol_details(server):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "stream_options": {"include_usage": True}}
    with server.client() as c:
        events = sse_events(c, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert len({ch["id"] for ch in chunks}) == 1
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    *with_choices, usage_chunk = chunks
    assert with_choices[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(ch["choices"][0]["finish_reason"] is None for ch in with_choices[:-1])
    assert usage_chunk["choices"] == []
    u = usage_chunk["usage"]
    assert 0 < u["completion_tokens"] <= 6 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_no_usage_chunk_unless_asked(server):
    with server.client() as c:
        events = sse_events(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_streaming_with_the_official_client(oai):
    stream = oai.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=6, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


ASSERT_TOKEN = 371  # the embedded model's token "assert" (plain letters: its text is itself)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_logit_bias_is_honoured(server, path, body):
    body = {**body, "max_tokens": 4, "temperature": 0}
    with server.client() as c:
        plain = c.post(path, json=body).json()
        forced = c.post(path, json={**body, "logit_bias": {str(ASSERT_TOKEN): 100}}).json()
    text = (lambda r: r["choices"][0]["text"]) if "prompt" in body else (
        lambda r: r["choices"][0]["message"]["content"])
    assert text(forced) == "assert" * 4
    assert text(plain) != text(forced)


def test_stop_strings(server):
    with server.client() as c:
        free = c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16,
                                               "temperature": 0}).json()["choices"][0]["text"]
        stop = free[3:6]
        r = c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
                                            "stop": [stop]}).json()
    assert r["choices"][0]["text"] == free[: free.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path,method", [
    ("/v1/models", "GET"), ("/metrics", "GET"), ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
])
@pytest.mark.parametrize("key", [None, "wrong-key", API_KEY + "x"])
def test_every_route_but_health_needs_the_key(server, path, method, key):
    with server.client(key=key) as c:
        r = c.request(method, path, json={"prompt": "x", "max_tokens": 1} if method == "POST" else None)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers.get("www-authenticate") == "Bearer"


def test_health_is_public(server):
    with server.client(key=None) as c:
        r = c.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_official_client_raises_authentication_error(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_are_prometheus_text(server):
    with server.client() as c:
        c.post("/v1/completions", json={"prompt": "The", "max_tokens": 4})
        r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("ggmoe_requests_total", "ggmoe_completion_tokens_total", "ggmoe_time_to_first_token_seconds_bucket",
                 "ggmoe_time_per_output_token_seconds_bucket", "ggmoe_queue_length", "ggmoe_cache_hit_rate",
                 "ggmoe_prefetch_precision", "ggmoe_cache_copied_bytes_total", "ggmoe_cache_host_computed_total",
                 "ggmoe_cache_occupancy", "ggmoe_cache_host_read_bytes_total", "ggmoe_cache_admission_lag_tokens",
                 "ggmoe_prefetch_budget"):
        assert name in text, name
    # the prefetch on the mailbox: its reader's layers, those read too late among them
    read, behind = (float(re.search(rf'^ggmoe_prefetch_reader_layers_total\{{state="{s}"\}} (\S+)$', text, re.M)
                          .group(1)) for s in ("read", "behind"))
    assert 0 <= behind <= read
    # the decode mode in effect, as a labelled gauge: this server prefetches with a predictor, for which auto
    # weighs the two modes on this machine (the CPU build: async, no sync per layer), and it says why
    line = re.search(r'^ggmoe_decode_mode\{(.*)\} 1\.0$', text, re.M)
    assert line and 'mode="async"' in line.group(1) and 'asked="auto"' in line.group(1), text
    assert "stride prefetch" in line.group(1) and "estimates" in line.group(1)
