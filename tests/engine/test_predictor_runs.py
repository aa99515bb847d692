"""A predictor the user gives runs in the decode mode in effect, or the run picks a mode where it can, or it says
in one line why not (issue 41, item 5). On the CPU build under both copy streams, by the counts only:

- ``ggmoe trace`` with a predictor measures the async decode a server would run (its routing from the
  controller, expert ids only), and the mailbox's prefetch runs there, under ``--decode-mode async`` and ``auto``;
- while an observer needs the route op (table mode off), the async decode's prefetcher reads the route op's
  events as in sync, and its own request never keeps table mode off;
- ``ggmoe run`` at as many slots as top-k: ``auto`` takes the sync decode, where the prefetch evicts; ``async``
  runs and says in its reason that the predictor cannot prefetch;
- a predictor that knows the routing lifts the async decode's hit rate over async LRU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggmoe.base.hook import HookRequest
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cli.main import main
from ggmoe.control import prefetch as prefetch_mod
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.inspect import inspect_model
from ggmoe.models import default_model_path
from ggmoe.predict.base import ModelShape, Predictor
from ggmoe.trace import load_trace
from tools.fixtures.random_predictor import random_predictor_file

pytestmark = pytest.mark.engine

TEXTS = ["The river runs past the old mill, where the miller keeps his stones and his sacks of grain dry.",
         "def area(w, h):\n    return w * h\n\nfor i in range(10):\n    print(area(i, i + 1))\n"]


@pytest.fixture(scope="module")
def model():
    return default_model_path()


@pytest.fixture(scope="module")
def mlp_s2(model, tmp_path_factory):
    """A random-weight mlp predictor file at stride 2: it reads the MoE input, as a trained one does."""
    return random_predictor_file(model, tmp_path_factory.mktemp("pred") / "p.npz", kind="mlp", stride=2,
                                 hidden=32, seed=5)


def _cli(*args: object) -> object:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


def _trace(model, tmp_path, name: str, *flags: str, said: list[str] | None = None) -> tuple[dict, object]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    stats = tmp_path / f"{name}.json"
    r = _cli("trace", model, "--prompts", prompts, "-o", tmp_path / name, "--mode", "teacher", "--prefill-tokens",
             "8", "--max-tokens", "24", "--stats-json", stats, *flags)
    if said is not None:
        said.append(r.output)
    return json.loads(stats.read_text()), load_trace(tmp_path / name, hidden=False)


@pytest.mark.parametrize("flags, lockstep, line", [
    ((), True, "measured in lockstep"),  # the CPU build's default: the figure does not depend on a free core
    (("--no-lockstep",), False, None),
    (("--lockstep", "--decode-mode", "sync"), None, "--lockstep does nothing here"),
])
def test_trace_measures_the_predictor_in_lockstep_by_default(model, mlp_s2, tmp_path, monkeypatch, flags, lockstep,
                                                              line):
    """``ggmoe trace`` holds each layer for the predictor's reader on the CPU build unless told not to (the
    environment's setting does not turn that default off); a flag that changes nothing says so."""
    monkeypatch.delenv("GGMOE_MAILBOX_LOCKSTEP", raising=False)
    said: list[str] = []
    got, _ = _trace(model, tmp_path, "t", "--cache-slots", inspect_model(model).n_expert_used + 4, "--predictor",
                    mlp_s2, *flags, said=said)
    pre = got["prefetch"]
    if lockstep is None:
        assert pre["runs_on"] != "mailbox"
    else:
        assert pre["runs_on"] == "mailbox" and pre["lockstep"] is lockstep
    if lockstep:
        assert pre["layers_behind"] == 0 and pre["layers_targeted"] > 0
    assert (line in said[0]) if line else ("lockstep" not in said[0]), said[0]


@pytest.mark.parametrize("mode", ["async", "auto"])
def test_trace_measures_the_async_decode_and_its_prefetch_runs(model, mlp_s2, tmp_path, mode):
    facts = inspect_model(model)
    flags = ("--cache-slots", facts.n_expert_used + 4, "--predictor", mlp_s2, "--stride", "2")
    got, tr = _trace(model, tmp_path, mode, *flags, "--decode-mode", mode)
    assert got["decode_mode_in_effect"] == "async" and got["prefetch"]["runs_on"] == "mailbox"
    assert got["controller_tokens"] > 0 and got["total"]["prefetch_issued"] > 0
    assert set(tr.meta.lacks) == {"hidden", "probs"}  # what the async decode reads: expert ids
    _, ref = _trace(model, tmp_path, "sync", *flags, "--decode-mode", "sync")  # the route op's full record
    assert not ref.meta.lacks
    np.testing.assert_array_equal(tr.token_ids, ref.token_ids)
    np.testing.assert_array_equal(tr.stage, ref.stage)
    np.testing.assert_array_equal(np.sort(tr.ids, axis=2), np.sort(ref.ids, axis=2))


