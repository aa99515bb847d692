"""``ggmoe serve --parallel 4``: requests decode together, each gets the text it gets alone (a KV stream per
slot), /slots, /props and /metrics show each slot, whole-model work falls back correctly, 429 past the
queue; bad flags get one line."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import API_KEY, start_server, stop_server

N_SLOTS = 4
N_CTX = 1024  # 256 tokens per slot
MAX_QUEUE = 8  # the eight requests of a test fit even before any of them reached a slot (no 429 by timing)
PROMPTS = ("The king of France", "Once upon a time", "In the year 1900, the", "Water is made of")


@pytest.fixture(scope="module")
def par(tmp_path_factory):
    """Four slots, each with its own KV stream (--no-kv-unified: a slot's text is the same whatever the
    others do), an expert cache, --logprobs for the prompt's logprobs, and slot files."""
    tmp = tmp_path_factory.mktemp("parallel")
    s = start_server(tmp, "--parallel", str(N_SLOTS), "--no-kv-unified", "--n-ctx", str(N_CTX), "--api-key",
                     API_KEY, "--max-queue", str(MAX_QUEUE), "--cache-slots", "8", "--threads", "1", "--logprobs",
                     "--slot-save-path", str(tmp / "slots"))
    yield s
    rc = stop_server(s)
    assert rc == 0, open(s.log).read()


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _complete(client: openai.OpenAI, prompt: str, stream: bool) -> str:
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    return client.completions.create(**kw).choices[0].text


def _chat(client: openai.OpenAI, prompt: str, stream: bool) -> str:
    kw = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    return client.chat.completions.create(**kw).choices[0].message.content or ""


@pytest.mark.parametrize("call", [_complete, _chat], ids=["completions", "chat"])
def test_concurrent_requests_each_get_their_text_alone(par, call):
    client = _openai(par)
    alone = [call(client, p, False) for p in PROMPTS]
    jobs = [(p, stream) for stream in (False, True) for p in PROMPTS]  # eight requests: four run, four wait
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: call(client, *j), jobs))
    assert together == alone + alone
    assert any(alone)


