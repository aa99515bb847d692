"""ggmoe quantize and compare-quants on the embedded model's Q4_K_M, Q8_0 and F16 variants."""

from __future__ import annotations

import json

import pytest
from cli_run import ggmoe
from click.testing import CliRunner

from ggmoe.cli import main
from ggmoe.models import default_model_path


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    d = tmp_path_factory.mktemp("quants")
    for t in ("Q4_K_M", "F16"):
        ggmoe("quantize", str(default_model_path()), "-o", str(d / f"{t}.gguf"), "--type", t)
    prompts = d / "p.jsonl"
    prompts.write_text('{"prompt": "def main():"}\n{"prompt": "import os"}\n{"prompt": "class A:"}\n')
    assert CliRunner().invoke(main, ["trace", "--prompts", str(prompts), "-o", str(d / "t"), "--max-tokens",
                                     "16"]).exit_code == 0
    return d


def test_variants_load_and_run_on_the_cache(variants):
    for t in ("Q4_K_M", "F16"):
        ggmoe("run", str(variants / f"{t}.gguf"), "-p", "def f():", "-n", "4", "--cache-slots", "8")


def test_compare_quants(variants, tmp_path):
    plot = tmp_path / "q.png"
    r = ggmoe("compare-quants", str(variants / "Q4_K_M.gguf"), str(default_model_path()),
              str(variants / "F16.gguf"), "--traces", str(variants / "t" / "trace.npz"), "--vram", "4MiB",
              "--json", "--plot", str(plot))
    rows = json.loads(r.stdout)["models"]
    bpe = [x["bytes_per_expert"] for x in rows]
    assert bpe[0] < bpe[1] < bpe[2]  # Q4_K_M < Q8_0 < F16
    slots = [x["slots_per_layer"] for x in rows]
    assert slots[0] >= slots[1] >= slots[2]  # more experts fit when they are smaller
    # (hit rates are not compared: with more slots, prefill micro-batches run on the cache instead of natively,
    # and their cold misses count)
    assert all(0 < x["hit_rate"] <= 1 and x["tpot_s_estimate"] > 0 for x in rows)
    assert all(x["cache_bytes"] <= 4 << 20 for x in rows)
    assert plot.stat().st_size > 1000


def test_a_budget_that_holds_no_f16_layer(variants):
    r = ggmoe("compare-quants", str(variants / "Q4_K_M.gguf"), str(variants / "F16.gguf"), "--traces",
              str(variants / "t" / "trace.npz"), "--vram", "1300KiB", "--json")
    rows = json.loads(r.stdout)["models"]
    assert rows[0]["fits"] and not rows[1]["fits"]


@pytest.mark.parametrize("args,message", [
    (["quantize", "MODEL", "-o", "x.gguf", "--type", "Q9"], "unknown quantization type"),
    (["quantize", "MODEL", "-o", "MODEL", "--type", "Q8_0"], "source file"),
    (["quantize", "MODEL", "-o", "x.txt", "--type", "Q8_0"], ".gguf"),
    (["quantize", "missing.gguf", "-o", "x.gguf", "--type", "Q8_0"], "no such file"),
])
def test_quantize_errors(args, message, tmp_path):
    args = [a.replace("MODEL", str(default_model_path())).replace("x.", str(tmp_path / "x.")) for a in args]
    r = ggmoe(*args, ok=False)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_compare_quants_refuses_another_shape(variants, qwen3moe_model):
    r = ggmoe("compare-quants", str(qwen3moe_model), "--traces", str(variants / "t" / "trace.npz"), "--vram",
              "4MiB", ok=False)
    assert r.returncode == 2 and "differ from the traces" in r.stderr
