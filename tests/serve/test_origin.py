"""Bodies are JSON whatever their Content-Type (as llama-server reads them), and a browser request from another
site is refused on every route, whatever it carries, unless ``--cors-origin`` names that site."""

from __future__ import annotations

import httpx
import pytest
from server_process import API_KEY, start_server, stop_server

EVIL = "http://evil.example"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ANTHROPIC = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded model behind an API key, with a directory for slot files."""
    tmp = tmp_path_factory.mktemp("origin")
    s = start_server(tmp, "--api-key", API_KEY, "--n-ctx", "512", "--slot-save-path", str(tmp / "slots"))
    yield s
    assert stop_server(s) == 0, open(s.log).read()


# One request per route (and per slot action); the test below checks that this covers every route of the app.
ROUTES = [
    ("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/models", None),
    ("POST", "/v1/chat/completions", CHAT), ("POST", "/chat/completions", CHAT),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2}), ("POST", "/v1/embeddings", {"input": "Hi"}),
    ("POST", "/completion", {"prompt": "Once", "n_predict": 2}), ("POST", "/completions", {"prompt": "Once"}),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")"}), ("POST", "/embedding", {"content": "Hi"}),
    ("POST", "/embeddings", {"content": "Hi"}), ("POST", "/tokenize", {"content": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1]}), ("POST", "/apply-template", {"messages": CHAT["messages"]}),
    ("GET", "/props", None), ("GET", "/slots", None),
    ("POST", "/slots/0?action=save", {"filename": "evil.bin"}),
    ("POST", "/slots/0?action=restore", {"filename": "evil.bin"}), ("POST", "/slots/0?action=erase", None),
    ("POST", "/v1/messages", ANTHROPIC), ("POST", "/v1/messages/count_tokens", ANTHROPIC),
    ("POST", "/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 2}),
    ("OPTIONS", "/v1/chat/completions", None),
]
# What a page can send cross-site without a CORS preflight, and what scripts send.
SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


def _send(c: httpx.Client, method: str, path: str, body: dict | None, headers: dict[str, str]) -> httpx.Response:
    import json

    return c.request(method, path, content=json.dumps(body) if body is not None else None, headers=headers)


def test_the_routes_cover_the_app(server):
    with server.client() as c:
        paths = set(c.get("/openapi.json").json()["paths"])
    assert paths - {"/slots/{id_slot}"} <= {p for _, p, _ in ROUTES}
    assert {"save", "restore", "erase"} <= {p.split("=")[1] for _, p, _ in ROUTES if p.startswith("/slots/")}


@pytest.mark.parametrize("ctype", SIMPLE_TYPES)
@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_another_sites_request_is_refused(server, method, path, body, ctype):
    with server.client() as c:
        r = _send(c, method, path, body, {"Origin": EVIL, "Content-Type": ctype})
    assert r.status_code == 403, r.text
    if path.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error"
        message = r.json()["error"]["message"]
    else:
        assert r.json()["error"]["code"] == "invalid_origin"
        message = r.json()["error"]["message"]
    assert "evil.example" in message and "--cors-origin" in message
    assert "access-control-allow-origin" not in r.headers


def test_a_refused_slot_save_writes_nothing(server):
    with server.client() as c:
        r = _send(c, "POST", "/slots/0?action=save", {"filename": "evil-probe.bin"},
                  {"Origin": EVIL, "Content-Type": "text/plain"})
        assert r.status_code == 403
        slots = c.get("/slots").json()
    assert slots and "evil-probe" not in str(slots)
    restored = httpx.post(server.url + "/slots/0?action=restore", json={"filename": "evil-probe.bin"},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert restored.status_code == 400  # no such file: the refused save wrote none


@pytest.mark.parametrize("headers", [
    {"Content-Type": "application/x-www-form-urlencoded"},  # curl -d
    {"Content-Type": "text/plain"}, {},  # some scripts send none
    {"Content-Type": "application/json", "Origin": "http://127.0.0.1:PORT"},  # the server's own origin
    {"Content-Type": "text/plain", "Origin": "http://localhost:PORT"},
], ids=["form", "text", "none", "own-origin", "own-origin-by-name"])
@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "Once", "n_predict": 2}), ("/v1/chat/completions", CHAT),
    ("/v1/messages", ANTHROPIC), ("/tokenize", {"content": "Hi"}),
])
def test_a_json_body_is_read_whatever_its_content_type(server, headers, path, body):
    port = server.url.rsplit(":", 1)[1]
    headers = {k: v.replace("PORT", port) for k, v in headers.items()}
    with server.client() as c:
        r = _send(c, "POST", path, body, headers)
    assert r.status_code == 200, r.text


def test_a_body_that_is_no_json_is_one_clear_400(server):
    with server.client() as c:
        r = c.post("/completion", content="prompt=Once", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_the_host_check_and_body_limit_stay(server):
    with server.client() as c:
        r = _send(c, "POST", "/completion", {"prompt": "x" * (2 << 20)}, {"Content-Type": "text/plain"})
        assert r.status_code == 413, r.text
        r = _send(c, "POST", "/completion", {"prompt": "Once"}, {"Content-Type": "text/plain", "Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_host"


def test_cors_origin_allows_the_site_it_names(tmp_path):
    allowed = "http://app.example:3000"
    s = start_server(tmp_path, "--cors-origin", allowed, "--n-ctx", "128")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            pre = c.options("/v1/chat/completions", headers={"Origin": allowed,
                                                             "Access-Control-Request-Method": "POST",
                                                             "Access-Control-Request-Headers": "content-type"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == allowed
            r = _send(c, "POST", "/tokenize", {"content": "Hi"}, {"Origin": allowed, "Content-Type": "text/plain"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
            other = _send(c, "POST", "/tokenize", {"content": "Hi"}, {"Origin": EVIL, "Content-Type": "text/plain"})
            assert other.status_code == 403
    finally:
        assert stop_server(s) == 0
