"""``ggmoe trace import``: both routing-log forms into the trace format, and every bad input refused."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.base.errors import TraceFormatError
from ggmoe.cli import main
from ggmoe.trace import load_trace
from ggmoe.trace.imports import RoutingShape, import_routing

pytestmark = pytest.mark.unit

E, K, LAYERS = 8, 2, (1, 2, 3)
SHAPE = RoutingShape(n_layer=4, n_expert=E, n_expert_used=K)


def _routing(seed: int, lengths: tuple[int, ...]) -> list[np.ndarray]:
    """Per sequence: ids [n, L, K] (distinct per token and layer) in router order."""
    rng = np.random.default_rng(seed)
    return [np.stack([[rng.choice(E, size=K, replace=False) for _ in LAYERS] for _ in range(n)]) for n in lengths]


def _weights(ids: np.ndarray) -> np.ndarray:
    return np.round(0.5 / (1 + ids.astype(np.float32)), 4)


def _layer_files(tmp_path, seqs: list[np.ndarray], gz: bool = True, weights: bool = True):
    d = tmp_path / "log"
    d.mkdir()
    for j, il in enumerate(LAYERS):
        lines = []
        for s in seqs:
            ids = s[:, j].ravel()
            line = "\t".join(map(str, ids.tolist()))
            if weights:
                line += "\t\t" + "\t".join(f"{w:.4f}" for w in _weights(s[:, j]).ravel())
            lines.append(line + "\n")
        name = f"expert_weights_{il}.txt" + (".gz" if gz else "")
        data = "".join(lines).encode()
        (d / name).write_bytes(gzip.compress(data) if gz else data)
    return d


def _jsonl(tmp_path, seqs: list[np.ndarray], keys=("seq", "token", "layer", "topk_ids", "topk_weights")):
    path = tmp_path / "log.jsonl"
    recs = []
    for si, s in enumerate(seqs):
        for t in range(s.shape[0]):
            for j, il in enumerate(LAYERS):
                recs.append({keys[0]: f"req-{si}", keys[1]: t, keys[2]: il, keys[3]: s[t, j].tolist(),
                             keys[4]: _weights(s[t, j]).tolist()})
    rng = np.random.default_rng(1)
    order = rng.permutation(len(recs))  # records in any order: sequences keep the order of first appearance
    first = {}
    for i in range(len(recs)):
        first.setdefault(recs[i][keys[0]], i)
    shuffled = sorted((recs[i] for i in order), key=lambda r: first[r[keys[0]]])
    path.write_text("".join(json.dumps(r) + "\n" for r in shuffled))
    return path


@pytest.mark.parametrize("form", ["layer-files", "layer-files-plain", "jsonl", "jsonl-aliases"])
def test_both_forms_give_the_routing_token_by_token(tmp_path, form):
    seqs = _routing(0, (5, 3, 7))
    if form.startswith("layer-files"):
        src = _layer_files(tmp_path, seqs, gz=form == "layer-files")
    else:
        keys = ("seq_id", "position", "il", "expert_ids", "weights") if form == "jsonl-aliases" else \
            ("seq", "token", "layer", "topk_ids", "topk_weights")
        src = _jsonl(tmp_path, seqs, keys)
    tr = import_routing(src, SHAPE)
    assert tr.layers.tolist() == list(LAYERS)
    assert tr.prompt_offsets.tolist() == [0, 5, 8, 15]
    assert np.array_equal(tr.ids, np.concatenate(seqs).astype(np.int16))
    assert tr.positions.tolist() == [*range(5), *range(3), *range(7)]
    assert set(tr.stage.tolist()) == {1}  # a decode stream
    got = np.take_along_axis(tr.probs, tr.ids.astype(np.int64), axis=2).astype(np.float32)
    assert np.allclose(got, _weights(np.concatenate(seqs)), atol=1e-3)
    assert tr.probs.astype(np.float32).sum() == pytest.approx(float(_weights(np.concatenate(seqs)).sum()), rel=1e-2)
    assert tr.meta.lacks == ("hidden", "probs", "token_ids") and tr.meta.source.startswith(form.split("-plain")[0]
                                                                                             .replace("-aliases", ""))


def test_the_cli_writes_a_trace_that_loads_and_names_what_it_lacks(tmp_path):
    src = _layer_files(tmp_path, _routing(2, (4, 6)), weights=False)
    out = tmp_path / "t"
    r = CliRunner().invoke(main, ["trace", "import", str(src), str(src), "-o", str(out), "--n-expert", str(E),
                                  "--top-k", str(K), "--note", "test log, MIT", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["tokens"] == 20 and info["sequences"] == 4 and set(info["lacks"]) == {"hidden", "probs", "token_ids"}
    tr = load_trace(out)
    assert tr.meta.n_layer == 4 and "test log, MIT" in tr.meta.source and tr.meta.max_tokens == 6
    assert not tr.probs.any()  # no weights in the log: none invented


def test_a_recorded_trace_is_still_recorded_with_the_usual_subcommand(tmp_path):
    r = CliRunner().invoke(main, ["trace", "--help"])
    assert r.exit_code == 0 and "import" in r.output and "record" in r.output


@pytest.mark.parametrize("predictor,what", [("token", "token ids"), ("expert-map", "probs")])
def test_commands_refuse_what_an_imported_trace_lacks_in_one_line(tmp_path, predictor, what):
    src = _layer_files(tmp_path, _routing(3, (6, 6)))
    out = tmp_path / "t"
    assert CliRunner().invoke(main, ["trace", "import", str(src), "-o", str(out), "--n-expert", str(E),
                                     "--top-k", str(K)]).exit_code == 0
    r = CliRunner().invoke(main, ["simulate", str(out), "--hw", "none", "--cache-slots", "4", "--predictor",
                                  predictor, "--predictor-train", str(out)])
    assert r.exit_code == 2
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and f"predictor {predictor!r} needs" in err[0]
    r = CliRunner().invoke(main, ["simulate", str(out), "--cache-slots", "4"])  # times need the GGUF's bytes
    assert r.exit_code == 2 and "--model" in r.output and "--hw none" in r.output


@pytest.mark.parametrize("jobs", ["1", "2"])  # 2: configurations in forked worker processes, the same results
def test_simulate_counts_an_imported_trace_without_a_gguf(tmp_path, jobs):
    src = _layer_files(tmp_path, _routing(4, (30, 30)))
    out = tmp_path / "t"
    CliRunner().invoke(main, ["trace", "import", str(src), "-o", str(out), "--n-expert", str(E), "--top-k", str(K)])
    r = CliRunner().invoke(main, ["simulate", str(out), "--hw", "none", "--cache-slots", "4", "--policy",
                                  "lru,belady", "--decode-mode", "sync,async", "--jobs", jobs, "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output[r.output.index("{"):])
    hits = {(x["policy"], x["decode_mode"]): x["hit_rate"] for x in res["results"]}
    assert hits[("belady", "sync")] == hits[("belady", "async")] >= hits[("lru", "sync")] == hits[("lru", "async")]
    assert res["routing"].startswith("layer-files:")
    assert [(x["policy"], x["decode_mode"]) for x in res["results"]] == [
        ("lru", "sync"), ("lru", "async"), ("belady", "sync"), ("belady", "async")]  # in the order asked


def _bad_layer_files(tmp_path, case: str):
    seqs = _routing(5, (4, 4))
    d = _layer_files(tmp_path, seqs, gz=False)
    f = d / f"expert_weights_{LAYERS[1]}.txt"
    lines = f.read_text().splitlines(keepends=True)
    if case == "ids not a multiple of top-k":
        f.write_text("1\t2\t3\n" + "".join(lines[1:]))
    elif case == "weights count":
        f.write_text("0\t1\t\t0.5\n" + "".join(lines[1:]))
    elif case == "sequences differ":
        f.write_text(lines[0])
    elif case == "not a number":
        f.write_text("a\tb\n" + "".join(lines[1:]))
    return d


@pytest.mark.parametrize("case,match", [
    ("ids not a multiple of top-k", "not a multiple of top-k"),
    ("weights count", "weights for"),
    ("sequences differ", "token counts differ"),
    ("not a number", "not a number"),
])
def test_bad_layer_files(tmp_path, case, match):
    with pytest.raises(TraceFormatError, match=match):
        import_routing(_bad_layer_files(tmp_path, case), SHAPE)


@pytest.mark.parametrize("record,match", [
    ({"token": 0, "layer": 1, "topk_ids": [0, 1]}, "no seq field"),
    ({"seq": 0, "layer": 1, "topk_ids": [0, 1]}, "no token field"),
    ({"seq": 0, "token": 0, "topk_ids": [0, 1]}, "no layer field"),
    ({"seq": 0, "token": 0, "layer": 1}, "no ids field"),
    ({"seq": 0, "token": -1, "layer": 1, "topk_ids": [0, 1]}, "token must be a non-negative integer"),
    ({"seq": 0, "token": 0, "layer": 1, "topk_ids": [0, 1, 2]}, "list of 2 ints"),
    ({"seq": 0, "token": 0, "layer": 1, "topk_ids": [0, 1], "weights": ["a", 1]}, "weights must be a list"),
    ({"seq": 0, "token": 0, "layer": 1, "topk_ids": [0, 9]}, "expert id: the log selects expert 9"),
    ({"seq": 0, "token": 0, "layer": 1, "topk_ids": [3, 3]}, "same expert twice"),
    ({"seq": 0, "token": 0, "layer": 7, "topk_ids": [0, 1]}, "layer: the log names layer 7"),
    ([1, 2], "expected an object"),
])
def test_bad_jsonl_records(tmp_path, record, match):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(TraceFormatError, match=match):
        import_routing(path, SHAPE)


def test_a_token_missing_a_layer_and_a_duplicate_record(tmp_path):
    path = tmp_path / "r.jsonl"
    recs = [{"seq": 0, "token": 0, "layer": 1, "topk_ids": [0, 1]}, {"seq": 0, "token": 0, "layer": 2, "topk_ids": [0, 1]},
            {"seq": 0, "token": 1, "layer": 1, "topk_ids": [0, 1]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(TraceFormatError, match="token 1 has no record for layer 2"):
        import_routing(path, SHAPE)
    path.write_text("".join(json.dumps(r) + "\n" for r in [recs[0], recs[0]]))
    with pytest.raises(TraceFormatError, match="a second record"):
        import_routing(path, SHAPE)


@pytest.mark.parametrize("args,match", [
    (["{tmp}/nothing-here"], "no such file or directory"),
    (["{tmp}/x.csv"], "unknown routing log form"),
    (["{tmp}/empty-dir"], "unknown routing log form"),
    (["{tmp}/log", "--top-k", "2"], "--n-expert and --top-k"),
    (["{tmp}/log", "--n-expert", "2", "--top-k", "3"], "--top-k 3 is above --n-expert 2"),
    (["{tmp}/log", "--n-expert", "8", "--top-k", "3"], "not a multiple of top-k 3"),
    (["{tmp}/log", "--n-expert", "4", "--top-k", "2"], "the model has 4 experts"),
    (["{tmp}/log", "--n-expert", "8", "--top-k", "2", "--n-layer", "3"], "layer: the log names layer 3"),
])
def test_the_cli_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, args, match):
    _layer_files(tmp_path, _routing(6, (4,)))
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "empty-dir").mkdir()
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["trace", "import", *[a.format(tmp=tmp_path) for a in args], "-o", str(out)])
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and match in err[0], r.output
    assert not (out / "trace.npz").exists()


def test_a_trace_whose_shape_does_not_match_the_model_is_refused_naming_the_field(tmp_path):
    src = _layer_files(tmp_path, _routing(7, (4,)))
    out = tmp_path / "t"
    CliRunner().invoke(main, ["trace", "import", str(src), "-o", str(out), "--n-expert", str(E), "--top-k", str(K)])
    r = CliRunner().invoke(main, ["simulate", str(out), "--hw", "none", "--cache-slots", "4", "--model",
                                  "ggmoe/models/tiny-moe.gguf"])  # 32 experts, top-4: the trace has 8, top-2
    assert r.exit_code == 2 and "error: n_expert: the trace has 8 experts per layer" in r.output