def _metric(server, name: str, slot: int | None = None) -> float:
    with server.client() as c:
        text = c.get("/metrics").text
    label = "" if slot is None else rf'\{{slot="{slot}"\}}'
    m = re.search(rf"^{re.escape(name)}{label} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_slots_and_props_show_every_slot(par):
    _chat(_openai(par), PROMPTS[0], False)  # a chat's settings (its stopping criteria are functions) shown
    with par.client() as c:
        slots = c.get("/slots").json()
        props = c.get("/props").json()
    assert [s["id"] for s in slots] == list(range(N_SLOTS))
    assert all(s["n_ctx"] == N_CTX // N_SLOTS for s in slots)
    assert props["total_slots"] == N_SLOTS and props["default_generation_settings"]["n_ctx"] == N_CTX // N_SLOTS


@pytest.mark.parametrize("slot", [0, 2, 3])
def test_id_slot_runs_there_and_metrics_count_it(par, slot):
    reqs = _metric(par, "ggmoe_slot_requests_total", slot)
    toks = _metric(par, "ggmoe_slot_generated_tokens_total", slot)
    with par.client() as c:
        r = c.post("/completion", json={"prompt": PROMPTS[slot], "n_predict": 6, "ignore_eos": True,
                                        "id_slot": slot}).json()
    assert r["id_slot"] == slot and r["tokens_predicted"] == 6
    assert _metric(par, "ggmoe_slot_requests_total", slot) == reqs + 1
    assert _metric(par, "ggmoe_slot_generated_tokens_total", slot) == toks + 6
    assert _metric(par, "ggmoe_slot_n_ctx", slot) == N_CTX // N_SLOTS


def test_streams_on_named_slots_show_there(par):
    """Two streams on slots 1 and 3: /slots shows their tasks there (running or, since a stream is generated
    ahead of its client with several slots, already done), and both slots end idle."""
    body = {"n_predict": 240, "ignore_eos": True, "stream": True}
    with par.client() as a, par.client() as b, par.client() as watcher:
        with a.stream("POST", "/completion", json={**body, "prompt": PROMPTS[0], "id_slot": 1}) as ra, \
                b.stream("POST", "/completion", json={**body, "prompt": PROMPTS[1], "id_slot": 3}) as rb:
            la, lb = ra.iter_lines(), rb.iter_lines()
            next(la)
            next(lb)
            seen = watcher.get("/slots").json()
            rest = [*la, *lb]  # both streams to their end
            assert sum(ln.startswith("data: ") for ln in rest) >= 2
        for _ in range(600):  # up to 60 s on a slow machine; a fast one breaks at once
            idle = watcher.get("/slots").json()
            if not any(s["is_processing"] for s in idle):
                break
            time.sleep(0.1)
    assert seen[1]["params"]["n_predict"] == 240 and seen[3]["params"]["n_predict"] == 240
    assert not any(s["is_processing"] for s in idle) and idle[1]["id_task"] == seen[1]["id_task"]


def test_embeddings_and_prompt_logprobs_wait_for_every_slot_and_slots_go_on(par):
    """What a slot cannot do runs on the whole model once every slot is idle; the slots' prompt caches are
    forgotten, so their next texts are still the texts alone."""
    client = _openai(par)
    before = _complete(client, PROMPTS[2], False)
    emb = client.embeddings.create(model="tiny", input=["hello there", "general kenobi"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    echo = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                     logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(PROMPTS[1]) and len(lp.tokens) > 4 and lp.token_logprobs[0] is None
    with ThreadPoolExecutor(N_SLOTS) as pool:
        after = list(pool.map(lambda p: _complete(client, p, False), PROMPTS))
    assert after[2] == before


def test_slot_save_erase_restore_on_one_slot(par):
    body = {"prompt": PROMPTS[3] * 3, "n_predict": 4, "temperature": 0, "id_slot": 2}
    with par.client() as c:
        first = c.post("/completion", json=body).json()
        saved = c.post("/slots/2?action=save", json={"filename": "slot2.bin"})
        assert saved.status_code == 200, saved.text
        assert c.post("/slots/2?action=erase").json()["n_erased"] == saved.json()["n_saved"]
        restored = c.post("/slots/2?action=restore", json={"filename": "slot2.bin"})
        assert restored.status_code == 200, restored.text
        warm = c.post("/completion", json=body).json()
        bad = c.post("/slots/9?action=erase")
    assert warm["tokens_cached"] == first["tokens_evaluated"] - 1 and warm["content"] == first["content"]
    assert bad.status_code == 400 and "no slot 9" in bad.json()["error"]["message"]


def test_a_burst_past_slots_and_queue_is_answered_or_told_to_retry(par):
    n = N_SLOTS + MAX_QUEUE + 6

    def one(i: int) -> tuple[int, dict, dict]:
        with par.client() as c:
            r = c.post("/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 48, "temperature": 0})
        return r.status_code, r.json(), dict(r.headers)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    assert {s for s, _, _ in results} <= {200, 429} and any(s == 200 for s, _, _ in results)
    for status, body, headers in results:
        if status == 429:
            assert body["error"]["type"] == "rate_limit_error" and int(headers["retry-after"]) >= 1
        else:
            assert body["choices"][0]["text"]
    deadline = time.monotonic() + 60  # generous for a slow machine: the loop ends as soon as it holds
    while time.monotonic() < deadline:
        with par.client() as c:
            h = c.get("/health").json()
        if h["running"] == 0:
            break
        time.sleep(0.1)
    assert h["running"] == 0 and h["queue_length"] == 0


@pytest.mark.parametrize("args,message", [
    (["--parallel", "0"], "--parallel"),
    (["--parallel", "65"], "--parallel"),
    (["--parallel", "4", "--n-ctx", "32"], "slots"),
    (["--parallel", "2", "--cache-slots", "4", "--reconfigure-every", "64"], "not with --parallel"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_parallel_flags_get_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "ggmoe", "serve", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_anthropic_messages_decode_together_and_match_alone(par):
    import anthropic

    client = anthropic.Anthropic(base_url=par.url, api_key=API_KEY, max_retries=0)

    def ask(prompt: str) -> str:
        m = client.messages.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": prompt}],
                                   extra_body={"temperature": 0})  # this SDK's create() takes no sampling
        return "".join(b.text for b in m.content if b.type == "text")

    alone = [ask(p) for p in PROMPTS]
    with ThreadPoolExecutor(N_SLOTS) as pool:
        assert list(pool.map(ask, PROMPTS)) == alone


def test_a_client_gone_mid_stream_frees_its_slot_and_the_others_go_on(par):
    client = _openai(par)
    before = _metric(par, "ggmoe_generations_cancelled_total")
    want = _complete(client, PROMPTS[0], False)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(_complete, client, PROMPTS[0], False)  # beside the stream that is dropped
        with par.client() as c, c.stream("POST", "/completion", json={
                "prompt": PROMPTS[1], "n_predict": 240, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())
        assert other.result(timeout=60) == want
    deadline = time.monotonic() + 60  # generous for a slow machine: the loop ends as soon as it holds
    while time.monotonic() < deadline:
        with par.client() as c:
            idle = c.get("/health").json()["running"] == 0
        if idle and _metric(par, "ggmoe_generations_cancelled_total") > before:
            break
        time.sleep(0.1)
    assert idle and _metric(par, "ggmoe_generations_cancelled_total") > before
