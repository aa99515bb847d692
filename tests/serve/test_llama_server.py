"""llama-server's own routes against a real server with raw requests, as llama-server's tests send them
(tools/server/tests/unit/test_completion.py, test_infill.py, test_slot_save.py, test_template.py):
``/completion`` and ``/completions``, ``/infill`` (a fixture with FIM tokens), ``/embedding(s)``,
``/apply-template``, ``/props``, ``/slots`` and the slot actions, and their errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from server_process import N_CTX, Server, start_server, stop_server

from tools.fixtures.make_fixtures import FIM_TOKEN_IDS, fim_fixture_path

PROMPT = "Once upon a time"


def stream(client, path: str, body: dict) -> list[dict]:
    """The data objects of a native stream (llama-server sends no [DONE] on these routes)."""
    out = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[len("data: "):]))
    return out


def test_completion_answers_in_llama_servers_shape(server):
    with server.client() as c:
        r = c.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True})
    assert r.status_code == 200, r.text
    b = r.json()
    assert isinstance(b["content"], str) and b["stop"] is True and b["model"] == "tiny-moe"
    assert b["stop_type"] in ("limit", "eos") and b["stopping_word"] == ""
    assert b["truncated"] is False and isinstance(b["has_new_line"], bool)
    t = b["timings"]
    assert t["predicted_n"] == b["tokens_predicted"] <= 8 and t["prompt_n"] + t["cache_n"] == b["tokens_evaluated"]
    assert len(b["tokens"]) == b["tokens_predicted"] and all(isinstance(x, int) for x in b["tokens"])
    g = b["generation_settings"]
    assert g["n_predict"] == 8 and g["n_ctx"] == N_CTX and g["seed"] == 4294967295
    with server.client() as c:
        assert c.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()["tokens"] == []


def test_completions_without_v1_is_the_native_route(server):
    with server.client() as c:
        r = c.post("/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert "content" in r.json() and "choices" not in r.json()
    assert r.json()["generation_settings"]["n_predict"] == 3  # max_tokens read as n_predict, as llama-server does


def test_stream_equals_the_answer_and_ends_with_stop(server):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "seed": 3}
    with server.client() as c:
        whole = c.post("/completion", json=body).json()
        events = stream(c, "/completion", body)
    *parts, last = events
    assert all(e["stop"] is False and e["tokens"] and isinstance(e["content"], str) for e in parts)
    assert "".join(e["content"] for e in parts) == whole["content"]
    assert [t for e in parts for t in e["tokens"]] and last["stop"] is True
    assert last["timings"]["predicted_n"] == whole["timings"]["predicted_n"]
    assert last["stop_type"] == whole["stop_type"] and "generation_settings" in last


def test_n_probs_gives_the_top_tokens_streamed_or_not(server):
    body = {"prompt": PROMPT, "n_probs": 3, "temperature": 0, "n_predict": 5, "ignore_eos": True}
    with server.client() as c:
        b = c.post("/completion", json=body).json()
        events = stream(c, "/completion", body)
    probs = b["completion_probabilities"]
    assert len(probs) == 5
    for p in probs + [p for e in events[:-1] for p in e["completion_probabilities"]]:
        assert p["logprob"] <= 0 and isinstance(p["token"], str) and isinstance(p["bytes"], list)
        tops = [t["logprob"] for t in p["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(t["id"] >= 0 for t in p["top_logprobs"])
    assert sum(len(e["completion_probabilities"]) for e in events[:-1]) == 5


def test_prompt_forms_tokens_mixed_and_several(server):
    with server.client() as c:
        tokens = c.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
        base = {"temperature": 0, "n_predict": 4}
        text = c.post("/completion", json={**base, "prompt": tokens}).json()["content"]
        several = c.post("/completion", json={**base, "prompt": [tokens, PROMPT]}).json()
        assert isinstance(several, list) and [s["index"] for s in several] == [0, 1]
        assert several[0]["content"] == text == several[1]["content"]
        mixed = c.post("/completion", json={**base, "prompt": [*tokens[:2], " time", 11]})
        assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)


def test_stop_word_and_eos_and_cache(server):
    with server.client() as c:
        free = c.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0}).json()
        word = free["content"].strip()[:1]
        b = c.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, "stop": [word]}).json()
        again = c.post("/completion", json={"prompt": PROMPT, "n_predict": 1, "temperature": 0}).json()
        nocache = c.post("/completion", json={"prompt": PROMPT, "n_predict": 1, "cache_prompt": False}).json()
    assert b["stop_type"] == "word" and b["stopping_word"] == word and word not in b["content"]
    assert again["tokens_cached"] > 0 and nocache["tokens_cached"] == 0


def test_grammar_json_schema_and_ignore_eos(server):
    with server.client() as c:
        g = c.post("/completion", json={"prompt": PROMPT, "grammar": 'root ::= "yes" | "no"', "n_predict": 4})
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        js = c.post("/completion", json={"prompt": PROMPT, "json_schema": schema, "n_predict": 40,
                                         "temperature": 0})
        long = c.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "ignore_eos": True})
        zero = c.post("/completion", json={"prompt": PROMPT, "n_predict": 0})
    assert g.json()["content"] in ("yes", "no")
    assert isinstance(json.loads(js.json()["content"])["n"], int)
    assert long.json()["tokens_predicted"] == 24 and long.json()["stop_type"] == "limit"
    assert zero.json()["content"] == "" and zero.json()["tokens_predicted"] == 0


def test_until_the_context_is_full_is_truncated(server):
    with server.client() as c:
        b = c.post("/completion", json={"prompt": [65] * (N_CTX - 6), "ignore_eos": True}).json()
    assert b["truncated"] is True and b["stop_type"] == "limit" and b["tokens_predicted"] == 6


def test_native_embeddings(server):
    with server.client() as c:
        for path in ("/embedding", "/embeddings"):
            r = c.post(path, json={"content": "hello world"})
            assert r.status_code == 200, r.text
            (item,) = r.json()
            assert item["index"] == 0 and len(item["embedding"]) == 1 and len(item["embedding"][0]) > 8
        assert len(c.post("/embeddings", json={"input": ["a b", "c d"]}).json()) == 2


def test_apply_template_props_and_slots(server):
    with server.client() as c:
        p = c.post("/apply-template", json={"messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi there"}]})
        props = c.get("/props").json()
        c.post("/completion", json={"prompt": PROMPT, "n_predict": 1})
        slots = c.get("/slots").json()
    assert p.status_code == 200 and "Hi there" in p.json()["prompt"] and "Be brief." in p.json()["prompt"]
    assert props["total_slots"] == len(slots) == 1
    assert props["default_generation_settings"]["n_ctx"] == N_CTX and props["chat_template"]
    assert props["default_generation_settings"]["params"]["n_predict"] == -1
    assert slots[0]["id"] == 0 and slots[0]["n_ctx"] == N_CTX and slots[0]["is_processing"] is False
    assert slots[0]["id_task"] >= 0 and slots[0]["params"]["n_predict"] == 1  # the last task ran in it


def test_slot_save_restore_erase(server):
    body = {"prompt": PROMPT * 4, "n_predict": 1, "temperature": 0, "id_slot": 0}
    with server.client() as c:
        first = c.post("/completion", json=body).json()
        saved = c.post("/slots/0?action=save", json={"filename": "slot0.bin"})
        assert saved.status_code == 200, saved.text
        assert saved.json()["n_saved"] >= first["tokens_evaluated"] and saved.json()["n_written"] > 0
        erased = c.post("/slots/0?action=erase").json()
        assert erased == {"id_slot": 0, "n_erased": saved.json()["n_saved"]}
        after_erase = c.post("/completion", json=body).json()
        assert after_erase["tokens_cached"] == 0
        c.post("/slots/0?action=erase")
        restored = c.post("/slots/0?action=restore", json={"filename": "slot0.bin"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == saved.json()["n_saved"]
        warm = c.post("/completion", json=body).json()
    assert warm["tokens_cached"] == first["tokens_evaluated"] - 1 and warm["content"] == first["content"]


def _corrupt(path: Path, kind: str) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:100])
        return
    if kind == "garbage-state":
        arrays["state"] = np.frombuffer(b"\x07" * 64, dtype=np.uint8)
    elif kind == "too-many-tokens":
        arrays["tokens"] = np.resize(arrays["tokens"], N_CTX + 1)
    elif kind == "tokens-outside-vocab":
        arrays["tokens"] = arrays["tokens"] + 10 ** 7
    elif kind == "other-model":
        arrays["identity"] = arrays["identity"] + 1
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("kind", ["truncated", "garbage-state", "too-many-tokens", "tokens-outside-vocab",
                                  "other-model"])
def test_corrupt_slot_files_are_refused_and_the_server_goes_on(server, kind):
    """llama-server's test_slot_restore_truncated_file and kin: a malformed file is a 400, never a crash."""
    with server.client() as c:
        c.post("/completion", json={"prompt": PROMPT, "n_predict": 2})
        assert c.post("/slots/0?action=save", json={"filename": f"{kind}.bin"}).status_code == 200
        _corrupt(Path(server.log).parent / "slots" / f"{kind}.bin", kind)
        r = c.post("/slots/0?action=restore", json={"filename": f"{kind}.bin"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", r.text
        after = c.post("/completion", json={"prompt": "The quick brown fox", "n_predict": 2})
        assert after.status_code == 200 and after.json()["stop"] is True


BAD = [
    ("unknown-slot", "/slots/7?action=erase", None, "id_slot"),
    ("negative-slot", "/slots/-3?action=erase", None, "id_slot"),
    ("path-outside", "/slots/0?action=save", {"filename": "../outside.bin"}, "filename"),
    ("absolute-path", "/slots/0?action=restore", {"filename": "/etc/passwd"}, "filename"),
    ("hidden-file", "/slots/0?action=save", {"filename": ".hidden"}, "filename"),
    ("missing-file", "/slots/0?action=restore", {"filename": "never-saved.bin"}, "filename"),
    ("no-filename", "/slots/0?action=save", None, "filename"),
    ("unknown-action", "/slots/0?action=fly", {"filename": "a"}, "query"),
    ("completion-unknown-slot", "/completion", {"prompt": "a", "id_slot": 5}, "id_slot"),
    ("mixed-bad-types", "/completion", {"prompt": [1, 2.5, {"a": 1}]}, "prompt"),
    ("bool-token", "/completion", {"prompt": [True, "a"]}, "prompt"),
    ("nested-three-deep", "/completion", {"prompt": [[[1]]]}, "prompt"),
    ("bare-id-among-prompts", "/completion", {"prompt": [["a"], 13409, "b"]}, "prompt"),  # a fuzzing find
    ("lone-surrogate", "/completion", b'{"prompt": ["a", "\\udadb"]}', "prompt"),
    ("lone-surrogate-infill", "/infill", b'{"input_prefix": "\\ud83d"}', None),
    ("token-out-of-vocab", "/completion", {"prompt": [1, 10 ** 7]}, "prompt"),
    ("empty-prompt-list", "/completion", {"prompt": []}, "prompt"),
    ("prompt-beyond-context", "/completion", {"prompt": "word " * (2 * N_CTX)}, "prompt"),
    ("grammar-and-schema", "/completion", {"prompt": "a", "grammar": 'root ::= "a"', "json_schema": {}}, None),
    ("bad-grammar", "/completion", {"prompt": "a", "grammar": "root ::= ("}, "grammar"),
    ("bad-json-schema", "/completion", {"prompt": "a", "json_schema": {"$ref": "https://x.y/z.json"}},
     "json_schema"),
    ("empty-stop", "/completion", {"prompt": "a", "stop": [""]}, "stop"),
    ("logit-bias-out-of-vocab", "/completion", {"prompt": "a", "logit_bias": [[10 ** 7, 1.0]]}, "logit_bias"),
    ("infill-without-fim", "/infill", {"input_prefix": "def f(", "input_suffix": "\n"}, "input_prefix"),
    ("template-bad-role", "/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("embedding-empty", "/embedding", {"content": ""}, "content"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_native_requests_get_a_400(server, path, body, param):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body) if body is not None else c.post(path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        if err["type"] == "exceed_context_size_error":  # llama-server's, with its two counts
            assert err.pop("n_ctx") == N_CTX and err.pop("n_prompt_tokens") >= N_CTX
            err["type"] = "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] is not None and err["param"].split(".")[0] == param
        assert c.get("/health").status_code == 200


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("fim"), str(fim_fixture_path()), "--n-ctx", "256")
    yield s
    assert stop_server(s) == 0, open(s.log).read()


def test_infill_with_context_files_as_llama_vscode_sends_them(fim_server):
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "ret",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
            "n_predict": 6, "temperature": 0, "ignore_eos": True}
    with fim_server.client(key=None) as c:
        r = c.post("/infill", json=body)
        assert r.status_code == 200, r.text
        events = stream(c, "/infill", body)
    b = r.json()
    assert b["tokens_predicted"] == 6 and b["stop"] is True
    assert "".join(e["content"] for e in events[:-1]) == b["content"]
    prompt_ids = [FIM_TOKEN_IDS[k] for k in ("rep", "sep", "pre", "suf", "mid")]
    with fim_server.client(key=None) as c:
        tokens = c.post("/tokenize", json={"content": b["prompt"], "with_pieces": False}).json()["tokens"]
    assert all(t in tokens for t in prompt_ids)  # the repo-level layout: <REP>, <SEP> file..., <PRE> <SUF> <MID>
    assert "util.py" in b["prompt"] and "print(add(1, 2))" in b["prompt"]


def test_infill_without_context_files(fim_server):
    with fim_server.client(key=None) as c:
        r = c.post("/infill", json={"input_prefix": "int main() {\n", "prompt": "    int n = ", "input_suffix": "}\n",
                                    "n_predict": 4})
    assert r.status_code == 200 and isinstance(r.json()["content"], str)


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}])
def test_invalid_context_files_get_a_400(fim_server, extra):
    """llama-server's test_invalid_input_extra_req."""
    with fim_server.client(key=None) as c:
        r = c.post("/infill", json={"input_extra": [extra], "input_prefix": "int main() {\n", "input_suffix": "}\n"})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("input_extra")
        assert c.get("/health").status_code == 200


