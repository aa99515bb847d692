"""The simulator against peers' published figures: the table in docs/simulator.md is recomputed here from the
profiles and parts (ggmoe.simulate.fidelity), so the doc cannot drift from the code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ggmoe.base.errors import UsageError
from ggmoe.simulate import fidelity as F

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"
BEGIN = "<!-- fidelity table: ggmoe.simulate.fidelity.render_table() -->"
END = "<!-- end of the fidelity table -->"


def _doc_table() -> str:
    text = DOC.read_text()
    assert BEGIN in text and END in text, "docs/simulator.md lost the fidelity table's markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_the_docs_table_is_what_the_profiles_give():
    assert _doc_table() == F.render_table(), "rerun tools/bench/fidelity_table.py and paste its table into the doc"


def test_at_least_five_published_figures_within_20_percent():
    ok = [r.key for r in F.ROWS if not r.cannot and abs(F.error(r, F.ours(r))) <= F.MAX_ERROR]
    assert len(ok) >= 5, ok


def test_every_row_names_a_source_and_every_unreproduced_one_a_reason():
    for r in F.ROWS:
        assert r.source.strip()
        if r.shape is None:
            assert r.cannot and F.ours(r) is None


@pytest.mark.parametrize("quant,il,expected", [
    # Qwen3.5-35B-A3B: 2048 x 512 per tensor; Q8_0 34 bytes per 32; Q4_K 144 per 256, Q6_K 210 per 256
    ("Q8_0", 0, 3 * 2048 * 512 // 32 * 34),
    ("Q4_K_M", 0, 2 * 2048 * 512 // 256 * 144 + 2048 * 512 // 256 * 210),  # block 0 < 80/8: down Q6_K
    ("Q4_K_M", 10, 3 * 2048 * 512 // 256 * 144),  # (10 - 10) % 3 != 2: down Q4_K
    ("Q4_K_M", 12, 2 * 2048 * 512 // 256 * 144 + 2048 * 512 // 256 * 210),  # (12 - 10) % 3 == 2
    ("MXFP4", 5, 3 * 2048 * 512 // 32 * 17),
])
def test_expert_bytes_follow_llamas_quantizer(quant, il, expected):
    assert F.expert_bytes(F.QWEN35_35B, quant, il) == expected


def test_the_byte_model_matches_the_vram_a_published_run_added():
    # --n-cpu-moe 24 grew VRAM by 14,874 - 7,217 MiB over -ot exps=CPU on the RTX 5080: blocks 24-39's experts
    grown = (14874 - 7217) * 2**20
    ours = sum(F.QWEN35_35B.n_expert * F.expert_bytes(F.QWEN35_35B, "Q4_K_M", il) for il in range(24, 40))
    assert abs(ours / grown - 1) < 0.05


def test_fit_places_the_last_blocks_that_fit():
    row = next(r for r in F.ROWS if r.key == "5080-q8-fit")
    per_layer = F.QWEN35_35B.n_expert * F.expert_bytes(F.QWEN35_35B, "Q8_0", 0)
    assert F.fit_n_cpu_moe(row) == 40 - int(row.fit_mib * 2**20 // per_layer)
    assert F.fit_n_cpu_moe(replace(row, fit_mib=0.5)) == 40  # nothing fits: every block on the CPU


def test_more_vram_for_experts_is_never_slower():
    row = next(r for r in F.ROWS if r.key == "5080-q4-ncmoe24")
    speeds = [F.ours(replace(row, n_cpu_moe=n)) for n in (40, 32, 24, 16)]
    assert speeds == sorted(speeds) and speeds[0] < speeds[-1]


@pytest.mark.parametrize("change,match", [
    ({"quant": "Q3_K"}, "unknown quantization 'Q3_K'"),
    ({"way": "moe-cache"}, "unknown way 'moe-cache'"),
    ({"hw": "rtx9999/pcie4x16/ddr5-4800x2"}, "unknown GPU 'rtx9999'"),
])
def test_a_bad_row_is_one_clear_error(change, match):
    row = replace(F.ROWS[0], **change)
    with pytest.raises(UsageError, match=match):
        F.ours(row)
