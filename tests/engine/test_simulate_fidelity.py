"""The simulator's fidelity: replaying the engine's own trace with the same configuration gives exactly the
engine's hits, misses, prefetch counts and experts computed on the CPU (CPU build: copies land at once)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ggmoe.cli import main
from ggmoe.inspect import inspect_model
from ggmoe.simulate.des import SimConfig, simulate
from ggmoe.trace import load_trace

# the simulator lands a copy when its modelled time says; the engine's counts equal its replay only when the
# engine's copies land at once too (on the deferred stream they land when the threads run)
pytestmark = pytest.mark.immediate_copies("the simulator's replay equals the engine's counts only when copies "
                                          "land at once")

FIELDS = ("calls", "native_calls", "hits", "misses", "host_computed", "admission_copies", "prefetch_issued",
          "prefetch_hits", "prefetch_wasted", "pred_correct", "pred_total")


def _trace(tmp_path, prompts: list[str], max_tokens: int):
    """A trace of the embedded model's greedy generations for ``prompts`` (``ggmoe trace -o``'s directory)."""
    tr, jsonl = tmp_path / "t", tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    r = CliRunner().invoke(main, ["trace", "--prompts", str(jsonl), "-o", str(tr), "--max-tokens", str(max_tokens)])
    assert r.exit_code == 0, r.output
    return tr


@pytest.mark.parametrize("flags", [
    ["--policy", "lru"],
    ["--policy", "lfu", "--miss-policy", "cpu"],
    ["--policy", "tinylfu", "--miss-policy", "cpu"],  # the host path's admissions through the filter
    ["--policy", "lru", "--predictor", "reuse", "--stride", "1"],
    ["--policy", "lcp", "--predictor", "reuse", "--stride", "2", "--miss-policy", "cpu"],
    ["--policy", "lru", "--predictor", "skip-gate", "--stride", "1"],
    ["--policy", "lru", "--predictor", "skip-gate", "--stride", "2", "--plan-predictor", "reuse"],
], ids=["lru", "lfu-host", "tinylfu-host", "prefetch", "lcp-prefetch-host", "skip-gate", "skip-gate-planner"])
def test_simulator_counts_equal_the_engine(qwen3moe_model, tmp_path, flags):
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox jumps", "-n", "24",
                                  "--cache-slots", "3", "--stats-json", str(stats), "--trace-out", str(tr), *flags])
    assert r.exit_code == 0, r.output
    live = json.loads(stats.read_text())["layers"]
    opts = dict(zip(flags[::2], flags[1::2], strict=True))
    facts = inspect_model(qwen3moe_model)
    cfg = SimConfig(n_slots=dict.fromkeys(facts.moe_layers, 3), policy=opts["--policy"],
                    predictor=opts.get("--predictor"), stride=int(opts.get("--stride", 2)),
                    miss_policy=opts.get("--miss-policy", "wait"), predictor_s=0.0,
                    planner=opts.get("--plan-predictor"))
    sim = simulate(load_trace(tr), cfg, {il: facts.bytes_per_expert(il) for il in facts.moe_layers}, None,
                   model_path=str(qwen3moe_model))
    assert sum(s["misses"] for s in sim.stats["layers"].values()) > 0
    if cfg.predictor:
        assert sum(s["prefetch_issued"] for s in sim.stats["layers"].values()) > 0
    fields = (*FIELDS, "plan_total", "plan_correct") if cfg.planner else FIELDS
    if cfg.planner:
        assert sum(s["plan_total"] for s in sim.stats["layers"].values()) > 0
    for il, s in sim.stats["layers"].items():
        assert {f: s[f] for f in fields} == {f: live[il][f] for f in fields}, il


def _engine_without_fills(monkeypatch) -> None:
    """``ggmoe run``'s run config with in-graph fills off (``DecodeConfig(fills=False)``: the GPU matrix's
    ``async`` row), for the run that follows in this process."""
    import dataclasses

    from ggmoe.cli import cache_flags as warm

    made = warm.run_config

    def without_fills(*a, **k):
        run = made(*a, **k)
        return dataclasses.replace(run, decode=dataclasses.replace(run.decode, fills=False))

    monkeypatch.setattr(warm, "run_config", without_fills)


@pytest.mark.immediate_copies("the replay lands a copy when it is issued, as the immediate stream does")
@pytest.mark.parametrize(("policy", "predictor", "slots", "planner", "fills", "miss"), [
    ("lru", None, 3, None, False, "wait"), ("lfu", None, 3, None, False, "wait"),
    ("tinylfu", None, 3, None, False, "wait"), ("lru", "reuse", 5, None, False, "wait"),
    ("lru", None, 4, "token.npz", False, "wait"), ("lru", "reuse", 5, "reuse", False, "wait"),
    # in-graph fills (the engine's default): the graph fills what assign computes, the controller settles it
    ("lru", None, 3, None, True, "wait"), ("tinylfu", None, 3, None, True, "wait"),
    ("lru", "reuse", 5, None, True, "wait"), ("lru", "reuse", 5, "reuse", True, "wait"),
    # the host part (patch 0016): every miss computed on the CPU, then admitted by the controller
    ("lru", None, 3, None, True, "cpu"), ("tinylfu", None, 3, None, True, "cpu")])
def test_simulator_counts_equal_the_async_engine(qwen3moe_model, tmp_path, monkeypatch, policy, predictor, slots,
                                                 planner, fills, miss):
    """The async decode replayed: the engine's counts (decode steps read through the tables, the controller
    between tokens, prefill on the route op; with a predictor, the mailbox's stride prefetch into free slots;
    with fills, the misses the graph filled, settled without admissions) equal the simulator's in async mode on
    the same routing. The trace comes from a sync run of the same greedy generation: recording router
    probabilities needs the route op, and the routing does not depend on the mode."""
    # With a predictor the mailbox's reader keeps pace with the device (lockstep), as the replay's does: a reader
    # behind the device issues nothing for a layer that has already started. With fills too, the graph assigns
    # fills by the entries it reads, and a prompt short enough to read through the tables in the run and the
    # replay alike (a longer one routes every token at the last layer in the trace, one in the run: that layer's
    # prefetch outcomes then move the prefetcher's budget, which every layer shares).
    prompt = "The" if fills and predictor else "The quick brown fox jumps over"
    if predictor:
        monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    run = ["run", str(qwen3moe_model), "-p", prompt, "-n", "24", "--cache-slots", str(slots), "--policy", policy,
           "--miss-policy", miss]
    pre = ["--predictor", predictor, "--stride", "1"] if predictor else []
    if planner == "token.npz":  # a cross-token mlp: its input rows from the mailbox live, from the trace replayed
        from tools.fixtures.random_predictor import random_predictor_file

        planner = str(random_predictor_file(qwen3moe_model, tmp_path / planner, hidden=16, seed=5, mode="token"))
    pre += ["--plan-predictor", planner] if planner else []
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    with monkeypatch.context() as m:
        if not fills:
            _engine_without_fills(m)
        r = CliRunner().invoke(main, [*run, *pre, "--decode-mode", "async", "--stats-json", str(stats)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert d["decode_mode_in_effect"] == "async"
    if miss == "cpu":  # every miss on the CPU: none filled, none read in place
        assert d["total"]["host_computed"] > 0 and d["total"]["fills"] == d["total"]["host_reads"] == 0
    else:
        assert d["total"]["fills" if fills else "host_reads"] > 0 and (d["total"]["fills"] > 0) == fills
    if predictor:
        assert d["total"]["prefetch_issued"] > 0
    r = CliRunner().invoke(main, [*run, "--decode-mode", "sync", "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    facts = inspect_model(qwen3moe_model)
    cfg = SimConfig(n_slots=dict.fromkeys(facts.moe_layers, slots), policy=policy, decode_mode="async",
                    predictor=predictor, stride=1, planner=planner, fills=fills, miss_policy=miss)
    sim = simulate(load_trace(tr), cfg, {il: facts.bytes_per_expert(il) for il in facts.moe_layers}, None)
    fields = (*FIELDS, "host_reads", "host_read_bytes", "evictions", "prefetch_issued", "prefetch_hits",
              "prefetch_late", "prefetch_wasted", "plan_total", "plan_correct", "admission_copies", "fills",
              "bytes_copied")
    if planner:
        assert d["planner"]["runs_on"] == "controller" and d["total"]["plan_total"] > 0
    last = str(max(facts.moe_layers))
    # The trace routes every prompt token at the last layer (recorded with all logits); the run computes only
    # the token whose logits it samples there, so that layer's prefill call differs (native in the replay, one
    # token on the cache in the run) and everything after it in that layer may too: it is left out.
    compared = [il for il in sim.stats["layers"] if il != last]
    assert len(compared) >= 3
    for il in compared:
        s = sim.stats["layers"][il]
        assert {f: s[f] for f in fields} == {f: d["layers"][il][f] for f in fields}, il


def test_simulate_command(tmp_path):
    tr = _trace(tmp_path, ["def main():", "import os"], 8)
    out = tmp_path / "p.png"
    r = subprocess.run([sys.executable, "-m", "ggmoe", "simulate", str(tr / "trace.npz"), "--cache-fraction",
                        "0.25,0.5", "--policy", "lru,lfu", "--predictor", "none,reuse", "--json", "--plot",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["results"]) == 8 and "estimates" in d
    assert all(x["tpot_s"] > 0 and 0 <= x["hit_rate"] <= 1 for x in d["results"])
    assert out.stat().st_size > 1000
    table = subprocess.run([sys.executable, "-m", "ggmoe", "simulate", str(tr / "trace.npz"), "--cache-slots", "8"],
                           capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and "TPOT ms (est.)" in table.stdout


@pytest.mark.parametrize("args,message", [
    ([], "give a cache size"),
    (["--cache-slots", "2"], "needs 4 to 32"),
    (["--cache-slots", "x"], "not an integer"),
    (["--cache-fraction", "1.5"], "in (0, 1]"),
    (["--cache-slots", "8", "--policy", "nope"], "nope"),
    (["--cache-slots", "8", "--policy", "static"], "--stats-in"),
    (["--cache-slots", "8", "--predictor", "eam"], "training traces"),
    (["--cache-slots", "8", "--hw", "nope"], "unknown hardware profile"),
    (["--cache-slots", "8", "--plot", "x.txt"], ".png"),
    (["--cache-slots", "8", "--miss-policy", "sometimes"], "unknown miss policy"),
])
def test_simulate_errors(tmp_path, args, message):
    tr = tmp_path / "t"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    CliRunner().invoke(main, ["trace", "--prompts", str(prompts), "-o", str(tr), "--max-tokens", "4"])
    r = subprocess.run([sys.executable, "-m", "ggmoe", "simulate", str(tr / "trace.npz"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_traces_of_another_model_are_refused(tmp_path, qwen3moe_model):
    tr = tmp_path / "t"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    CliRunner().invoke(main, ["trace", str(qwen3moe_model), "--prompts", str(prompts), "-o", str(tr),
                              "--max-tokens", "4"])
    r = subprocess.run([sys.executable, "-m", "ggmoe", "simulate", str(tr / "trace.npz"), "--cache-slots", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "another model" in r.stderr


def test_predictors_that_read_hidden_states_or_routers(tmp_path):
    """A trained predictor file (linear) and skip-gate (the model's own routers) run in the simulator."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["def main():", "import os", "class A:", "for i in x:", "while True:", "x = 1"]))
    tr = tmp_path / "t"
    assert CliRunner().invoke(main, ["trace", "--prompts", str(prompts), "-o", str(tr), "--max-tokens", "12"]) \
        .exit_code == 0
    pred = tmp_path / "lin.npz"
    r = subprocess.run([sys.executable, "-m", "ggmoe", "train-predictor", str(tr / "trace.npz"), "-o", str(pred),
                        "--kind", "linear", "--stride", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "ggmoe", "simulate", str(tr / "trace.npz"), "--cache-slots", "8",
                        "--predictor", f"{pred},skip-gate", "--stride", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    assert len(results) == 2 and all(x["prefetch_issued"] > 0 and x["pred_accuracy"] > 0 for x in results)


@pytest.mark.parametrize("start", ["train", "warm"])
def test_a_learning_predictor_counts_equal_the_engine(qwen3moe_model, tmp_path, start):
    """eam fitted on training traces, or restarted from the state a run saved (--stats-in): the simulator's
    counts on the live run's trace equal the live run's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os"}\n{"prompt": "class A:"}\n{"prompt": "def main():"}\n')
    invoke = CliRunner().invoke
    assert invoke(main, ["trace", str(qwen3moe_model), "--prompts", str(prompts), "-o", str(tmp_path / "train"),
                         "--max-tokens", "12"]).exit_code == 0
    train = ["--predictor-train", str(tmp_path / "train" / "trace.npz")]
    saved = tmp_path / "eam.npz"
    if start == "warm":
        assert invoke(main, ["run", str(qwen3moe_model), "-p", "for i in", "-n", "12", "--cache-slots", "3",
                             "--predictor", "eam", *train, "--stats-out", str(saved)]).exit_code == 0
    source = train if start == "train" else ["--stats-in", str(saved)]
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = invoke(main, ["run", str(qwen3moe_model), "-p", "The quick brown fox jumps", "-n", "24", "--cache-slots",
                      "3", "--predictor", "eam", *source, "--stats-json", str(stats), "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    live = json.loads(stats.read_text())["layers"]
    r = invoke(main, ["simulate", str(tr / "trace.npz"), "--model", str(qwen3moe_model), "--cache-slots", "3",
                      "--predictor", "eam", "--predictor-s", "0", "--hw", "none", "--json", *source])
    assert r.exit_code == 0, r.output
    sim = json.loads(r.stdout[r.stdout.index("{"):])["results"][0]["stats"]["layers"]
    assert sum(s["prefetch_issued"] for s in sim.values()) > 0
    for il, s in sim.items():
        assert {f: s[f] for f in FIELDS} == {f: live[il][f] for f in FIELDS}, il


def test_simulate_both_decode_modes(tmp_path):
    """`ggmoe simulate --decode-mode sync,async`: both rows side by side, with and without a predictor (async:
    the mailbox's stride prefetch); async with miss policy cpu computes misses in its host part; hybrid refuses
    a policy other than auto."""
    tr = _trace(tmp_path, ["def main():"], 12)
    r = CliRunner().invoke(main, ["simulate", str(tr), "--cache-fraction", "0.5", "--decode-mode", "sync,async",
                                  "--predictor", "none,reuse", "--hw", "h100", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output[r.output.index("{"):])["results"]
    modes = sorted((x["decode_mode"], x["predictor"] or "none") for x in res)
    assert modes == [("async", "none"), ("async", "reuse"), ("sync", "none"), ("sync", "reuse")]
    by = {(x["decode_mode"], x["predictor"]): x for x in res}
    assert by[("async", None)]["stats"]["total"]["host_reads"] > 0 and by[("async", None)]["tpot_s"] > 0
    assert by[("async", "reuse")]["stats"]["total"]["prefetch_issued"] > 0
    r = CliRunner().invoke(main, ["simulate", str(tr), "--cache-fraction", "0.5", "--decode-mode", "async",
                                  "--miss-policy", "cpu", "--hw", "h100", "--json"])  # the async host part
    assert r.exit_code == 0, r.output
    total = json.loads(r.output[r.output.index("{"):])["results"][0]["stats"]["total"]
    assert total["host_computed"] > 0 and total["host_reads"] == 0
    r = CliRunner().invoke(main, ["simulate", str(tr), "--cache-fraction", "0.5", "--decode-mode", "hybrid",
                                  "--miss-policy", "wait"])
    assert r.exit_code == 2 and "needs --miss-policy auto" in r.output


SPLIT_FIELDS = (*FIELDS, "top_hits", "bottom_hits", "bottom_read_bytes", "bottom_prefetches",
                "bottom_prefetch_bytes", "host_reads", "host_read_bytes", "evictions")


@pytest.mark.parametrize("mode, flags", [
    ("sync", []),
    ("async", []),
    ("sync", ["--predictor", "skip-gate", "--stride", "1", "--prefetch", "4"]),
], ids=["sync", "async", "sync-skip-gate"])
def test_simulator_counts_equal_a_split_run(qwen3moe_model, tmp_path, mode, flags):
    """MoEpic's split replayed: a run whose layers hold top segments (θ 0.5, every other layer; the rest whole)
    and the simulator on its trace count the same full hits, top-only hits, bottom bytes read and prefetched,
    and misses. The trace comes from a sync run of the same greedy generation (the routing does not depend on
    the mode or the split)."""
    from ggmoe.cache.split import model_split

    facts = inspect_model(qwen3moe_model)
    theta = {il: 0.5 for j, il in enumerate(facts.moe_layers) if j % 2 == 0}
    plan = tmp_path / "plan.toml"
    opts = dict(zip(flags[::2], flags[1::2], strict=True))
    pre = (f'\n[prefetch]\npredictor = "{opts["--predictor"]}"\nstride = 1\nn_prefetch = {opts["--prefetch"]}\n'
           if flags else "")
    plan.write_text('[cache]\npolicy = "lru"\n[cache.slots]\n' + "".join(f'"{il}" = 3\n' for il in facts.moe_layers)
                    + "[cache.theta]\n" + "".join(f'"{il}" = {t}\n' for il, t in theta.items()) + pre)
    run = ["run", str(qwen3moe_model), "-p", "The quick brown fox jumps over", "-n", "24", "--config", str(plan)]
    stats, tr = tmp_path / "s.json", tmp_path / "trace"
    r = CliRunner().invoke(main, [*run, "--decode-mode", mode, "--stats-json", str(stats)])
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert d["decode_mode_in_effect"] == mode
    r = CliRunner().invoke(main, [*run, "--decode-mode", "sync", "--trace-out", str(tr)])
    assert r.exit_code == 0, r.output
    cfg = SimConfig(n_slots=dict.fromkeys(facts.moe_layers, 3), policy="lru", decode_mode=mode,
                    split=model_split(facts, theta), predictor=opts.get("--predictor"), stride=1,
                    n_prefetch=int(opts["--prefetch"]) if flags else None, predictor_s=0.0,
                    fills=mode == "async")  # the run's whole layers fill their misses (the async default)
    sim = simulate(load_trace(tr), cfg, {il: facts.bytes_per_expert(il) for il in facts.moe_layers}, None,
                   model_path=str(qwen3moe_model))
    total = sim.stats["total"]
    assert total["top_hits"] > 0 and total["bottom_read_bytes"] > 0
    if flags:
        assert total["bottom_prefetches"] > 0 and total["bottom_hits"] > 0
    last = str(max(facts.moe_layers))  # see test_simulator_counts_equal_the_async_engine: left out
    compared = [il for il in sim.stats["layers"] if il != last]
    for il in compared:
        s = sim.stats["layers"][il]
        assert {f: s[f] for f in SPLIT_FIELDS} == {f: d["layers"][il][f] for f in SPLIT_FIELDS}, il


def test_simulate_theta_rows(tmp_path):
    """`ggmoe simulate --theta 1,0.5`: whole-expert and split rows at the same bytes, side by side, both modes;
    a split row holds more (smaller) slots and counts top-only hits."""
    tr = _trace(tmp_path, ["def main():", "import os"], 12)
    r = CliRunner().invoke(main, ["simulate", str(tr), "--cache-fraction", "0.25", "--theta", "1,0.5",
                                  "--decode-mode", "sync,async", "--hw", "h100", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output[r.output.index("{"):])["results"]
    assert len(res) == 4
    whole = [x for x in res if "split" not in x["label"]]
    split = [x for x in res if "split" in x["label"]]
    assert len(whole) == len(split) == 2
    for w, s in zip(sorted(whole, key=lambda x: x["decode_mode"]), sorted(split, key=lambda x: x["decode_mode"]),
                    strict=True):
        assert all(s["slots_per_layer"][il] > n for il, n in w["slots_per_layer"].items())
        assert s["stats"]["total"]["top_hits"] > 0 and w["stats"]["total"]["top_hits"] == 0
        assert s["tpot_s"] > 0
    table = CliRunner().invoke(main, ["simulate", str(tr), "--cache-fraction", "0.25", "--theta", "0.5"])
    assert table.exit_code == 0 and "top hits" in table.output, table.output
    bad = CliRunner().invoke(main, ["simulate", str(tr), "--cache-fraction", "0.25", "--theta", "1.5"])
    assert bad.exit_code != 0 and bad.output.count("error:") == 1 and "--theta" in bad.output