def test_slots_show_a_running_task():
    """llama-server's test_completion_parallel_slots checks /slots while requests run: the busy slot shows.

    The interleaving is forced, not timed: the app runs in-process around a real model whose decode of the
    second generated token waits until /slots has been read (a 200-token stream of the tiny model can end
    before a watcher's request is served: CI saw it)."""
    import threading

    from fastapi.testclient import TestClient

    import ggmoe
    from ggmoe.serve.app import ServeSettings, create_app

    reached, go = threading.Event(), threading.Event()
    with ggmoe.load(n_ctx=N_CTX) as llama:
        real_eval, calls = llama.eval, []

        def held_eval(tokens):  # the prompt, then one call per generated token: hold the second token's
            calls.append(len(tokens))
            if len(calls) == 3:
                reached.set()
                go.wait(60)
            return real_eval(tokens)

        llama.eval = held_eval
        app = create_app(llama, ServeSettings(model_id="m", loopback_only=False))
        with TestClient(app) as client:
            body = {"prompt": PROMPT, "n_predict": 8, "ignore_eos": True, "stream": True}
            done: list = []
            t = threading.Thread(target=lambda: done.append(client.post("/completion", json=body)))
            t.start()
            try:
                assert reached.wait(60), "the generation never reached its second token"
                busy = client.get("/slots").json()[0]
            finally:
                go.set()
                t.join(60)
            idle = client.get("/slots").json()[0]
    assert done and done[0].status_code == 200
    assert busy["is_processing"] is True and busy["params"]["n_predict"] == 8
    assert busy["next_token"]["n_decoded"] >= 1 and busy["next_token"]["has_next_token"] is True
    assert idle["is_processing"] is False and idle["id_task"] == busy["id_task"]


