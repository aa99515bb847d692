"""Predictor files of another mode, stride or model, and planners that cannot plan: each refused in one
``error:`` line naming what differs (exit 2, no traceback), whichever command reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import Outcome, assert_clean_error, run_ggmoe

from ggmoe.cli import main
from ggmoe.models import default_model_path
from tools.fixtures.make_fixtures import fixture_path
from tools.fixtures.random_predictor import random_predictor_file

pytestmark = pytest.mark.badinput


def _in_process(args: list[str]) -> Outcome:
    r = CliRunner().invoke(main, args)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Outcome(r.exit_code, r.stdout, r.stderr)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Predictor files for the qwen3moe fixture (mode layer stride 1, mode token) and one for another model."""
    tmp = tmp_path_factory.mktemp("modes")
    model = fixture_path("qwen3moe")
    return {"MODEL": str(model),
            "LAYER": str(random_predictor_file(model, tmp / "layer.npz", hidden=8, stride=1)),
            "TOKEN": str(random_predictor_file(model, tmp / "token.npz", hidden=8, mode="token")),
            "OTHER": str(random_predictor_file(default_model_path(), tmp / "other.npz", hidden=8, mode="token")),
            "PROMPTS": str(_prompts(tmp / "p1.jsonl")), "TMP": str(tmp)}


def _prompts(path: Path) -> Path:
    path.write_text(json.dumps({"prompt": "def fib(n):"}) + "\n")
    return path


def _subst(args: tuple[str, ...], files: dict[str, str]) -> list[str]:
    return [files.get(a, a.replace("TMP", files["TMP"])) for a in args]


RUN = ("run", "MODEL", "-p", "hi", "--cache-slots", "4", "-n", "2")
REFUSED = {  # the engine reads the file: one line naming what differs
    "--predictor of mode token": (RUN + ("--predictor", "TOKEN"),
                                  "trained for mode token, stride 1; this run needs mode layer, stride 2"),
    "--predictor at another stride": (RUN + ("--predictor", "LAYER", "--stride", "2"),
                                      "trained for stride 1; this run needs stride 2"),
    "--plan-predictor of mode layer": (RUN + ("--plan-predictor", "LAYER"),
                                       "trained for mode layer, stride 1; this run needs mode token, stride 1"),
    "--plan-predictor of another model": (RUN + ("--plan-predictor", "OTHER"), "this run needs model "),
    "--plan-predictor that cannot plan": (RUN + ("--plan-predictor", "skip-gate"),
                                          "planner 'skip-gate' does not predict the next token's experts"),
    "--plan-predictor unknown": (RUN + ("--plan-predictor", "nope"), "unknown predictor 'nope'"),
    "--plan-predictor missing file": (RUN + ("--plan-predictor", "TMP/missing.npz"), "predictor file not found"),
    "--plan-predictor without a cache": (("run", "MODEL", "-p", "hi", "--plan-predictor", "reuse"),
                                         "--plan-predictor needs a cache size"),
    "--plan-predictor that learns, no traces": (RUN + ("--plan-predictor", "eam"), "learns from traces"),
    "trace --lockstep without a predictor": (("trace", "MODEL", "--prompts", "PROMPTS", "-o", "TMP/lk",
                                              "--cache-slots", "4", "--lockstep"),
                                             "--lockstep and --no-lockstep set how the predictor's reader runs"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_run_refuses_a_predictor_of_another_mode_stride_or_model(case, files):
    args, match = REFUSED[case]
    assert_clean_error(run_ggmoe(*_subst(args, files), timeout=60), match)


@pytest.fixture(scope="module")
def traces(files) -> str:
    """A trace of the fixture with decode steps (two prompts)."""
    tmp = Path(files["TMP"])
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def fib(n):", "the cat sat")))
    out = run_ggmoe("trace", files["MODEL"], "--prompts", str(prompts), "-o", str(tmp / "traces"),
                    "--max-tokens", "4", timeout=120)
    assert out.code == 0, out.stderr[-2000:]
    return str(tmp / "traces")


OFFLINE = {  # pure Python: through click's runner
    "simulate --plan-predictor of mode layer": (
        ("simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--plan-predictor", "LAYER"),
        "trained for mode layer, stride 1; this run needs mode token, stride 1"),
    "simulate --plan-predictor that cannot plan": (
        ("simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--plan-predictor", "token"),
        "planner 'token' does not predict the next token's experts"),
    "simulate --predictor of mode token": (
        ("simulate", "TRACES", "--model", "MODEL", "--cache-slots", "4", "--predictor", "TOKEN", "--stride", "1"),
        "trained for mode token, stride 1; this run needs mode layer, stride 1"),
    "eval-predictor of mode token": (("eval-predictor", "TRACES", "--train", "TRACES", "-p", "TOKEN"),
                                     "trained for mode token, stride 1; this run needs mode layer, stride 1"),
    "train-predictor --mode token --multi": (("train-predictor", "TRACES", "-o", "TMP/t.npz", "--mode", "token",
                                              "--multi"), "--stride and --multi are --mode layer's"),
    "train-predictor --mode token --stride 2": (("train-predictor", "TRACES", "-o", "TMP/t.npz", "--mode", "token",
                                                 "--stride", "2"), "--stride and --multi are --mode layer's"),
    "train-predictor --mode chunk": (("train-predictor", "TRACES", "-o", "TMP/t.npz", "--mode", "chunk"),
                                     "Invalid value for '--mode'"),
}


@pytest.mark.parametrize("case", sorted(OFFLINE))
def test_offline_commands_refuse_a_predictor_of_another_mode(case, files, traces):
    args, match = OFFLINE[case]
    out = _in_process([traces if a == "TRACES" else a for a in _subst(args, files)])
    assert_clean_error(out, match)
    assert not (Path(files["TMP"]) / "t.npz").exists()  # nothing written


def test_train_predictor_mode_token_needs_decode_steps(files, tmp_path):
    pytest.importorskip("torch")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat on the mat"}) + "\n" + json.dumps({"prompt": "a b"}) + "\n")
    out = run_ggmoe("trace", files["MODEL"], "--prompts", str(prompts), "-o", str(tmp_path / "tr"),
                    "--max-tokens", "1", timeout=120)  # one decode step per prompt: no pair of decode tokens
    assert out.code == 0, out.stderr[-2000:]
    out = _in_process(["train-predictor", str(tmp_path / "tr"), "-o", str(tmp_path / "t.npz"), "--mode", "token"])
    assert_clean_error(out, "--mode token learns from consecutive decode tokens of one sequence")
    assert not (tmp_path / "t.npz").exists()
