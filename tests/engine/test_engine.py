"""Engine on the CPU build: generation, host-side experts, gate hook, traces, error handling."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.base.errors import ModelFileError, UsageError
from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.cli import main
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.verify import check_hook
from ggmoe.inspect import inspect_model
from ggmoe.inspect.router import load_routers
from ggmoe.trace import load_trace


def test_generates_and_keeps_experts_on_host(arch_model):
    arch, path = arch_model
    facts = inspect_model(path)
    with Engine(EngineConfig(model_path=path, n_ctx=256)) as eng:
        gen = eng.generate("hello world", 8)
        assert 1 <= len(gen.token_ids) <= 8 or gen.stopped_on_eog
        assert all(0 <= t < eng.n_vocab for t in gen.token_ids)
        # Every expert tensor (and nothing else) went to the host buffer type.
        names = set(eng.host_expert_tensors)
        assert names and all("_exps" in n for n in names)
        assert {int(n.split(".")[1]) for n in names} == set(facts.moe_layers)


def test_greedy_is_deterministic(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256)) as eng:
        a = eng.generate("abc", 6)
        b = eng.generate("abc", 6)
    assert a.token_ids == b.token_ids


def test_hook_matches_numpy_router(arch_model):
    arch, path = arch_model
    facts = inspect_model(path)
    routers = load_routers(path)
    with Engine(EngineConfig(model_path=path, n_ctx=256)) as eng:
        res = check_hook(eng, routers, eng.tokenize("The quick brown fox jumps over the lazy dog 12345"),
                         facts.n_expert_used)
    assert res.n_layers == len(facts.moe_layers)
    assert res.ok, res


def test_hook_on_decode_steps_and_micro_batches(qwen3moe_model):
    """Events per micro-batch are joined per layer; decode steps give one row per layer."""
    rec = RouteRecorder(HookRequest(probs=True, hidden=False))
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=8, n_ubatch=4), observer=rec) as eng:
        ids = eng.tokenize("a somewhat longer prompt than one micro-batch")
        eng.decode(ids, all_logits=True)
        ev = rec.take()
        assert all(e.n_tokens == len(ids) and e.hidden is None for e in ev.values())
        eng.decode([ids[1]])
        assert all(e.n_tokens == 1 for e in rec.take().values())


def test_observer_exception_is_reraised_after_decode(qwen3moe_model):
    class Boom(RuntimeError):
        pass

    class Bad:
        request = HookRequest()

        def on_route(self, event):
            raise Boom("from the callback")

    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256)) as eng:
        with eng.observing(Bad()), pytest.raises(Boom):
            eng.decode(eng.tokenize("hello"))
        eng.reset()
        assert eng.decode(eng.tokenize("hello")).shape == (1, eng.n_vocab)


def test_logits_all_vs_last(qwen3moe_model):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256)) as eng:
        ids = eng.tokenize("logits for every token")
        all_rows = eng.decode(ids, all_logits=True)
        eng.reset()
        last = eng.decode(ids)
    assert all_rows.shape == (len(ids), last.shape[1])
    assert np.allclose(all_rows[-1], last[0], atol=1e-4)


@pytest.mark.parametrize("tokens, message", [
    ([], "nothing to decode"),
    ([10**7], "out of range"),
    ([1] * 300, "context full"),
])
def test_decode_rejects_bad_input(qwen3moe_model, tokens, message):
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256)) as eng:
        with pytest.raises(UsageError, match=message):
            eng.decode(tokens)


def test_bad_model_files(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        Engine(EngineConfig(model_path=tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelFileError):
        Engine(EngineConfig(model_path=junk))


def test_cli_run_json(qwen3moe_model):
    r = CliRunner().invoke(main, ["run", str(qwen3moe_model), "-p", "hi", "-n", "4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert len(d["token_ids"]) <= 4 and d["timings"]["prefill_tokens"] == len(d["prompt_ids"])
    assert d["timings"]["decode_tokens_per_s"] >= 0


@pytest.mark.parametrize("args, message", [
    (["run", "/nonexistent/model.gguf", "-p", "hi"], "not found"),
    (["run", "MODEL", "-p", "hi", "-n", "0"], "Invalid value"),
    (["trace", "MODEL", "--prompts", "/nonexistent.jsonl", "-o", "OUT"], "prompts file not found"),
    (["inspect", "/nonexistent/model.gguf"], "error"),
])
def test_cli_errors_are_one_line(qwen3moe_model, tmp_path, args, message):
    args = [str(qwen3moe_model) if a == "MODEL" else str(tmp_path) if a == "OUT" else a for a in args]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    assert message in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("mode, extra", [
    ("greedy", []),
    ("sample", ["--temp", "0.9", "--seed", "3"]),
    ("teacher", ["--prefill-tokens", "6"]),
])
def test_cli_trace_round_trip(qwen3moe_model, tmp_path, mode, extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return a + b\\n"}\n'
                       '{"text": "The cat sat on the mat and looked at the dog."}\n')
    out = tmp_path / "tr"
    r = CliRunner().invoke(main, ["trace", str(qwen3moe_model), "--prompts", str(prompts), "-o", str(out),
                                  "--max-tokens", "5", "--mode", mode, *extra])
    assert r.exit_code == 0, r.output
    tr = load_trace(out)
    facts = inspect_model(qwen3moe_model)
    assert tr.meta.mode == mode and tr.n_prompts == 2
    assert tr.layers.tolist() == list(facts.moe_layers)
    assert tr.ids.shape == (tr.n_tokens, len(facts.moe_layers), facts.n_expert_used)
    assert tr.hidden is not None and tr.hidden.shape[2] == facts.n_embd
    for p in range(2):
        stage = tr.stage[tr.prompt_slice(p)]
        assert stage.sum() == 5  # max-tokens decode steps were fed
        assert np.all(np.diff(tr.positions[tr.prompt_slice(p)]) == 1)
    if mode == "teacher":
        assert (tr.stage[tr.prompt_slice(0)] == 0).sum() == 6
    # probabilities agree with the selected ids: every selected expert is among the top-k probs
    k = facts.n_expert_used
    top = np.argsort(-tr.probs.astype(np.float32), axis=-1)[..., :k]
    agree = np.mean([set(a) == set(b) for a, b in zip(top.reshape(-1, k).tolist(), tr.ids.reshape(-1, k).tolist(),
                                                      strict=True)])
    assert agree > 0.98  # float16 rounding of probs may swap near ties


def test_cli_trace_no_hidden(qwen3moe_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x = 1"}\n')
    r = CliRunner().invoke(main, ["trace", str(qwen3moe_model), "--prompts", str(prompts), "-o",
                                  str(tmp_path / "t"), "--max-tokens", "2", "--no-hidden"])
    assert r.exit_code == 0, r.output
    assert load_trace(tmp_path / "t").hidden is None


@pytest.mark.parametrize("text, args, message", [
    ("short", ["--mode", "teacher"], "teacher mode needs at least 66 tokens"),
    ("x " * 400, ["--n-ctx", "64"], "do not fit n_ctx"),
])
def test_cli_trace_rejects_prompts_before_running(qwen3moe_model, tmp_path, text, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fine prompt " * 10}) + "\n" + json.dumps({"text": text}) + "\n")
    r = CliRunner().invoke(main, ["trace", str(qwen3moe_model), "--prompts", str(prompts), "-o",
                                  str(tmp_path / "t"), *args])
    assert r.exit_code == 2 and "prompt 2: " in r.output and message in r.output, r.output
    assert not (tmp_path / "t" / "trace.npz").exists()


def test_cli_trace_records_probabilities_per_gating(arch_model, tmp_path):
    """Every family's trace holds probabilities under probs (never logits) and, where the graph hands them
    (gpt-oss), the logits under logits: both agree with the selected experts."""
    arch, path = arch_model
    facts = inspect_model(path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The cat sat on the mat and looked at the dog."}\n')
    r = CliRunner().invoke(main, ["trace", str(path), "--prompts", str(prompts), "-o", str(tmp_path / "t"),
                                  "--max-tokens", "4", "--no-hidden"])
    assert r.exit_code == 0, r.output
    tr = load_trace(tmp_path / "t")
    assert tr.meta.version == 2 and tr.meta.gating == facts.gating.func
    assert tr.probs.min() >= 0
    assert (tr.logits is not None) == facts.gating.hook_gives_logits
    if facts.gating.func in ("softmax", "softmax_weight"):
        assert np.allclose(tr.probs.astype(np.float32).sum(axis=2), 1.0, atol=1e-2)
    if tr.logits is not None:  # gpt-oss selects on its biased logits: the top-k of the stored logits
        k = facts.n_expert_used
        top = np.argsort(-tr.logits.astype(np.float32), axis=-1)[..., :k]
        agree = np.mean([set(a) == set(b) for a, b in zip(top.reshape(-1, k).tolist(),
                                                          tr.ids.reshape(-1, k).tolist(), strict=True)])
        assert agree > 0.98
