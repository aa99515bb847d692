"""``train-predictor`` as a plugin (entry point, missing training packages in a real process, ``-o`` checked
before training, ``--kind linear``) and ``eval-predictor``'s summary, tiny-split warning and default model."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.cli import main
from ggmoe.predict.evaluate import default_model, held_out_warning
from ggmoe.trace import load_trace
from predictors.synthetic import planted_trace, synthetic_meta

pytestmark = pytest.mark.unit

EMBEDDED_FP = "3c46d809ad91fedb"  # tiny-moe.gguf (ggmoe/models/tiny-moe.md)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    planted_trace(d / "a.npz", n_prompts=40, tokens=12, group_by="token", noise=0.3, seed=3)
    return d


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _one_line_error(rc: int, stderr: str, text: str) -> None:
    assert rc == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], stderr


def _ggmoe(args: list[str], block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``ggmoe ARGS`` in a fresh interpreter (entry points as installed), with modules in ``block`` unimportable."""
    code = (f"import sys\nfor m in {list(block)!r}: sys.modules[m] = None\n"
            f"sys.argv = ['ggmoe', *{args!r}]\nfrom ggmoe.cli import main\nmain()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_entry_point_is_installed_and_help_works():
    eps = {ep.name: ep.value for ep in entry_points(group="ggmoe.commands")}
    assert eps.get("train-predictor") == "predictors.cli:train_predictor", \
        "re-run `pip install -e . --no-deps` so that the entry point is visible"
    res = _ggmoe(["train-predictor", "--help"])
    assert res.returncode == 0, res.stderr
    assert "--kind [mlp|linear]" in res.stdout and "-o, --out" in res.stdout


@pytest.mark.parametrize("kind, block, names", [
    ("mlp", ("torch",), "needs torch and tqdm"),
    ("linear", ("sklearn",), "needs scikit-learn and tqdm"),
])
def test_missing_training_package_says_how_to_get_it(traces, tmp_path, kind, block, names):
    res = _ggmoe(["train-predictor", str(traces / "a.npz"), "-o", str(tmp_path / "p.npz"), "--kind", kind], block)
    _one_line_error(res.returncode, res.stderr, f"--kind {kind} {names}: install ggmoe[train] "
                                                "(pip install 'ggmoe[train]')")
    assert not (tmp_path / "p.npz").exists()


@pytest.mark.parametrize("out, text", [
    ("{tmp}", "is a directory"),
    ("/dev/null", "is a device"),
    ("{tmp}/f/p.npz", "ot a directory"),  # "Not a directory" (ENOTDIR) or "... is not a directory"
])
def test_bad_output_fails_before_loading_or_training(tmp_path, out, text):
    (tmp_path / "f").write_text("a file, not a directory")
    # the traces do not exist: the -o error must come first, so nothing was loaded or trained
    for kind in ("mlp", "linear"):
        res = _run("train-predictor", str(tmp_path / "missing.npz"), "-o", out.format(tmp=tmp_path), "--kind", kind)
        _one_line_error(res.exit_code, res.stderr, text)


def test_alpha_is_for_linear_only(traces, tmp_path):
    res = _run("train-predictor", str(traces / "a.npz"), "-o", str(tmp_path / "p.npz"), "--alpha", "1")
    _one_line_error(res.exit_code, res.stderr, "--alpha is a setting of --kind linear")


def test_linear_trains_exports_and_evaluates(traces, tmp_path):
    pytest.importorskip("sklearn")
    pred = tmp_path / "lin.npz"
    res = _run("train-predictor", str(traces / "a.npz"), "-o", str(pred), "--kind", "linear", "--stride", "1",
               "--stride", "2", "--alpha", "0.1", "--alpha", "10", "--dtype", "float16")
    assert res.exit_code == 0, res.output
    assert f"{pred}: 5 nets" in res.stdout
    with np.load(pred, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes())
        assert sorted(z.files) == sorted(["meta", *(f"net{i}.{k}" for i in range(5) for k in ("w", "b", "mean", "std"))])
        assert z["net0.w"].dtype == np.float16 and z["net0.w"].shape == (8, 16)
    assert meta["kind"] == "linear" and meta["hidden"] == 0
    assert all(n["metrics"]["alpha"] in (0.1, 10.0) and set(n["metrics"]["cv_accuracy"]) == {"0.1", "10.0"}
               for n in meta["nets"])
    # train-predictor and eval-predictor hold out the same prompts (the seeded numpy split)
    res = _run("eval-predictor", str(traces / "a.npz"), "-p", str(pred), "-p", "oracle", "--stride", "2", "--json")
    assert res.exit_code == 0, res.output
    lin, oracle = json.loads(res.stdout)["results"]
    assert lin["n_prompts"] == meta["training"]["n_val_prompts"] == 4
    # 8 planted clusters in 16 dimensions are linearly separable: near the oracle, far above chance (k/E = 0.25)
    assert lin["overall"]["accuracy"] >= 0.9 and oracle["overall"]["accuracy"] == 1.0


def test_eval_summary_table_and_tiny_split_warning(traces):
    res = _run("eval-predictor", str(traces / "a.npz"), "-p", "oracle", "-p", "reuse")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    i = lines.index(next(line for line in lines if line.startswith("summary: ")))
    assert lines[i] == "summary: stride 1, k=2, prefetch m=4, 4 held-out prompts, 48 tokens"
    assert lines[i + 1].split() == ["predictor", "accuracy", "recall@4", "prec@4", "p50", "us"]
    assert lines[i + 2].split()[:4] == ["oracle", "1.000", "1.000", "0.500"] and lines[i + 3].startswith("reuse ")
    assert len(lines) == i + 4
    assert "warning: only 4 held-out prompt(s) / 48 tokens" in res.stderr
    res = _run("eval-predictor", str(traces / "a.npz"), "--train", str(traces / "a.npz"), "-p", "reuse", "--json")
    assert res.exit_code == 0 and "warning" not in res.stderr  # 40 prompts, 480 tokens
    json.loads(res.stdout)


def test_held_out_warning_thresholds(traces):
    t = load_trace(traces / "a.npz")
    from ggmoe.trace.data import select_prompts

    assert held_out_warning(t) is None
    assert "only 4 held-out" in held_out_warning(select_prompts(t, np.arange(4)))
    assert held_out_warning(select_prompts(t, np.arange(5))) is not None  # 60 tokens < 200
    assert held_out_warning(select_prompts(t, np.arange(17))) is None  # 17 prompts, 204 tokens


def test_skip_gate_defaults_to_the_embedded_model_only_for_its_traces(tmp_path):
    if default_model(EMBEDDED_FP) is None:
        pytest.skip("this install does not ship the embedded model")
    assert default_model("0123456789abcdef") is None
    meta = synthetic_meta(n_layer=8, n_expert=32, k=4, n_embd=256, fingerprint=EMBEDDED_FP)
    planted_trace(tmp_path / "e.npz", n_prompts=6, tokens=6, meta=meta, seed=1)
    res = _run("eval-predictor", str(tmp_path / "e.npz"), "--train", str(tmp_path / "e.npz"), "-p", "skip-gate",
               "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][0]["overall"]["n"] > 0
    planted_trace(tmp_path / "o.npz", n_prompts=6, tokens=6, meta=synthetic_meta(n_layer=8, n_expert=32, k=4,
                  n_embd=256, fingerprint="0123456789abcdef"), seed=1)
    res = _run("eval-predictor", str(tmp_path / "o.npz"), "-p", "skip-gate")
    _one_line_error(res.exit_code, res.stderr, "needs the model's GGUF")
