"""``ggmoe serve`` as a user starts it: flags refused with one line, warnings, a hostile chat template."""

from __future__ import annotations

import socket
import subprocess
import sys

import gguf
import httpx
import pytest
from server_process import free_port, start_server, stop_server

from ggmoe.models import default_model_path
from tools.fixtures.make_fixtures import rewrite_gguf


def ggmoe(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggmoe", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["missing.gguf"], "no such file"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--max-body", "lots"], "bad size"),
    (["--api-key", " "], "--api-key is empty"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--host", "nonexistent.invalid"], "cannot resolve"),
    (["--policy", "lfu"], "needs a cache size"),
    (["--cache-slots", "4", "--policy", "nope"], "nope"),
    (["--predictor", "reuse"], "needs a cache size"),
    (["--cache-slots", "4", "--stats-json", "stats.txt"], "--stats-json"),
    (["--config", "missing-plan.toml"], "no such file"),
    (["--stats-in", "missing-stats.npz"], "no such file"),
    (["--cache-slots", "4", "--stats-json", "/etc/passwd/s.json"], "--stats-json"),
    (["--chat-template", "nope"], "give a Jinja template, or one of chatml"),
    (["--chat-template", "{% if %}"], "does not parse"),
    (["--chat-template-file", "missing.jinja"], "--chat-template-file missing.jinja"),
    (["--chat-template", "chatml", "--chat-template-file", "t.jinja"], "not both"),
    (["--chat-template-kwargs", "{"], "is not JSON"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template-kwargs", '{"messages": []}'], "may not set messages"),
    (["--reasoning-budget", "512"], "cuts no thinking at a token budget"),
    (["--reasoning-budget", "0", "--chat-template-kwargs", '{"enable_thinking": true}'], "turns thinking off"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_flags_get_one_line(args, message):
    r = ggmoe("serve", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_port_in_use_is_refused_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = ggmoe("serve", "--port", str(port))
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr


def test_non_loopback_without_a_key_warns(tmp_path):
    s = start_server(tmp_path, "--host", "0.0.0.0", "--n-ctx", "128")
    try:
        import httpx

        assert httpx.get(s.url + "/health").status_code == 200
        # not bound to loopback only: any Host header is served
        assert httpx.get(s.url + "/v1/models", headers={"Host": "myhost.lan"}).status_code == 200
    finally:
        assert stop_server(s) == 0
    assert "without an API key" in open(s.log).read()


def test_stats_json_is_written_at_stop(tmp_path):
    out = tmp_path / "stats.json"
    s = start_server(tmp_path, "--n-ctx", "128", "--cache-slots", "8", "--stats-json", str(out))
    try:
        import httpx

        assert httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4}).status_code == 200
    finally:
        assert stop_server(s) == 0
    assert '"hit_rate"' in out.read_text()


def test_serve_with_the_cpu_beside_the_link_answers_stock_and_reports_its_worker(tmp_path):
    """``--miss-policy cpu --host-threads 1``: the host part on a worker, through the OpenAI SDK; the answer is
    the one a plain server gives, and ``--stats-json`` reports the worker's jobs."""
    import json

    from openai import OpenAI

    answers = {}
    for name, extra in (("stock", ()), ("worker", ("--cache-slots", "4", "--miss-policy", "cpu", "--decode-mode",
                                                   "sync", "--host-threads", "1", "--stats-json",
                                                   str(tmp_path / "s.json")))):
        s = start_server(tmp_path, "--n-ctx", "256", *extra)
        try:
            client = OpenAI(base_url=s.url + "/v1", api_key="none")
            r = client.completions.create(model="m", prompt="def fib(n):", max_tokens=12, temperature=0)
            answers[name] = r.choices[0].text
        finally:
            assert stop_server(s) == 0
    assert answers["worker"] == answers["stock"]
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["host_part"]["threads"] == 1 and stats["host_part"]["jobs"] > 0


def test_hostile_chat_template_renders_harmlessly(tmp_path):
    evil = rewrite_gguf(default_model_path(), tmp_path / "evil.gguf", keys={"tokenizer.chat_template": (
        "{{ cycler.__init__.__globals__.os.popen('touch " + str(tmp_path / "pwned") + "').read() }}",
        gguf.GGUFValueType.STRING, None)})
    s = start_server(tmp_path, str(evil), "--n-ctx", "128")
    try:
        import httpx

        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "chat_template_error"
        assert not (tmp_path / "pwned").exists()
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        assert stop_server(s) == 0


def test_free_port_helper_gives_a_bindable_port():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_routing_stats_persist_across_a_restart(tmp_path):
    """--stats-out at stop, --stats-in at start: the counts of both runs add up."""
    import httpx

    from ggmoe.trace.routing_stats import load_stats

    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    s = start_server(tmp_path, "--n-ctx", "128", "--cache-slots", "8", "--stats-out", str(a))
    try:
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200
    finally:
        assert stop_server(s) == 0
    s = start_server(tmp_path, "--n-ctx", "128", "--cache-slots", "8", "--policy", "static", "--stats-in", str(a),
                     "--stats-out", str(b))
    try:
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200
    finally:
        assert stop_server(s) == 0
    sa, sb = load_stats(a), load_stats(b)
    assert sa.n_tokens.min() > 0
    assert (sb.counts == 2 * sa.counts).all()


def test_reconfiguration_between_requests(tmp_path):
    """--reconfigure-every: after enough generated tokens, between requests, MoEpic's configurator replaces a
    poor cache (every expert of layer 0 cached, n_expert_used in the others) with its choice for the same
    bytes; requests before and after answer normally (the openai SDK), and /metrics and the log say so."""
    import httpx
    import openai

    from ggmoe.inspect import inspect_model

    facts = inspect_model(default_model_path())
    plan = tmp_path / "plan.toml"
    plan.write_text("[cache]\n[cache.slots]\n" + "".join(
        f'"{il}" = {facts.n_expert if il == facts.moe_layers[0] else facts.n_expert_used}\n'
        for il in facts.moe_layers))
    out = tmp_path / "stats.json"
    s = start_server(tmp_path, "--n-ctx", "256", "--config", str(plan), "--reconfigure-every", "16",
                     "--stats-json", str(out))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        for prompt in ("def fib(n):", "import os", "class Tree:", "for i in range(10):"):
            r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
            assert r.choices[0].text is not None and r.usage.completion_tokens > 0
        metrics = httpx.get(s.url + "/metrics").text
        assert "ggmoe_cache_reconfigurations_total 1.0" in metrics or \
            "ggmoe_cache_reconfigurations_total 2.0" in metrics or \
            "ggmoe_cache_reconfigurations_total 3.0" in metrics, metrics
        assert "ggmoe_cache_top_hits" in metrics
    finally:
        assert stop_server(s) == 0
    assert "reconfigured the expert cache" in open(s.log).read()
    import json

    stats = json.loads(out.read_text())
    first = str(facts.moe_layers[0])  # the configurator's slots, not the plan's
    assert stats["slots_per_layer"][first] < facts.n_expert  # bytes moved from the lopsided layer to others
    assert any(n > facts.n_expert_used for il, n in stats["slots_per_layer"].items() if il != first)


@pytest.mark.parametrize("args, message", [
    (["--reconfigure-every", "8"], "needs a cache"),
    (["--cache-slots", "8", "--reconfigure-every", "8", "--reconfigure-hw", "nosuch"], "nosuch"),
])
def test_reconfigure_flags_get_one_line(args, message):
    from click.testing import CliRunner

    from ggmoe.cli import main

    r = CliRunner().invoke(main, ["serve", *args])
    assert r.exit_code != 0 and r.output.count("error:") == 1 and message in r.output, r.output


def test_fit_without_a_gpu_says_so_in_one_line_and_serves(tmp_path):
    """On the CPU build --fit has nothing to plan: one line, then the server as without a cache flag."""
    from ggmoe.engine.loader import gpu_device_name

    if gpu_device_name() is not None:
        pytest.skip("a GPU is present: --fit plans a cache there (tests/unit/test_serve_fit.py)")
    s = start_server(tmp_path, "--fit")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "def fib(n):", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    finally:
        assert stop_server(s) == 0
    log = open(s.log).read()
    assert log.count("ggmoe serve --fit: no GPU on this machine (CPU build)") == 1, log


def test_serve_on_a_model_larger_than_the_host_ram_says_so_and_counts_disk_reads(tmp_path):
    """`ggmoe serve --host-ram` below the experts' size starts, says it runs a disk tier, answers an OpenAI client,
    and /metrics counts the host tier's disk reads per layer."""
    from openai import OpenAI

    from ggmoe.inspect import inspect_model

    facts = inspect_model(default_model_path())
    host = (facts.n_expert // 2) * facts.expert_bytes_per_slot
    s = start_server(tmp_path, "--n-ctx", "128", "--host-ram", str(host))
    try:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused")
        reply = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=8, temperature=0)
        assert reply.choices[0].text
        metrics = httpx.get(s.url + "/metrics").text
    finally:
        assert stop_server(s) == 0
    assert "disk tier: the experts do not fit --host-ram" in open(s.log).read()
    reads = [line for line in metrics.splitlines() if line.startswith("ggmoe_host_tier_disk_reads_total{")]
    assert reads and sum(float(line.rsplit(" ", 1)[1]) for line in reads) > 0, metrics[-2000:]
