"""``ggmoe plan`` never writes a plan that ``ggmoe run --config`` then refuses: every fixture family, every
hardware profile, from traces, from statistics and MoEpic's split, each written plan run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ggmoe.cli import main
from ggmoe.control.plan_file import read_plan
from ggmoe.inspect import inspect_model

PROMPTS = ["def main():", "import os", "class A:", "for i in range(3):"]


def _ok(*args: str) -> str:
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, (args, r.output)
    return r.output


@pytest.fixture(scope="module")
def traced(arch_model, tmp_path_factory):
    arch, path = arch_model
    d = tmp_path_factory.mktemp(f"plan-{arch}")
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    _ok("trace", str(path), "--prompts", str(prompts), "-o", str(d / "t"), "--max-tokens", "12",
        "--stats-out", str(d / "stats.npz"))
    return arch, path, d


@pytest.mark.parametrize("hw", ["pcie4", "h100", "egpu"])
@pytest.mark.parametrize("source", ["traces", "stats", "moepic"])
def test_every_written_plan_runs(traced, tmp_path, hw, source):
    arch, path, d = traced
    facts = inspect_model(path)
    budget = facts.cache_bytes(facts.n_expert_used + 1)
    out = tmp_path / "plan.toml"
    given = {"traces": ["--traces", str(d / "t" / "trace.npz"), "--predictor-s", "0.00002"],
             "stats": ["--stats", str(d / "stats.npz")],
             "moepic": ["--traces", str(d / "t" / "trace.npz"), "--moepic"]}[source]
    _ok("plan", str(path), "--vram", str(budget), "--hw", hw, "-o", str(out), *given)
    cfg = read_plan(out)
    cfg.check_model(facts)
    stats = tmp_path / "s.json"
    extra = ["--stats-in", str(d / "stats.npz")] if cfg.cache.policy == "static" else []
    _ok("run", str(path), "-p", "def f():", "-n", "6", "--config", str(out), "--stats-json", str(stats), *extra)
    run = json.loads(stats.read_text())
    assert run["policy"] == cfg.cache.policy and run["miss_policy"] == cfg.decode.miss_policy, arch
