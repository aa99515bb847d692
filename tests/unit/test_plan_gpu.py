"""``ggmoe plan MODEL --gpu NAME``: what to run, from a GGUF header alone, every figure an estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggmoe.cli import main
from ggmoe.inspect import inspect_model
from ggmoe.simulate.advise import advise
from tools.gpu.realshape import write_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A header-only GGUF (a sparse file) of the toy real shape: 4 MoE layers, 32 experts, top-4, Q4_K."""
    return write_model("toy", tmp_path_factory.mktemp("m") / "toy.gguf", header_only=True)[0]


@pytest.mark.parametrize("gpu,vram,link", [
    ("rtx4090", None, None),  # everything fits: all in VRAM is the answer
    ("rtx4060ti16", "1550MiB", None),  # a cache of some of the experts (11 of 32 per layer)
    ("rtx3090", "1550MiB", "tb3"),  # through Thunderbolt
    ("h100", "1539MiB", "pcie5x16"),  # no cache fits: the stock ways only
])
def test_every_way_is_estimated_and_the_fastest_is_chosen(toy, gpu, vram, link):
    facts = inspect_model(toy)
    a = advise(facts, gpu, int(vram[:-3]) << 20 if vram else None, None, link)
    runnable = [w for w in a.ways if w.decode_tok_s is not None]
    assert a.choice.decode_tok_s == max(w.decode_tok_s for w in runnable)
    assert {"llama.cpp --n-cpu-moe", "llama.cpp -ot exps=CPU", "all experts in VRAM"} <= {w.name for w in a.ways}
    assert a.routing.startswith("mapped from layer-files:") and "ESFT" in a.routing
    fits_all = a.expert_budget_bytes >= facts.expert_bytes
    assert (a.choice.name == "all experts in VRAM") == fits_all
    has_cache = any(w.name.startswith("ggmoe") for w in a.ways)
    assert has_cache == (a.slots_per_layer >= facts.n_expert_used)
    if link == "tb3":
        assert a.link == "tb3"


def test_the_cli_prints_estimates_and_the_command_to_run(toy):
    r = CliRunner().invoke(main, ["plan", str(toy), "--gpu", "rtx4060ti16", "--vram", "1550MiB"])
    assert r.exit_code == 0, r.output
    assert "estimates (simulator; not measured)" in r.output and "ggmoe serve" in r.output
    # a host tier of 16 of the 32 experts per layer: the rest on disk, planned on three tiers
    r = CliRunner().invoke(main, ["plan", str(toy), "--gpu", "rtx4060ti16", "--vram", "1550MiB", "--host-ram",
                                  str(16 * 884_736), "--json"])
    d = json.loads(r.output)
    assert "estimates" in d and d["choice"]["decode_tok_s"] > 0 and "do not fit" in d["notes"][0]
    assert d["tiers"]["host_slots"] == 16 and d["tiers"]["disk"] is True


@pytest.mark.parametrize("args,match", [
    (["--gpu", "rtx4080"], "unknown GPU 'rtx4080'"),
    (["--gpu", "rtx4090", "--link", "pcie9x16"], "unknown link 'pcie9x16'"),
    (["--gpu", "rtx4090", "--host", "ddr3"], "unknown host 'ddr3'"),
    (["--gpu", "rtx4090", "-o", "p.toml"], "--gpu answers from the GGUF header alone"),
    (["--gpu", "rtx4090", "--vram", "100MiB"], "cannot run on rtx4090"),
    (["--link", "pcie4x16", "--vram", "1GiB", "-o", "p.toml"], "--link goes with --gpu"),
    (["--disk", "nvme4", "--vram", "1GiB", "-o", "p.toml"], "--disk goes with --gpu"),
    (["--gpu", "rtx4090", "--disk", "floppy"], "unknown disk 'floppy'"),
    (["--gpu", "rtx4090", "--ram", "16MiB"], "--ram 16.0 MiB leaves 0 B for the host tier after the OS's margin"),
])
def test_bad_input_is_one_error_line(toy, args, match):
    r = CliRunner().invoke(main, ["plan", str(toy), *args])
    assert r.exit_code == 2
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and match in err[0], r.output
