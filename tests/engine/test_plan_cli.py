"""ggmoe plan end to end: from traces or statistics to a plan file that run, trace and serve take."""

from __future__ import annotations

import json

import pytest
from cli_run import ggmoe
from click.testing import CliRunner

from ggmoe.cli import main
from ggmoe.control.plan_file import read_plan
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["def main():", "import os", "class A:", "for i in range(3):"]))
    r = CliRunner().invoke(main, ["trace", "--prompts", str(prompts), "-o", str(d / "t"), "--max-tokens", "24",
                                  "--stats-out", str(d / "stats.npz")])
    assert r.exit_code == 0, r.output
    return d


def test_plan_from_traces_runs(traced, tmp_path):
    out = tmp_path / "plan.toml"
    r = ggmoe("plan", "--vram", "4MiB", "--traces", str(traced / "t" / "trace.npz"), "-o", str(out),
              "--predictor-s", "0.00002", "--json")
    d = json.loads(r.stdout)
    cfg = read_plan(out)
    facts = inspect_model(default_model_path())
    slots = cfg.slots({il: facts.bytes_per_expert(il) for il in facts.moe_layers}, facts.n_expert,
                      facts.n_expert_used)
    assert sum(n * facts.bytes_per_expert(il) for il, n in slots.items()) <= 4 << 20
    assert d["tpot_s_estimate"] <= d["baseline_tpot_s_estimate"]  # the baseline is among the candidates
    assert len(d["candidates"]) >= 10 and d["analytic"] is False
    stats = tmp_path / "s.json"
    ggmoe("run", "-p", "def f():", "-n", "8", "--config", str(out), "--stats-json", str(stats))
    assert json.loads(stats.read_text())["policy"] == cfg.policy
    ggmoe("trace", "--prompts", str(traced / "p.jsonl"), "-o", str(tmp_path / "t2"), "--max-tokens", "4",
          "--config", str(out))


def test_plan_from_statistics(traced, tmp_path):
    out = tmp_path / "plan.toml"
    r = ggmoe("plan", "--vram", "4MiB", "--stats", str(traced / "stats.npz"), "-o", str(out))
    assert "estimated TPOT" in r.stdout
    cfg = read_plan(out)
    assert cfg.policy == "static" and "--stats-in" in out.read_text()
    ggmoe("run", "-p", "def f():", "-n", "4", "--config", str(out), "--stats-in", str(traced / "stats.npz"))


@pytest.mark.parametrize("args,message", [
    (["--vram", "4MiB", "-o", "p.toml"], "--traces FILE... or --stats FILE"),
    (["--vram", "10", "--traces", "TRACE", "-o", "p.toml"], "slots per layer"),
    (["--vram", "4MiB", "--traces", "TRACE", "-o", "p.txt"], ".toml"),
    (["--vram", "lots", "--traces", "TRACE", "-o", "p.toml"], "bad size"),
    (["--vram", "4MiB", "--traces", "TRACE", "--hw", "nope", "-o", "p.toml"], "unknown hardware profile"),
])
def test_plan_errors(traced, tmp_path, args, message):
    args = [a.replace("TRACE", str(traced / "t" / "trace.npz")) for a in args]
    r = ggmoe("plan", *args, ok=False)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_config_with_cache_flags_is_refused(traced, tmp_path):
    out = tmp_path / "plan.toml"
    ggmoe("plan", "--vram", "4MiB", "--stats", str(traced / "stats.npz"), "-o", str(out))
    r = ggmoe("run", "-p", "x", "--config", str(out), "--vram", "1MiB", ok=False)
    assert r.returncode == 2 and "--config sets the cache" in r.stderr


def test_plan_reports_moepics_split(traced, tmp_path):
    r = ggmoe("plan", "--vram", "4MiB", "--traces", str(traced / "t" / "trace.npz"), "-o", str(tmp_path / "p.toml"),
              "--predictor-s", "0.00002", "--hw", "egpu", "--moepic", "--json")
    m = json.loads(r.stdout)["moepic"]
    assert m["waited_s_per_token"] <= m["even_waited_s_per_token"] + 1e-12
    assert set(m["layers"]) == {str(il) for il in inspect_model(default_model_path()).moe_layers}
    assert sum(x["vram"] for x in m["layers"].values()) <= 4 << 20
    bad = ggmoe("plan", "--vram", "4MiB", "--stats", str(traced / "stats.npz"), "-o", str(tmp_path / "q.toml"),
                "--moepic", ok=False)
    assert bad.returncode == 2 and "--moepic" in bad.stderr
