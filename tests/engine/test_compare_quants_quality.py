"""compare-quants' quality and measured speed (issue 46) on a fixture at three levels: F16, Q8_0 and Q4_0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_run import ggmoe

import ggmoe as package
from tools.fixtures.make_fixtures import fixture_path

QUALITY = ["--ctx", "64", "--chunks", "6"]


@pytest.fixture(scope="module")
def levels(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("levels")
    shutil.copy(fixture_path("qwen3moe"), d / "F16.gguf")
    for t in ("Q8_0", "Q4_0"):
        ggmoe("quantize", str(d / "F16.gguf"), "-o", str(d / f"{t}.gguf"), "--type", t)
    (d / "p.jsonl").write_text('{"prompt": "def main():"}\n{"prompt": "import os"}\n')
    ggmoe("trace", str(d / "F16.gguf"), "--prompts", str(d / "p.jsonl"), "-o", str(d / "t"), "--max-tokens", "8")
    source = Path(package.__file__).parent / "simulate" / "des.py"  # ASCII: the fixture's tokens are bytes
    (d / "text.txt").write_text(source.read_text()[:6000])
    (d / "short.txt").write_text("too short for one window")
    return d


def _args(d: Path, *names: str) -> list[str]:
    return [*(str(d / f"{n}.gguf") for n in names), "--traces", str(d / "t"), "--vram", "200KiB",
            "--text", str(d / "text.txt"), *QUALITY]


def test_table_json_and_picture_from_one_command(levels, tmp_path):
    png, ref = tmp_path / "q.png", tmp_path / "ref.npz"
    r = ggmoe("compare-quants", *_args(levels, "Q4_0", "Q8_0", "F16"), "--measure", "--measure-tokens", "8",
              "--plot", str(png), "--save-kl-base", str(ref), "--json")
    rows = {Path(m["model"]).stem: m for m in json.loads(r.stdout)["models"]}
    q = {k: m["quality"] for k, m in rows.items()}
    assert all(x["reference"] == "F16.gguf" for x in q.values())  # the most bytes per expert
    assert q["F16"]["kld_mean"] == 0 and q["F16"]["kld_p99"] == 0 and q["F16"]["top_agreement"] == 1
    assert 0 < q["Q8_0"]["kld_mean"] < q["Q4_0"]["kld_mean"]
    assert q["Q8_0"]["top_agreement"] >= q["Q4_0"]["top_agreement"]
    assert all(x["n_tokens"] == 6 * 31 and x["ppl"] > 1 for x in q.values())  # BOS + 63 tokens, rows 32..62
    for m in rows.values():
        assert m["measured"]["decode_tokens"] == 8 and m["measured"]["teacher_forced"]
        assert 0 <= m["measured"]["hit_rate"] <= 1 and m["tpot_s_estimate"] > 0
    assert rows["F16"]["pareto"]  # nothing beats a KLD of 0 on quality
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    again = ggmoe("compare-quants", *_args(levels, "Q4_0"), "--kl-base", str(ref), "--json")
    (q4,) = json.loads(again.stdout)["models"]
    assert {k: v for k, v in q4["quality"].items() if k != "reference"} == \
        {k: v for k, v in q["Q4_0"].items() if k != "reference"}  # the saved reference gives the same figures
    assert q4["quality"]["reference"].startswith("F16.gguf (--kl-base")


def test_the_table(levels):
    r = ggmoe("compare-quants", *_args(levels, "Q4_0", "F16"), "--reference", str(levels / "Q4_0.gguf"))
    head = r.stdout.splitlines()[1]
    for col in ("hit rate", "TPOT ms (est.)", "PPL", "KLD mean", "KLD median", "KLD p99", "same top", "Pareto"):
        assert col in head
    q4 = next(ln for ln in r.stdout.splitlines() if ln.startswith("Q4_0.gguf"))
    assert q4.split()[-5:] == ["0.00000", "0.00000", "0.00000", "100.0%", "*"]  # the named reference: itself




@pytest.mark.parametrize("case,message", [
    ("another model", "are not levels of one model (arch qwen3moe vs qwen2moe)"),
    ("short text", "fewer than one window"),
    ("reference on other tokens", "made on other tokens"),
    ("reference of another model", "made from another model"),
    ("kl-base without text", "--kl-base needs --text"),
    ("ctx beyond training", "training context (256 tokens)"),
])
def test_bad_input_is_one_line_and_writes_nothing(case, message, levels, tmp_path):
    other = str(fixture_path("qwen2moe"))
    png, out = tmp_path / "o.png", tmp_path / "o.npz"
    ref = tmp_path / "r.npz"
    if case.startswith("reference"):
        ggmoe("compare-quants", *_args(levels, "F16")[:-4], "--ctx", "32", "--save-kl-base", str(ref))
    args = {"another model": [*_args(levels, "Q8_0"), other],
            "short text": [*_args(levels, "Q8_0", "F16"), "--text", str(levels / "short.txt")],
            "reference on other tokens": [*_args(levels, "Q8_0"), "--kl-base", str(ref)],
            "reference of another model": [other, *_args(levels, "Q8_0")[1:], "--ctx", "32", "--kl-base",
                                           str(ref)],
            "kl-base without text": [str(levels / "Q8_0.gguf"), "--traces", str(levels / "t"), "--vram", "200KiB",
                                     "--kl-base", str(ref)],
            "ctx beyond training": [*_args(levels, "Q8_0"), "--ctx", "1024"]}[case]
    extra = ["--plot", str(png)] + ([] if "--kl-base" in args else ["--save-kl-base", str(out)])
    r = ggmoe("compare-quants", *args, *extra, ok=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not png.exists() and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["r.npz"] if case.startswith("reference") else [])
