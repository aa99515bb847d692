"""Every client mistake gets an OpenAI-shaped error with the right status, never a 500, and the server lives on."""

from __future__ import annotations

import pytest
from server_process import N_CTX

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"

# (id, path, body or raw bytes, status, error type, error code or None, param or None)
CASES = [
    ("malformed-json", CHAT, b'{"messages": [', 400, "invalid_request_error", "invalid_json", None),
    ("not-an-object", CHAT, b"[1, 2]", 400, "invalid_request_error", "invalid_value", None),
    ("empty-body", COMPL, b"", 400, "invalid_request_error", None, None),
    ("deeply-nested", COMPL, b"[" * 100000 + b"]" * 100000, 400, "invalid_request_error", None, None),
    ("not-utf8", COMPL, b'{"prompt": "\xff\xfe"}', 400, "invalid_request_error", None, None),
    ("temperature-nan", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "invalid_request_error", "invalid_value", "temperature"),
    ("logit-bias-nan", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}',
     400, "invalid_request_error", "invalid_value", "logit_bias"),
    ("messages-missing", CHAT, {"max_tokens": 4}, 400, "invalid_request_error", "invalid_value", "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "invalid_request_error", "invalid_value", "messages"),
    ("messages-not-list", CHAT, {"messages": "hi"}, 400, "invalid_request_error", "invalid_value", "messages"),
    ("message-not-object", CHAT, {"messages": ["hi"]}, 400, "invalid_request_error", "invalid_value", "messages"),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error",
     "invalid_value", "messages"),
    ("user-without-content", CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_request_error",
     "invalid_value", "messages"),
    ("max-tokens-string", CHAT, {"messages": MSG, "max_tokens": "many"}, 400, "invalid_request_error",
     "invalid_value", "max_tokens"),
    ("max-tokens-negative", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "invalid_request_error",
     "invalid_value", "max_tokens"),
    ("max-tokens-zero", COMPL, {"prompt": "a", "max_tokens": 0}, 400, "invalid_request_error", "invalid_value",
     "max_tokens"),
    ("prompt-beyond-context", COMPL, {"prompt": "word " * (2 * N_CTX), "max_tokens": 4}, 400,
     "exceed_context_size_error", "context_length_exceeded", "prompt"),  # llama-server's type
    ("n-too-many", CHAT, {"messages": MSG, "n": 100}, 400, "invalid_request_error", "invalid_value", "n"),
    ("best-of-3", COMPL, {"prompt": "a", "best_of": 3}, 400, "invalid_request_error", "invalid_value",
     "best_of"),
    ("temperature-negative", CHAT, {"messages": MSG, "temperature": -1}, 400, "invalid_request_error",
     "invalid_value", "temperature"),
    ("temperature-string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "invalid_request_error",
     "invalid_value", "temperature"),
    ("token-id-out-of-range", COMPL, {"prompt": [1, 2, 10**6]}, 400, "invalid_request_error", "invalid_value",
     "prompt"),
    ("token-id-negative", COMPL, {"prompt": [-1]}, 400, "invalid_request_error", "invalid_value", "prompt"),
    ("prompt-empty-list", COMPL, {"prompt": []}, 400, "invalid_request_error", "invalid_value", "prompt"),
    ("several-prompts", COMPL, {"prompt": ["a", "b"]}, 400, "invalid_request_error", "unsupported_value",
     "prompt"),
    ("logit-bias-key-out-of-range", CHAT, {"messages": MSG, "logit_bias": {"99999999": 5}}, 400,
     "invalid_request_error", "invalid_value", "logit_bias"),
    ("logit-bias-key-not-a-number", CHAT, {"messages": MSG, "logit_bias": {"abc": 5}}, 400,
     "invalid_request_error", "invalid_value", "logit_bias"),
    ("logit-bias-value-too-big", CHAT, {"messages": MSG, "logit_bias": {"5": 1000}}, 400,
     "invalid_request_error", "invalid_value", "logit_bias"),
    ("top-logprobs-too-many", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400,
     "invalid_request_error", "invalid_value", "top_logprobs"),
    ("echo-logprobs-without-flag", COMPL, {"prompt": "a", "logprobs": 2, "echo": True}, 400,
     "invalid_request_error", "unsupported_value", "logprobs"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "invalid_request_error", "invalid_value", "messages"),
    ("assistant-without-content-or-calls", CHAT, {"messages": [*MSG, {"role": "assistant"}]}, 400,
     "invalid_request_error", "invalid_value", "messages"),
    ("json-object-invalid-schema", CHAT, {"messages": MSG, "response_format": {
        "type": "json_object", "schema": {"$ref": "https://example.com/schema.json"}}}, 400,
     "invalid_request_error", "invalid_value", "response_format"),
    ("json-schema-without-schema", CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "invalid_request_error", "invalid_value", "response_format"),
    ("tool-choice-unknown-tool", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "invalid_request_error",
     "invalid_value", None),
    ("required-without-tools", CHAT, {"messages": MSG, "tool_choice": "required"}, 400,
     "invalid_request_error", "invalid_value", None),
    ("grammar-and-response-format", CHAT, {"messages": MSG, "grammar": "root ::= \"a\"",
                                           "response_format": {"type": "json_object"}}, 400,
     "invalid_request_error", "invalid_value", "grammar"),
    ("detokenize-out-of-range", "/detokenize", {"tokens": [10**7]}, 400, "invalid_request_error",
     "invalid_value", "tokens"),
    ("embeddings-empty", "/v1/embeddings", {"input": ""}, 400, "invalid_request_error", "invalid_value",
     "input"),
    ("embeddings-no-tokens", "/v1/embeddings", {"input": [[0], [0]]}, 400, "invalid_request_error",
     "invalid_value", "input"),
    ("bad-grammar", COMPL, {"prompt": "a", "grammar": "root ::= ("}, 400, "invalid_request_error",
     "invalid_value", "grammar"),
    ("oversized-body", COMPL, {"prompt": "x" * (2 << 20)}, 413, "invalid_request_error", None, None),
]


@pytest.mark.parametrize("path,body,status,etype,code,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server, path, body, status, etype, code, param):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        extra = {"n_prompt_tokens", "n_ctx"} if etype == "exceed_context_size_error" else set()
        assert set(err) == {"message", "type", "param", "code"} | extra
        assert err["type"] == etype and err["message"]
        if code is not None:
            assert err["code"] == code
        if param is not None:
            assert err["param"] is not None and err["param"].split(".")[0] == param
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405), ("GET", "/v1/nothing", 404),
    ("POST", "/health", 405),
])
def test_wrong_routes_and_methods(server, method, path, status):
    with server.client() as c:
        r = c.request(method, path)
    assert r.status_code == status
    assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8080", "192.168.1.5", "127.0.0.1.nip.io"])
def test_foreign_host_header_is_refused(server, host):
    """DNS rebinding: a loopback-bound server refuses requests naming another host."""
    with server.client() as c:
        r = c.get("/v1/models", headers={"Host": host})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1:1234", "[::1]:80", "app.localhost"])
def test_loopback_host_headers_pass(server, host):
    with server.client() as c:
        assert c.get("/v1/models", headers={"Host": host}).status_code == 200


def test_no_cors_unless_asked(server):
    with server.client() as c:
        r = c.options("/v1/models", headers={"Origin": "http://localhost:3000",
                                             "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
