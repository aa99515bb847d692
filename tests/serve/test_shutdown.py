"""SIGTERM on a ``--parallel 2`` server with two streams running and a request waiting: the process exits (0),
each stream ends with its route's final events, the waiting request gets one 503."""

from __future__ import annotations

import json
import signal
import threading
import time

import anthropic
import httpx
import openai
from server_process import API_KEY, start_server

from ggmoe.inspect.reader import read_header
from ggmoe.models import default_model_path

EXIT_BOUND_S = 10.0  # generous: measured by hand at 0.3-0.8 s on the 2-core VM under load


def _openai_stream(url: str, out: list) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    eos = read_header(default_model_path()).kv["tokenizer.ggml.eos_token_id"]
    try:
        for chunk in client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1900,
                                               stream=True, logit_bias={str(eos): -100}):
            out.append(chunk.choices[0].finish_reason)
        out.append("end")  # the SDK saw [DONE]
    except Exception as e:  # noqa: BLE001 - the test reads it
        out.append(e)


def _native_stream(url: str, out: list) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 1900, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/completion", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            out.extend(json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: "))
        out.append("end")
    except Exception as e:  # noqa: BLE001
        out.append(e)


def _waiting(url: str, out: list) -> None:
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    try:
        out.append(client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]))
    except Exception as e:  # noqa: BLE001
        out.append(e)


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigterm_ends_the_streams_with_their_final_events_and_exits(tmp_path):
    s = start_server(tmp_path, "--parallel", "2", "--n-ctx", "4096", "--api-key", API_KEY)
    streamed, native, waited = [], [], []
    jobs = [threading.Thread(target=f, args=(s.url, out)) for f, out in
            ((_openai_stream, streamed), (_native_stream, native))]
    for j in jobs:
        j.start()
    _until(lambda: len(streamed) > 3 and len(native) > 3, "both streams running")
    late = threading.Thread(target=_waiting, args=(s.url, waited))
    late.start()
    _until(lambda: httpx.get(s.url + "/health").json()["queue_length"] == 1, "a request waiting")
    s.proc.send_signal(signal.SIGTERM)
    rc = s.proc.wait(timeout=EXIT_BOUND_S)
    for j in (*jobs, late):
        j.join(timeout=30)
    log = open(s.log).read()
    assert rc == 0, log
    assert streamed[-1] == "end" and streamed[-2] == "length", streamed[-3:]  # a finish_reason, then [DONE]
    assert len(streamed) < 1900, "the stream ran to its end: SIGTERM came too late to test anything"
    assert native[-1] == "end" and native[-2]["stop"] is True, native[-3:]  # llama-server's last chunk
    assert len(native) < 1900
    err = waited[0]
    assert isinstance(err, anthropic.APIStatusError) and err.status_code == 503, err
    assert "shutting down" in err.message
    assert "Traceback" not in log and "ASGI callable returned without completing" not in log, log
