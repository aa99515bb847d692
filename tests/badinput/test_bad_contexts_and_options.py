"""Bad inputs of issue 20's classes: prompts against the context and the batch (every command that evaluates
prompts, the server and ``ggmoe.load()``), typed and bounded options of predictors and policies, output paths
of every command (``--plot`` included), empty or missing MODEL arguments, empty names, and traces given as
the directory ``trace -o`` wrote. Each bad case ends in exactly one ``error:`` line and exit 2, no traceback,
nothing written.

Cases that reach llama.cpp run in a subprocess; the ones refused before it run through click's runner.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from conftest import Outcome, assert_clean_error, run_ggmoe

from ggmoe.cli import main
from tools.fixtures.make_fixtures import fixture_path

pytestmark = pytest.mark.badinput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from server_process import start_server, stop_server  # noqa: E402 - the serve tier's process helpers

N_CTX = 16  # asked for; llama.cpp makes 256 of it but feeds at most 16 tokens per decode
OVER_BATCH = "hello there " * 10  # ~70 tokens of the fixture: over the batch, within the context
OVER_CTX = "hello there " * 60  # ~420 tokens: over the context llama.cpp makes


def _in_process(args: list[str], stdin: str | None = None) -> Outcome:
    r = CliRunner().invoke(main, args, input=stdin)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Outcome(r.exit_code, r.stdout, r.stderr)


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("qwen3moe"))


@pytest.fixture(scope="module")
def traced(tmp_path_factory, model) -> Path:
    """What ``ggmoe trace -o DIR`` wrote for three prompts, one of them longer than a decode's batch: the
    command that aborted in llama.cpp (GGML_ASSERT n_tokens_all <= n_batch) before issue 20."""
    tmp = tmp_path_factory.mktemp("traced")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (OVER_BATCH, "def fib(n):", "the cat")))
    out = run_ggmoe("trace", model, "--prompts", str(prompts), "-o", str(tmp / "traces"), "--max-tokens", "4",
                    "--n-ctx", str(N_CTX), timeout=120)
    assert out.code == 0, out.stderr[-2000:]
    assert (tmp / "traces" / "trace.npz").is_file()
    return tmp / "traces"


# --------------------------------------------------------------------------- prompts against context and batch

def test_trace_over_the_context_fails_before_any_prompt(model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": OVER_CTX}) + "\n")
    out = run_ggmoe("trace", model, "--prompts", str(prompts), "-o", str(tmp_path / "o"), "--max-tokens", "4",
                    "--n-ctx", str(N_CTX))
    assert_clean_error(out, "prompt 2: ")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("prompt,ok", [(OVER_BATCH, True), (OVER_CTX, False)], ids=["over the batch", "over the ctx"])
def test_run_prompt_against_context_and_batch(model, tmp_path, prompt, ok):
    p = tmp_path / "prompt.txt"
    p.write_text(prompt)
    out = run_ggmoe("run", model, "--prompt-file", str(p), "-n", "4", "--n-ctx", str(N_CTX), "--trace-out",
                    str(tmp_path / "t"))
    if ok:
        assert out.code == 0, out.stderr[-2000:]
        assert (tmp_path / "t" / "trace.npz").is_file()
    else:
        assert_clean_error(out, "the prompt: ")
        assert not (tmp_path / "t").exists()
        assert prompt[:20] not in out.stdout  # refused before anything was printed


def test_verify_hook_prompt_over_the_context(model):
    assert_clean_error(run_ggmoe("verify-hook", model, "-p", "hello there " * 200), "-p: ")


@pytest.mark.parametrize("message,ok", [(OVER_BATCH, True), (OVER_CTX, False)], ids=["over the batch", "over the ctx"])
def test_chat_message_against_context_and_batch(model, message, ok):
    out = run_ggmoe("chat", model, "--n-ctx", str(N_CTX), "-n", "2", "--temp", "0", stdin=message + "\n")
    if ok:
        assert out.code == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    else:
        assert_clean_error(out, "the conversation: ")


LOAD_SCRIPT = """
import json, sys, ggmoe
from ggmoe.base.errors import ContextLengthError
llama = ggmoe.load(sys.argv[1], n_ctx=16)
out = {"usage": llama.create_completion(sys.argv[2], max_tokens=2)["usage"]}
for name, call in (("completion", lambda: llama.create_completion(sys.argv[3], max_tokens=2)),
                   ("generate", lambda: next(llama.generate(llama.tokenize(sys.argv[3].encode()), temp=0)))):
    try:
        call()
        out[name] = "accepted"
    except ContextLengthError as e:
        out[name] = "ContextLengthError: " + str(e)
    except ValueError as e:
        out[name] = "ValueError: " + str(e)