def test_table_mode_off_the_prefetcher_reads_the_route_op(model, mlp_s2):
    """An observer that reads router probabilities turns table mode off: the prefetcher then asks the route op
    for its MoE input and prefetches as in sync; its own request never keeps table mode off."""
    facts = inspect_model(model)

    class Probs:
        request = HookRequest(probs=True, hidden=False)

        def on_route(self, event) -> None:
            pass

    with _engine(model, facts.n_expert_used + 4, str(mlp_s2)) as eng:
        pipe, pf = eng.pipeline, eng.prefetcher
        assert pipe.mode_in_effect == "async" and not pipe.observers.request.hidden
        with eng.observing(Probs()):
            assert pipe.mode_in_effect == "sync" and pf.request.hidden and pipe.observers.request.hidden
            eng.generate("The table mode test", 12)
            assert eng.cache_stats.total().prefetch_issued > 0
            assert not pf.via_mailbox and not pf.free_only
        assert pipe.mode_in_effect == "async" and pf.via_mailbox
        assert pf.request == HookRequest(probs=False, hidden=False) == pipe.observers.request


def _run(model, tmp_path, *flags: str) -> dict:
    stats = tmp_path / "s.json"
    _cli("run", model, "-p", "def fib(n):", "-n", "24", "--stats-json", stats, *flags)
    return json.loads(stats.read_text())


@pytest.mark.parametrize("mode, extra", [("async", 4), ("auto", 0), ("async", 0)])
def test_run_prefetches_or_says_why_not(model, mlp_s2, tmp_path, mode, extra):
    facts = inspect_model(model)
    got = _run(model, tmp_path, "--cache-slots", facts.n_expert_used + extra, "--predictor", mlp_s2, "--stride",
               "2", "--decode-mode", mode)
    idle = "cannot prefetch in the async decode"
    if extra:  # free slots: the mailbox's prefetch runs
        assert got["decode_mode_in_effect"] == "async" and got["total"]["prefetch_issued"] > 0
    elif mode == "auto":  # no free slot in async: auto takes sync, whose prefetch evicts
        assert got["decode_mode_in_effect"] == "sync" and idle in got["decode_mode_reason"]
        assert got["total"]["prefetch_issued"] > 0
    else:  # asked for: it runs, and its reason says the predictor cannot prefetch there
        assert got["decode_mode_in_effect"] == "async" and idle in got["decode_mode_reason"]


def _engine(path, n_slots: int, predictor: str | None, mode: str = "async") -> Engine:
    pre = PrefetchConfig(predictor, stride=2) if predictor else None
    cache = RunConfig(CacheConfig(n_slots=n_slots, policy="lru"),
                      decode=DecodeConfig(mode=mode),
                      prefetch=pre)
    return Engine(EngineConfig(model_path=path, n_ctx=256, run=cache))


class _Replay(Predictor):
    """Knows each decode token's routing from an earlier run of the same tokens (teacher forcing): an oracle the
    live prefetcher can run."""

    name = "replay"

    def __init__(self, shape: ModelShape, stride: int, routing: list[np.ndarray]) -> None:
        super().__init__(shape, stride)
        self._routing, self._t = routing, -1

    def begin_request(self) -> None:
        self._t = -1

    def begin_token(self, token_id: int) -> None:
        self._t += 1

    def predict(self, il_target: int) -> np.ndarray | None:
        scores = np.zeros(self.shape.n_expert, dtype=np.float32)
        if 0 <= self._t < len(self._routing):
            scores[self._routing[self._t][self._pos[il_target]]] = 1.0
        return scores


def _teacher(eng: Engine, ids: list[int], observer=None) -> list[np.ndarray]:
    """Prefill 8 tokens, feed the rest one per decode; with ``observer`` (a RouteRecorder), each decode token's
    routing [n_layer, k]."""
    got: list[np.ndarray] = []

    def on_step(tokens: list[int], pos0: int, prefill: bool) -> None:
        events = observer.take()  # the prefill's too: each step's own events only
        if not prefill:
            got.append(np.stack([e.ids[0] for _, e in sorted(events.items())]))

    for _ in eng.stream(ids[:8], len(ids) - 8, forced=ids[8:], on_step=on_step if observer else None):
        pass
    return got


def test_a_predictor_that_knows_the_routing_beats_async_lru(model, monkeypatch):
    """In lockstep (the CPU build's benchmark mode: each layer waits for the mailbox's reader, as a host beside a
    GPU keeps pace), so the count does not depend on how many of this machine's cores the decode leaves the
    reader; the deferred stream's copies still land late and out of order."""
    from ggmoe.base.hook import RouteRecorder

    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")

    facts = inspect_model(model)
    n = facts.n_expert_used + 8  # 12 of 32 slots: 6 of 16's share
    with _engine(model, n, None) as eng:
        ids = eng.tokenize(" ".join(TEXTS))
        rec = RouteRecorder(HookRequest(probs=False, hidden=False))
        with eng.observing(rec):
            routing = _teacher(eng, ids, rec)
        lru = eng.cache_stats.total().hit_rate
    shape = ModelShape(model_fingerprint="", layers=tuple(facts.moe_layers), n_expert=facts.n_expert,
                       n_expert_used=facts.n_expert_used, n_embd=facts.n_embd)
    monkeypatch.setattr(prefetch_mod, "live_predictor", lambda *a, **k: _Replay(shape, 2, routing))
    with _engine(model, n, "replay") as eng:
        assert eng.pipeline.mode_in_effect == "async"
        _teacher(eng, ids)
        t = eng.cache_stats.total()
        assert eng.pipeline.stride.layers_behind == 0  # lockstep: every layer read before its target started
    assert t.prefetch_issued > 0 and t.hit_rate > lru + 0.05, (t.hit_rate, lru)
