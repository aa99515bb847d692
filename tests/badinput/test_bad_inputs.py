"""Generated bad inputs of every other class: flags, output paths, prompts files, trace files, GGUF bytes,
non-UTF-8 text and paths, Ctrl-C. Each ends in exactly one ``error:`` line and exit 2 (130 for Ctrl-C),
no traceback, nothing half-written.

Cases that could reach llama.cpp run in a subprocess; pure-Python ones run through click's runner.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import Outcome, assert_clean_error, run_ggmoe

from ggmoe.cli import main
from tools.fixtures.make_fixtures import fixture_path

pytestmark = pytest.mark.badinput

MODEL = "MODEL"  # replaced by the qwen3moe fixture's path


def _in_process(args: list[str], stdin: str | None = None) -> Outcome:
    r = CliRunner().invoke(main, args, input=stdin)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Outcome(r.exit_code, r.stdout, r.stderr)


def _args(args: tuple[str, ...], tmp: Path) -> list[str]:
    model = str(fixture_path("qwen3moe"))
    prompts = tmp / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return [a.replace(MODEL, model).replace("PROMPTS", str(prompts)).replace("TMP", str(tmp)) for a in args]


# --------------------------------------------------------------------------- flags

_FLAG_VALUES = {
    "--threads": ["0", "-1", "100000", "abc", "1e3"],
    "--temp": ["nan", "inf", "-inf", "-1", "abc"],
    "--n-ctx": ["0", "7", str(2**40), "abc", "-8"],
    "--seed": ["-1", str(2**40), "x"],
    "--cache-slots": ["0", "1", "100000", "-3", "two"],
    "--vram": ["abc", "0", "1KB", "-5", "1e9xB", "nan"],
    "--policy": ["nope"],
    "--miss-policy": ["sometimes", ""],
    "--stride": ["0", "-1", "x"],
    "--prefetch": ["0", "-2", "many"],
    "--prefetch-threshold": ["nan", "inf", "abc"],
    "--host-threads": ["-1", "100000", "two"],
}
FLAG_CASES = [(cmd, flag, v) for cmd in ("run", "trace") for flag, vals in _FLAG_VALUES.items() for v in vals]
FLAG_CASES += [(cmd, "-n" if cmd == "run" else "--max-tokens", v) for cmd in ("run", "trace")
               for v in ("0", "-5", str(2**40), "many")]
FLAG_CASES += [("trace", "--prefill-tokens", v) for v in ("0", "-1", str(2**40))]


@pytest.mark.parametrize("cmd,flag,value", FLAG_CASES)
def test_bad_flag(cmd, flag, value, tmp_path):
    base = ("run", MODEL, "-p", "hi", "-n", "2") if cmd == "run" else \
        ("trace", MODEL, "--prompts", "PROMPTS", "-o", "TMP/out", "--max-tokens", "2")
    args = _args(base, tmp_path)
    if flag in ("-n", "--max-tokens"):
        args = args[:-2]
    out = run_ggmoe(*args, flag, value, timeout=30)
    assert_clean_error(out)
    assert not (tmp_path / "out" / "trace.npz").exists()


COMBOS = [
    ("run", MODEL, "-p", "hi", "--policy", "lru"),  # a policy without a cache
    ("run", MODEL, "-p", "hi", "--stats-json", "TMP/s.json"),  # stats without a cache
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--vram", "1MiB"),  # two sizes
    ("run", MODEL),  # no prompt
    ("run", MODEL, "-p", "hi", "--prompt-file", "PROMPTS"),  # two prompts
    ("run", MODEL, "--prompt-file", "TMP/nope.txt"),
    ("run", MODEL, "--prompt-file", "TMP"),
    ("trace", MODEL, "--prompts", "PROMPTS"),  # no -o
    ("trace", MODEL, "-o", "TMP/out"),  # no --prompts
    ("run", MODEL, "-p", "hi", "--miss-policy", "cpu"),  # a miss policy without a cache
    ("run", MODEL, "-p", "hi", "--host-threads", "2"),  # host threads without a cache
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--host-threads", "2"),  # ... without a host path (wait)
    ("run", MODEL, "-p", "hi", "--predictor", "reuse"),  # a predictor without a cache
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--prefetch", "4"),  # --prefetch without --predictor
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "nope"),  # unknown predictor
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "TMP/missing.npz"),
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "PROMPTS"),  # not a predictor file
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "token"),  # learns: no traces given
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "oracle"),  # simulator only
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "reuse", "--stride", "4"),  # 4 MoE layers
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--miss-policy", "auto", "--hw", "pcie9"),
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--miss-policy", "auto", "--hw", "PROMPTS"),  # not TOML
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--hw", "egpu"),  # --hw without auto
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--policy", "static"),  # static without --stats-in
    ("run", MODEL, "-p", "hi", "--stats-in", "TMP/missing.npz"),
    ("run", MODEL, "-p", "hi", "--stats-in", "PROMPTS"),  # not a statistics file
    ("run", MODEL, "-p", "hi", "--stats-in", "TMP"),  # a directory
    ("trace", MODEL, "--prompts", "PROMPTS", "-o", "TMP/out", "--stats-in", "PROMPTS"),
    ("run", MODEL, "-p", "hi", "--cache-slots", "4", "--predictor", "eam"),  # no traces and no --stats-in
]


@pytest.mark.parametrize("args", COMBOS, ids=lambda a: " ".join(a[2:]))
def test_bad_flag_combination(args, tmp_path):
    assert_clean_error(run_ggmoe(*_args(args, tmp_path), timeout=30))


# --------------------------------------------------------------------------- output paths

def _file(tmp: Path, name: str = "afile") -> Path:
    p = tmp / name
    p.write_text("x")
    return p


OUTPUT_CASES = {
    "trace -o under a file": lambda t: ("trace", MODEL, "--prompts", "PROMPTS", "-o", f"{_file(t)}/sub"),
    "trace -o is a file": lambda t: ("trace", MODEL, "--prompts", "PROMPTS", "-o", str(_file(t))),
    "trace -o whose trace.npz is a dir": lambda t: (
        (t / "o" / "trace.npz").mkdir(parents=True), ("trace", MODEL, "--prompts", "PROMPTS", "-o", str(t / "o")))[1],
    "trace -o under /dev/null": lambda t: ("trace", MODEL, "--prompts", "PROMPTS", "-o", "/dev/null/x"),
    "trace --stats-json is a dir": lambda t: ("trace", MODEL, "--prompts", "PROMPTS", "-o", str(t / "o"),
                                              "--cache-slots", "4", "--stats-json", str(t)),
    "trace --stats-json is a device": lambda t: ("trace", MODEL, "--prompts", "PROMPTS", "-o", str(t / "o"),
                                                 "--cache-slots", "4", "--stats-json", "/dev/null"),
    "run --stats-json under a file": lambda t: ("run", MODEL, "-p", "hi", "--cache-slots", "4",
                                                "--stats-json", f"{_file(t)}/s.json"),
    "run --stats-json not .json": lambda t: ("run", MODEL, "-p", "hi", "--cache-slots", "4",
                                             "--stats-json", str(t / "s.txt")),
    "run --stats-out not .npz": lambda t: ("run", MODEL, "-p", "hi", "--stats-out", str(t / "s.json")),
    "run --stats-out is a dir": lambda t: ("run", MODEL, "-p", "hi", "--stats-out", str(t)),
    "trace --stats-out under a file": lambda t: ("trace", MODEL, "--prompts", "PROMPTS", "-o", str(t / "o"),
                                                 "--stats-out", f"{_file(t)}/s.npz"),
    "run --trace-out is a file": lambda t: ("run", MODEL, "-p", "hi", "--trace-out", str(_file(t))),
    "run --trace-out whose trace.npz is a dir": lambda t: (
        (t / "r" / "trace.npz").mkdir(parents=True), ("run", MODEL, "-p", "hi", "--trace-out", str(t / "r")))[1],
    "run --trace-out under a file": lambda t: ("run", MODEL, "-p", "hi", "--trace-out", f"{_file(t)}/d"),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_bad_output_path_fails_before_any_work(case, tmp_path):
    before = {p for p in tmp_path.rglob("*")}
    args = _args(OUTPUT_CASES[case](tmp_path), tmp_path)
    before = {p for p in tmp_path.rglob("*")}
    out = run_ggmoe(*args, timeout=30)
    assert_clean_error(out)
    assert "tracing" not in out.stderr  # refused before the first prompt ran
    assert {p for p in tmp_path.rglob("*")} == before  # nothing written, no temporary left


def test_devices_and_directories_are_never_replaced(tmp_path):
    out = run_ggmoe(*_args(("run", MODEL, "-p", "hi", "--cache-slots", "4", "--stats-json", "/dev/null"),
                           tmp_path))
    assert_clean_error(out)
    assert Path("/dev/null").is_char_device()


# --------------------------------------------------------------------------- prompts files

PROMPT_FILES: dict[str, bytes | None] = {
    "empty": b"",
    "blank lines": b"\n \n\t\n",
    "not json": b"hello\n",
    "json array": b'["hello"]\n',
    "json number": b"42\n",
    "json string": b'"hello"\n',
    "prompt not a string": b'{"prompt": 5}\n',
    "prompt empty": b'{"prompt": ""}\n',
    "no prompt key": b'{"prompts": "x"}\n',
    "deeply nested": b"[" * 100000 + b"]" * 100000 + b"\n",
    "deeply nested object": b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"\n",
    "huge integer": b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}\n",
    "not utf-8": b'{"prompt": "caf\xe9"}\n',
    "binary": bytes(range(256)) * 4,
    "lone surrogate": b'{"prompt": "\\ud800"}\n',
    "second line bad": b'{"prompt": "ok"}\n{"prompt": \n',
    "a directory": None,
}


@pytest.mark.parametrize("case", sorted(PROMPT_FILES))
def test_bad_prompts_file(case, tmp_path):
    p = tmp_path / "bad.jsonl"
    if PROMPT_FILES[case] is None:
        p.mkdir()
    else:
        p.write_bytes(PROMPT_FILES[case])
    out = _in_process(_args(("trace", MODEL, "--prompts", str(p), "-o", "TMP/out"), tmp_path))
    assert_clean_error(out)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- trace files

def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _good_trace_arrays() -> dict[str, np.ndarray]:
    meta = {"model_fingerprint": "0" * 16, "model_name": "m", "arch": "qwen3moe", "n_layer": 2, "n_expert": 4,
            "n_expert_used": 2, "n_embd": 8, "mode": "greedy", "max_tokens": 2, "ggmoe_version": "0",
            "n_ubatch": 512, "gating": "softmax", "format": "ggmoe-trace", "version": 2}
    t, layers = 6, 2
    rng = np.random.default_rng(0)
    return {
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        "token_ids": np.arange(t, dtype=np.int32), "positions": np.arange(t, dtype=np.int32),
        "stage": np.zeros(t, dtype=np.uint8), "prompt_offsets": np.array([0, 3, t], dtype=np.int64),
        "layers": np.arange(layers, dtype=np.int32),
        "ids": rng.integers(0, 4, size=(t, layers, 2)).astype(np.int16),
        "probs": rng.random((t, layers, 4)).astype(np.float16),
    }


def _with(**changes) -> bytes:
    a = _good_trace_arrays()
    for k, v in changes.items():
        if v is None:
            a.pop(k)
        else:
            a[k] = v
    return _npz(a)


def _meta(**changes) -> np.ndarray:
    m = json.loads(_good_trace_arrays()["meta"].tobytes())
    m.update(changes)
    return np.frombuffer(json.dumps(m).encode(), dtype=np.uint8)


def _huge_header_npz() -> bytes:
    """An .npz whose ids member declares 2**40 elements but holds a few bytes."""
    good = _good_trace_arrays()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for k, v in good.items():
            if k == "ids":
                hdr = io.BytesIO()
                np.lib.format.write_array_header_1_0(hdr, {"descr": "<i2", "fortran_order": False,
                                                           "shape": (2**40, 2, 2)})
                z.writestr("ids.npy", hdr.getvalue() + b"\0" * 64)
            else:
                member = io.BytesIO()
                np.save(member, v)
                z.writestr(f"{k}.npy", member.getvalue())
    return buf.getvalue()


def _npy_renamed() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.zeros(10))
    return buf.getvalue()


TRACE_FILES: dict[str, bytes] = {
    "empty": b"",
    "text": b"not a trace\n" * 10,
    "npy renamed npz": _npy_renamed(),
    "zip of text": (lambda: (lambda b: (zipfile.ZipFile(b, "w").writestr("a.txt", "x"), b.getvalue())[1])(
        io.BytesIO()))(),
    "pickled object array": _with(token_ids=np.array([1, "a", None, 2, 3, 4], dtype=object)),
    "missing ids": _with(ids=None),
    "missing meta": _with(meta=None),
    "meta is a list": _with(meta=np.frombuffer(b"[1, 2]", dtype=np.uint8)),
    "meta not json": _with(meta=np.frombuffer(b"{oops", dtype=np.uint8)),
    "meta not utf-8": _with(meta=np.frombuffer(b'{"a": "\xff"}', dtype=np.uint8)),
    "meta n_expert a string": _with(meta=_meta(n_expert="4")),
    "meta n_expert_used 0": _with(meta=_meta(n_expert_used=0)),
    "meta n_expert_used above n_expert": _with(meta=_meta(n_expert_used=9)),
    "meta n_layer huge": _with(meta=_meta(n_layer=2**40)),
    "meta unknown format": _with(meta=_meta(format="other")),
    "meta version 3": _with(meta=_meta(version=3)),
    "meta version true": _with(meta=_meta(version=True)),
    "meta gating unknown": _with(meta=_meta(gating="tanh")),
    "negative probs": _with(probs=np.full((6, 2, 4), -1.0, dtype=np.float16)),
    "nan probs": _with(probs=np.full((6, 2, 4), np.nan, dtype=np.float16)),
    "logits wrong shape": _with(logits=np.zeros((6, 2, 5), dtype=np.float16)),
    "logits wrong dtype": _with(logits=np.zeros((6, 2, 4), dtype=np.float32)),
    "meta unknown field": _with(meta=_meta(extra=1)),
    "meta deeply nested": _with(meta=np.frombuffer(b"[" * 100000 + b"]" * 100000, dtype=np.uint8)),
    "ids wrong dtype": _with(ids=np.zeros((6, 2, 2), dtype=np.int64)),
    "ids wrong shape": _with(ids=np.zeros((6, 2, 3), dtype=np.int16)),
    "ids out of range": _with(ids=np.full((6, 2, 2), 9, dtype=np.int16)),
    "negative ids": _with(ids=np.full((6, 2, 2), -1, dtype=np.int16)),
    "offsets not rising": _with(prompt_offsets=np.array([0, 5, 3], dtype=np.int64)),
    "offsets past the end": _with(prompt_offsets=np.array([0, 3, 60], dtype=np.int64)),
    "layers not ascending": _with(layers=np.array([1, 0], dtype=np.int32)),
    "stage 7": _with(stage=np.full(6, 7, dtype=np.uint8)),
    "huge declared shape": _huge_header_npz(),
}
_GOOD = _npz(_good_trace_arrays())
for _i, _cut in enumerate(np.random.default_rng(1).integers(1, len(_GOOD) - 1, size=16)):
    TRACE_FILES[f"truncated at {_cut}"] = _GOOD[:_cut]
for _i in range(16):
    _rng = np.random.default_rng(100 + _i)
    _b = bytearray(_GOOD)
    for _pos in _rng.integers(0, len(_b), size=8):
        _b[_pos] ^= int(_rng.integers(1, 256))
    TRACE_FILES[f"byte flips {_i}"] = bytes(_b)


@pytest.mark.parametrize("case", list(TRACE_FILES))
def test_bad_trace_file(case, tmp_path):
    p = tmp_path / "trace.npz"
    p.write_bytes(TRACE_FILES[case])
    out = _in_process(["eval-predictor", str(p), "-p", "reuse"])
    if case.startswith("byte flips") and out.code == 0:
        return  # a flip inside padding or a compressed-away byte can leave a valid file: fine
    assert_clean_error(out)


@pytest.mark.parametrize("case", ["a directory without trace.npz", "missing"])
def test_trace_path_that_is_not_a_file(case, tmp_path):
    p = tmp_path if case.startswith("a directory") else tmp_path / "nope.npz"
    assert_clean_error(_in_process(["eval-predictor", str(p), "-p", "reuse"]))


# --------------------------------------------------------------------------- GGUF bytes

_MODEL_BYTES = None


def _model_bytes() -> bytes:
    global _MODEL_BYTES
    if _MODEL_BYTES is None:
        _MODEL_BYTES = fixture_path("qwen3moe").read_bytes()
    return _MODEL_BYTES


GGUF_CUTS = [int(c) for c in np.random.default_rng(7).integers(1, 60000, size=24)]
GGUF_FLIPS = list(range(24))


@pytest.mark.parametrize("cut", GGUF_CUTS)
def test_truncated_model(cut, tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(_model_bytes()[:cut])
    assert_clean_error(_in_process(["inspect", str(p)]))


@pytest.mark.parametrize("seed", GGUF_FLIPS)
def test_header_byte_flips_never_crash_run(seed, tmp_path):
    """Random flips inside the header: inspect refuses the file or it is still valid and runs cleanly."""
    data = bytearray(_model_bytes())
    rng = np.random.default_rng(1000 + seed)
    for pos in rng.integers(0, 4096, size=4):
        data[pos] ^= int(rng.integers(1, 256))
    p = tmp_path / "m.gguf"
    p.write_bytes(bytes(data))
    out = run_ggmoe("run", str(p), "-p", "hi", "-n", "2", timeout=60)
    assert out.code >= 0, f"killed by signal {-out.code}: {out.stderr[-800:]}"
    assert "Traceback" not in out.stderr
    if out.code != 0:
        assert_clean_error(out)


# --------------------------------------------------------------------------- non-UTF-8 text and paths

def _run_bytes(args: list[bytes], timeout: float = 30) -> Outcome:
    res = subprocess.run([sys.executable.encode(), b"-m", b"ggmoe", *args], capture_output=True, timeout=timeout,
                         check=False)
    return Outcome(res.returncode, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace"))


def test_non_utf8_prompt_argument():
    out = _run_bytes([b"run", str(fixture_path("qwen3moe")).encode(), b"-p", b"caf\xe9 \xff", b"-n", b"2"])
    assert_clean_error(out)


@pytest.mark.parametrize("cmd", ["inspect", "run", "verify-hook"])
def test_non_utf8_model_path(cmd, tmp_path):
    args = [cmd.encode(), bytes(tmp_path) + b"/mod\xe9l.gguf"] + ([b"-p", b"hi"] if cmd == "run" else [])
    assert_clean_error(_run_bytes(args))


def test_non_utf8_prompt_on_stdin():
    res = subprocess.run([sys.executable, "-m", "ggmoe", "run", str(fixture_path("qwen3moe")), "-p", "-"],
                         input=b"\xff\xfe bad", capture_output=True, timeout=30, check=False)
    assert_clean_error(Outcome(res.returncode, res.stdout.decode(errors="replace"),
                               res.stderr.decode(errors="replace")))


# --------------------------------------------------------------------------- Ctrl-C

@pytest.mark.parametrize("cmd", ["run", "trace"])
def test_ctrl_c_exits_130_with_one_line_and_nothing_half_written(cmd, tmp_path):
    model = str(fixture_path("qwen3moe"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(400)))
    out_dir = tmp_path / "out"
    args = ["run", model, "-p", "hello", "-n", "100000", "--n-ctx", "200000", "--trace-out", str(out_dir)] \
        if cmd == "run" else ["trace", model, "--prompts", str(prompts), "-o", str(out_dir), "--max-tokens", "200"]
    proc = subprocess.Popen([sys.executable, "-m", "ggmoe", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ})
    time.sleep(2.5)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("ggmoe did not stop after Ctrl-C")
    err_text = err.decode(errors="replace")
    lines = [ln for ln in err_text.splitlines() if ln.strip() and not ln.startswith(("note:", "warning:"))
             and "tracing" not in ln]
    assert proc.returncode == 130, err_text[-1500:]
    assert "Traceback" not in err_text and "Exception ignored" not in err_text, err_text[-1500:]
    assert len(lines) == 1, err_text[-1500:]
    assert not out_dir.exists() or [p.name for p in out_dir.iterdir()] == []