print(json.dumps(out))
"""


def test_load_prompt_against_context_and_batch(model):
    """ggmoe.load(): a prompt over the batch runs, one over the context is a ValueError (ContextLengthError
    where ggmoe.base.context sees it first), never an abort."""
    res = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, model, OVER_BATCH, OVER_CTX], capture_output=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    out = json.loads(res.stdout.decode().strip().splitlines()[-1])
    assert out["usage"]["prompt_tokens"] > N_CTX
    assert out["completion"].startswith("ValueError: Requested tokens")  # llama-cpp-python's own check first
    assert out["generate"].startswith("ContextLengthError: the prompt: ")


LOAD_CASES = {
    "path empty": 'path=""',
    "path missing": 'path="TMP/nope.gguf"',
    "cache_slots 0": "cache_slots=0",
    "cache_slots 10**9": "cache_slots=10**9",
    "vram 1 and 400 zeros": 'vram="1" + "0" * 400',
    "policy empty": 'cache_slots=4, policy=""',
    "predictor empty": 'cache_slots=4, predictor=""',
    "miss_policy unknown": 'cache_slots=4, miss_policy="x"',
    "hw empty": 'cache_slots=4, miss_policy="auto", hw=""',
    "n_ctx -1": "n_ctx=-1",
    "n_ctx 10**12": "n_ctx=10**12",
    "prefetch_threshold nan": 'cache_slots=4, predictor="reuse", prefetch_threshold=float("nan")',
    "policy option out of bounds": 'cache=CacheConfig(n_slots=4, policy="fmoe", policy_options={"window": 0})',
    "policy option unknown": 'cache=CacheConfig(n_slots=4, policy="lru", policy_options={"window": 4})',
    "theta above 1": 'cache=CacheConfig(n_slots=4, layer_theta={0: 1.5})',
    "theta of no MoE layer": 'cache=CacheConfig(n_slots=4, layer_theta={99: 0.5})',
    "config missing": 'config="TMP/nope.toml"',
    "config and cache options": 'config="TMP/nope.toml", cache_slots=4',
}
LOAD_CASES_SCRIPT = """
import json, sys, ggmoe
from ggmoe.cache import CacheConfig
from ggmoe.base.errors import GgmoeError
out = {}
for name, kwargs in json.loads(sys.argv[1]).items():
    try:
        ggmoe.load(**eval(f"dict({kwargs})")).close()
        out[name] = "loaded"
    except GgmoeError as e:
        out[name] = "GgmoeError: " + str(e)
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def load_outcomes(tmp_path_factory) -> dict[str, str]:
    """Every LOAD_CASES call of ggmoe.load(), in one subprocess (a hang or an abort is a result there)."""
    tmp = tmp_path_factory.mktemp("load")
    cases = {k: v.replace("TMP", str(tmp)) for k, v in LOAD_CASES.items()}
    res = subprocess.run([sys.executable, "-c", LOAD_CASES_SCRIPT, json.dumps(cases)], capture_output=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_load_refuses_bad_arguments_with_a_domain_error(case, load_outcomes):
    assert load_outcomes[case].startswith("GgmoeError: "), load_outcomes[case]


def test_server_prompt_against_context_and_batch(model, tmp_path):
    server = start_server(tmp_path, model, "--n-ctx", str(N_CTX))
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as c:
            ok = c.post("/v1/completions", json={"prompt": OVER_BATCH, "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            bad = c.post("/v1/completions", json={"prompt": OVER_CTX, "max_tokens": 2})
            assert bad.status_code == 400, bad.text
            assert set(bad.json()["error"]) >= {"message", "type", "code"}
            assert c.get("/health").status_code == 200
    finally:
        assert stop_server(server) == 0, open(server.log).read()


# --------------------------------------------------------------------------- predictor and policy options

OPT_CASES = {
    "decay=abc": ("reuse", "decay=abc", "not a number"),
    "decay=nan": ("reuse", "decay=nan", "not a finite number"),
    "decay=1": ("reuse", "decay=1", "out of bounds"),
    "capacity=abc": ("eam", "capacity=abc", "not an integer"),
    "capacity=2.5": ("eam", "capacity=2.5", "not an integer"),
    "capacity=1e12": ("eam", "capacity=1e12", "not an integer"),
    "capacity=10**12": ("expert-map", f"capacity={10**12}", "out of bounds"),
    "capacity=0": ("eam", "capacity=0", "out of bounds"),
    "n_match=-1": ("eam", "n_match=-1", "out of bounds"),
    "online=maybe": ("expert-map", "online=maybe", "not true or false"),
    "unknown": ("reuse", "window=4", "not accepted by"),
    "internal routers": ("skip-gate", "routers=1", "not accepted by"),
    "no value": ("reuse", "decay", "expected KEY=VALUE"),
    "no key": ("reuse", "=0.5", "expected KEY=VALUE"),
    "twice": ("reuse", "decay=0.1 decay=0.2", "given twice"),
    "model empty": ("skip-gate", "model=", "is empty"),
}


@pytest.mark.parametrize("case", list(OPT_CASES))
def test_bad_predictor_option(case, traced):
    spec, opts, match = OPT_CASES[case]
    args = ["eval-predictor", str(traced), "-p", spec]
    for o in opts.split(" "):
        args += ["--opt", o]
    assert_clean_error(_in_process(args), match)


PLAN_CASES = {
    "policy option out of bounds": ('policy = "fmoe"', "[cache.policy_options]\nwindow = 0\n", "out of bounds"),
    "policy option a float": ('policy = "fmoe"', "[cache.policy_options]\nwindow = 1e12\n", "must be an int"),
    "policy option huge": ('policy = "fmoe"', "[cache.policy_options]\nwindow = 1000000000000\n", "out of bounds"),
    "policy option unknown": ('policy = "lru"', "[cache.policy_options]\nwindow = 4\n", "unknown option"),
    "policy option internal": ('policy = "static"', '[cache.policy_options]\ncounts = "x"\n', "unknown option"),
    "slots huge": ('policy = "lru"', "", "at most 65536"),
    "stride huge": ('policy = "lru"', '[prefetch]\npredictor = "reuse"\nstride = 99999\n', "stride"),
    "predictor empty": ('policy = "lru"', '[prefetch]\npredictor = ""\n', "predictor is empty"),
    "policy empty": ('policy = ""', "", "unknown policy ''"),
    "theta above 1": ('policy = "lru"', '[cache.theta]\n"0" = 1.5\n', "top shares numbers from 0 to 1"),
    "theta nan": ('policy = "lru"', '[cache.theta]\n"0" = nan\n', "top shares numbers from 0 to 1"),
    "theta a string": ('policy = "lru"', '[cache.theta]\n"0" = "half"\n', "top shares numbers from 0 to 1"),
    "theta not a table": ('policy = "lru"\ntheta = 0.5', "", "[cache.theta] must map"),
    "theta of a layer without slots": ('policy = "lru"', '[cache.theta]\n"99" = 0.5\n', "which [cache.slots] does not"),
    "theta with the host path": ('policy = "lru"\nmiss_policy = "cpu"', '[cache.theta]\n"0" = 0.5\n', "host path"),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_bad_plan_file_option(case, model, tmp_path):
    policy, extra, match = PLAN_CASES[case]
    slots = 10**12 if case == "slots huge" else 4
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[cache]\n{policy}\n[cache.slots]\n"0" = {slots}\n"1" = 4\n"2" = 4\n"3" = 4\n{extra}')
    assert_clean_error(_in_process(["run", model, "-p", "hi", "--config", str(plan)]), match)


# --------------------------------------------------------------------------- output paths, MODEL, names

def _regular(tmp: Path) -> Path:
    p = tmp / "afile"
    p.write_text("x")
    return p


PLOT_CASES = {
    "eval-predictor --plot out.xyz": lambda t, tr, m: ["eval-predictor", tr, "-p", "reuse", "--plot", f"{t}/o.xyz"],
    "eval-predictor --plot under a file": lambda t, tr, m: ["eval-predictor", tr, "-p", "reuse", "--plot",
                                                            f"{_regular(t)}/o.png"],
    "eval-predictor --plot is a dir": lambda t, tr, m: ["eval-predictor", tr, "-p", "reuse", "--plot", str(t)],
    "eval-predictor --plot a device": lambda t, tr, m: ["eval-predictor", tr, "-p", "reuse", "--plot", "/dev/null"],
    "simulate --plot out.xyz": lambda t, tr, m: ["simulate", tr, "--model", m, "--cache-slots", "4", "--plot",
                                                 f"{t}/o.xyz"],
    "simulate --plot under a file": lambda t, tr, m: ["simulate", tr, "--model", m, "--cache-slots", "4", "--plot",
                                                      f"{_regular(t)}/o.png"],
    "compare-quants --plot out.xyz": lambda t, tr, m: ["compare-quants", m, "--traces", tr, "--vram", "1MiB",
                                                       "--plot", f"{t}/o.xyz"],
    "plan -o under a file": lambda t, tr, m: ["plan", m, "--vram", "1MiB", "--traces", tr, "-o",
                                              f"{_regular(t)}/p.toml"],
}


@pytest.mark.parametrize("case", list(PLOT_CASES))
def test_bad_output_path_fails_before_any_work(case, traced, model, tmp_path):
    args = PLOT_CASES[case](tmp_path, str(traced), model)
    before = _files(tmp_path)
    assert_clean_error(_in_process(args))
    assert _files(tmp_path) == before


# every command with a MODEL argument (or --model), with MODEL standing for the value under test
MODEL_COMMANDS = {
    "inspect": ["inspect", "MODEL"],
    "run": ["run", "MODEL", "-p", "hi", "-n", "2"],
    "trace": ["trace", "MODEL", "--prompts", "PROMPTS", "-o", "TMP/o", "--max-tokens", "2"],
    "verify-hook": ["verify-hook", "MODEL"],
    "calibrate": ["calibrate", "MODEL", "-o", "TMP/c.toml", "--tokens", "4", "--repeat", "1"],
    "plan": ["plan", "MODEL", "--vram", "1MiB", "--traces", "TRACES", "-o", "TMP/p.toml"],
    "serve": ["serve", "MODEL", "--port", "BUSY"],  # a port in use: a server never starts in the test process
    "chat": ["chat", "MODEL"],
    "quantize": ["quantize", "MODEL", "-o", "TMP/q.gguf", "--type", "Q8_0"],
    "compare-quants": ["compare-quants", "MODEL", "--traces", "TRACES", "--vram", "1MiB"],
    "simulate --model": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4"],
    "eval-predictor --model": ["eval-predictor", "TRACES", "-p", "skip-gate", "--model", "MODEL"],
}
MODEL_VALUES = {"empty": ("", "is empty"), "blank": ("  ", "is empty"), "missing": ("TMP/nope.gguf", "no such file"),
                "a directory": ("TMP", "is a directory")}


@pytest.mark.parametrize("value", list(MODEL_VALUES))
@pytest.mark.parametrize("cmd", list(MODEL_COMMANDS))
def test_model_argument_must_be_an_existing_file(cmd, value, traced, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    given, match = MODEL_VALUES[value]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        subst = {"MODEL": given.replace("TMP", str(tmp_path)), "PROMPTS": str(prompts), "TRACES": str(traced),
                 "BUSY": str(busy.getsockname()[1])}
        args = [subst.get(a, a.replace("TMP", str(tmp_path))) for a in MODEL_COMMANDS[cmd]]
        before = _files(tmp_path)
        assert_clean_error(_in_process(args, stdin=""), match)
    assert _files(tmp_path) == before


NAME_CASES = {
    "run --policy ''": ["run", "MODEL", "-p", "hi", "--cache-slots", "4", "--policy", ""],
    "run --predictor ''": ["run", "MODEL", "-p", "hi", "--cache-slots", "4", "--predictor", ""],
    "run --hw ''": ["run", "MODEL", "-p", "hi", "--cache-slots", "4", "--miss-policy", "auto", "--hw", ""],
    "trace --policy ''": ["trace", "MODEL", "--prompts", "PROMPTS", "-o", "TMP/o", "--cache-slots", "4",
                          "--policy", ""],
    "simulate --policy ''": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--policy", ""],
    "simulate --policy lru,,lfu": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--policy",
                                   "lru,,lfu"],
    "simulate --predictor ''": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--predictor", ""],
    "simulate --miss-policy ''": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--miss-policy",
                                  ""],
    "simulate --hw ''": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--hw", ""],
    "plan --hw ''": ["plan", "MODEL", "--vram", "1MiB", "--traces", "TRACES", "-o", "TMP/p.toml", "--hw", ""],
    "compare-quants --policy ''": ["compare-quants", "MODEL", "--traces", "TRACES", "--vram", "1MiB", "--policy",
                                   ""],
    "compare-quants --miss-policy ''": ["compare-quants", "MODEL", "--traces", "TRACES", "--vram", "1MiB",
                                        "--miss-policy", ""],
    "eval-predictor -p ''": ["eval-predictor", "TRACES", "-p", ""],
    "calibrate --base ''": ["calibrate", "MODEL", "--base", "", "--tokens", "4", "--repeat", "1"],
    "calibrate --name ''": ["calibrate", "MODEL", "--name", "", "--tokens", "4", "--repeat", "1"],
    "run --vram 1 and 400 zeros": ["run", "MODEL", "-p", "hi", "--vram", "1" + "0" * 400],
    "simulate --vram 1e36": ["simulate", "TRACES", "--model", "MODEL", "--vram", "1" + "0" * 36],
    "plan --vram 1 and 400 zeros": ["plan", "MODEL", "--vram", "1" + "0" * 400, "--traces", "TRACES", "-o",
                                    "TMP/p.toml"],
}


@pytest.mark.parametrize("case", list(NAME_CASES))
def test_empty_names_and_huge_sizes(case, traced, model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    subst = {"MODEL": model, "PROMPTS": str(prompts), "TRACES": str(traced)}
    args = [subst.get(a, a.replace("TMP", str(tmp_path))) for a in NAME_CASES[case]]
    before = _files(tmp_path)
    assert_clean_error(_in_process(args))
    assert _files(tmp_path) == before


@pytest.mark.parametrize("flag,value,match", [("--model-name", "", "--model-name"), ("--max-body", "0", "--max-body"),
                                              ("--max-body", "1" + "0" * 400, "larger than 1 EiB")],
                         ids=["model-name empty", "max-body 0", "max-body huge"])
def test_serve_flags_that_would_serve_nothing(flag, value, match, model):
    """In a subprocess with a time limit: a regression would start a server, not hang the tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert_clean_error(run_ggmoe("serve", model, "--port", port, flag, value, timeout=30), match)


@pytest.mark.parametrize("extra,match", [
    (["--vram", "4GiB"], "--fit chooses the cache: leave out --vram"),
    (["--cache-slots", "4", "--decode-mode", "sync"], "leave out --cache-slots, --decode-mode"),
    (["--config", "plan.toml"], "leave out --config"),
], ids=["vram", "slots and decode mode", "config"])
def test_serve_fit_refuses_cache_flags(extra, match, model):
    """--fit chooses the cache: a cache flag beside it is one error, before the model loads or a server starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert_clean_error(run_ggmoe("serve", model, "--port", port, "--fit", *extra, timeout=30), match)


# --------------------------------------------------------------------------- traces as trace -o wrote them

READERS = {
    "simulate": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4"],
    "plan --traces": ["plan", "MODEL", "--vram", "1MiB", "--traces", "TRACES", "-o", "TMP/p.toml"],
    "compare-quants --traces": ["compare-quants", "MODEL", "--traces", "TRACES", "--vram", "1MiB"],
    "eval-predictor": ["eval-predictor", "TRACES", "-p", "reuse"],
    "simulate --predictor-train": ["simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--predictor",
                                   "token", "--predictor-train", "TRACES"],
}


@pytest.mark.parametrize("form", ["directory", "npz"])
@pytest.mark.parametrize("cmd", list(READERS))
def test_every_trace_reader_takes_what_trace_wrote(cmd, form, traced, model, tmp_path):
    traces = str(traced) if form == "directory" else str(traced / "trace.npz")
    subst = {"MODEL": model, "TRACES": traces}
    args = [subst.get(a, a.replace("TMP", str(tmp_path))) for a in READERS[cmd]]
    out = _in_process(args)
    assert out.code == 0, out.stderr[-2000:]


@pytest.mark.parametrize("cmd", ["eval-predictor", "simulate"])
def test_a_good_plot_is_written_whole(cmd, traced, model, tmp_path):
    png = tmp_path / "sub" / "plot.png"
    args = (["eval-predictor", str(traced), "-p", "reuse"] if cmd == "eval-predictor"
            else ["simulate", str(traced), "--model", model, "--cache-slots", "4"]) + ["--plot", str(png)]
    out = _in_process(args)
    assert out.code == 0, out.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["plot.png"]  # no temporary left beside it


# flags that took nan, inf or a negative seed without a word (chat, eval-predictor, train-predictor)
NUMBER_CASES = {
    "chat --temp nan": ["chat", "MODEL", "--temp", "nan"],
    "chat --temp inf": ["chat", "MODEL", "--temp", "inf"],
    "chat --seed -1": ["chat", "MODEL", "--seed", "-1"],
    "chat --seed 2**70": ["chat", "MODEL", "--seed", str(2**70)],
    "eval-predictor --seed -1": ["eval-predictor", "TRACES", "-p", "reuse", "--seed", "-1"],
    "eval-predictor --val-frac nan": ["eval-predictor", "TRACES", "-p", "reuse", "--val-frac", "nan"],
    "train-predictor --lr nan": ["train-predictor", "TRACES", "-o", "TMP/p.npz", "--lr", "nan"],
    "train-predictor --lr inf": ["train-predictor", "TRACES", "-o", "TMP/p.npz", "--lr", "inf"],
    "train-predictor --alpha inf": ["train-predictor", "TRACES", "-o", "TMP/p.npz", "--alpha", "inf"],
    "train-predictor --dropout nan": ["train-predictor", "TRACES", "-o", "TMP/p.npz", "--dropout", "nan"],
    "train-predictor --val-frac nan": ["train-predictor", "TRACES", "-o", "TMP/p.npz", "--val-frac", "nan"],
    "train-predictor --seed -1": ["train-predictor", "TRACES", "-o", "TMP/p.npz", "--seed", "-1"],
}


@pytest.mark.parametrize("case", list(NUMBER_CASES))
def test_non_finite_numbers_and_negative_seeds(case, traced, model, tmp_path):
    subst = {"MODEL": model, "TRACES": str(traced)}
    args = [subst.get(a, a.replace("TMP", str(tmp_path))) for a in NUMBER_CASES[case]]
    before = _files(tmp_path)
    assert_clean_error(_in_process(args, stdin=""))
    assert _files(tmp_path) == before