def test_response_fields(server):
    """llama-server's test_completion_response_fields (what llama.vim and llama.vscode ask for)."""
    fields = ["content", "generation_settings/n_predict", "prompt", "timings/prompt_n", "no/such"]
    with server.client() as c:
        b = c.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "response_fields": fields}).json()
    assert set(b) == set(fields[:4]) and b["generation_settings/n_predict"] == 4
    assert isinstance(b["content"], str) and b["prompt"] == PROMPT and b["timings/prompt_n"] >= 1


@pytest.mark.parametrize("limit", [{"n_indent": 8}, {"t_max_predict_ms": 1}])
def test_code_completion_limits(server, limit):
    """n_indent: a new line indented less ends the answer (and is cut off); t_max_predict_ms: past the time,
    a new line ends it. Newlines are made likely with a bias, as code has them."""
    with server.client() as c:
        nl = c.post("/tokenize", json={"content": "\n"}).json()["tokens"]
        body = {"prompt": "def f():\n    return", "n_predict": 120, "ignore_eos": True, "temperature": 0,
                "logit_bias": [[t, 4.0] for t in nl], **limit}
        b = c.post("/completion", json=body).json()
    assert b["stop_type"] == "limit" and b["tokens_predicted"] < 120 and "\n" in b["content"]
    if "n_indent" in limit:
        assert b["content"].endswith("\n")
        lines = b["content"].split("\n")[1:]
        assert all(not line.strip() or len(line) - len(line.lstrip()) >= 8 for line in lines)


def test_a_running_server_has_every_field_the_routes_seam_names():
    """``compat_routes.RouteServer``'s fields on a real server object (its methods: tests/unit/test_route_seam.py)."""
    from fastapi.testclient import TestClient

    import ggmoe
    from ggmoe.serve.app import ServeSettings, create_app
    from ggmoe.serve.compat_routes import RouteServer, RouteSettings

    with ggmoe.load(n_ctx=N_CTX) as llama:
        app = create_app(llama, ServeSettings(model_id="m", loopback_only=False))
        with TestClient(app):
            server = app.state.server
            assert [n for n in RouteServer.__annotations__ if not hasattr(server, n)] == []
            assert [n for n in RouteSettings.__annotations__ if not hasattr(server.settings, n)] == []
            assert server.llama is llama and server.n_vocab == llama.n_vocab()
