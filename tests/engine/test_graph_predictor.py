"""Patch 0005: the route op's inputs follow what the observers read, and the in-graph predictor.

The in-graph predictor's logits equal numpy's on the same MoE input, the model's logits stay exact, the
prefetches follow the same scores as in Python, and ``llama_ggmoe_set_predictor`` refuses what it cannot
compute. The in-graph predictor serves the sync decode's route op: every engine here asks for the sync mode
(``auto`` weighs the modes and takes async on the CPU build).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.base.hook import HookRequest
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.inspect import inspect_model
from ggmoe.inspect.fingerprint import model_fingerprint
from ggmoe.models import default_model_path
from ggmoe.predict import ModelShape
from ggmoe.predict.mlp_file import read_predictor_file
from tools.fixtures.random_predictor import random_predictor_file


class Recorder:
    """Keeps every route event, with the MoE input (to recompute the nets in numpy)."""

    request = HookRequest(probs=False, hidden=True)

    def __init__(self) -> None:
        self.events = []

    def on_route(self, event) -> None:
        self.events.append(event)


def _nets(model, path):
    facts = inspect_model(model)
    shape = ModelShape(model_fingerprint=model_fingerprint(model), layers=tuple(facts.moe_layers),
                       n_expert=facts.n_expert, n_expert_used=facts.n_expert_used, n_embd=facts.n_embd)
    return {n.il: n for n in read_predictor_file(path, shape).nets}


@pytest.mark.parametrize(("kind", "stride"), [("mlp", 1), ("mlp", 2), ("linear", 1)])
def test_graph_logits_equal_numpy(tmp_path, kind, stride):
    model = default_model_path()
    pred = random_predictor_file(model, tmp_path / "p.npz", kind=kind, stride=stride, hidden=48, seed=stride)
    rec = Recorder()
    run = RunConfig(CacheConfig(n_slots=8), decode=DecodeConfig(mode="sync"),
                    prefetch=PrefetchConfig(str(pred), stride=stride))
    cfg = EngineConfig(model_path=model, n_ctx=256, run=run)
    with Engine(cfg, observer=rec) as eng:
        assert eng._graph_predictor is not None
        assert eng.prefetcher.request.hidden is False  # the graph computes from the input: no copy for it
        eng.generate("def fib(n):", 12)
    nets = _nets(model, pred)
    with_scores = [e for e in rec.events if e.scores is not None]
    assert {e.il for e in with_scores} == set(nets)  # every source layer with a net, and only those
    assert len(with_scores) >= 12 * len(nets)
    for e in with_scores:
        want = nets[e.il].logits(e.hidden)
        assert e.scores.shape == want.shape
        assert np.abs(e.scores - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), e.il


@pytest.mark.parametrize("miss_policy", ["wait", "cpu"])
def test_logits_stay_exact_with_the_predictor_in_the_graph(arch_model, stock_logits, tmp_path, miss_policy):
    arch, path = arch_model
    facts = inspect_model(path)
    stride = min(2, len(facts.moe_layers) - 1)
    pred = random_predictor_file(path, tmp_path / "p.npz", stride=stride, hidden=32)
    # the graph computes the nets for the route op's callback: the sync decode
    run = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2),
                    decode=DecodeConfig(miss_policy=miss_policy, mode="sync"),
                    prefetch=PrefetchConfig(str(pred), stride=stride))
    cfg = EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=run)
    with Engine(cfg) as eng:
        assert eng._graph_predictor is not None
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    for a, b in zip(got, stock_logits(path), strict=True):
        assert np.abs(a - b).max() <= EXACT, (arch, miss_policy)
    assert st.pred_total > 0


@pytest.mark.immediate_copies("two runs' counts are equal only when copies land at once")
def test_prefetches_follow_the_same_scores_in_the_graph_and_in_numpy(tmp_path):
    model = default_model_path()
    pred = random_predictor_file(model, tmp_path / "p.npz", stride=2, hidden=64, seed=7)
    counts = {}
    for in_graph in (True, False):
        run = RunConfig(CacheConfig(n_slots=8), decode=DecodeConfig(mode="sync"),
                        prefetch=PrefetchConfig(str(pred), stride=2, in_graph=in_graph))
        cfg = EngineConfig(model_path=model, n_ctx=256, run=run)
        with Engine(cfg) as eng:
            assert (eng._graph_predictor is not None) == in_graph
            tokens = eng.generate("The expert cache keeps", 24).token_ids
            t = eng.cache_stats.total()
        counts[in_graph] = (tokens, t.prefetch_issued, t.prefetch_hits, t.pred_correct, t.pred_total)
    assert counts[True] == counts[False]


def test_non_mlp_predictors_stay_in_python():
    run = RunConfig(CacheConfig(n_slots=8), decode=DecodeConfig(mode="sync"),
                    prefetch=PrefetchConfig("reuse", stride=1))
    cfg = EngineConfig(model_path=default_model_path(), n_ctx=128, run=run)
    with Engine(cfg) as eng:
        assert eng._graph_predictor is None
        eng.generate("hi", 4)


def _f32(ctx, *ne):
    t = B.libggml_base.ggml_new_tensor_3d(ctx, B.GGML_TYPE_F32, ne[0], ne[1] if len(ne) > 1 else 1, 1)
    return ctypes.cast(t, ctypes.c_void_p).value


def test_set_predictor_checks_its_arguments():
    """deepseek2's layer 0 is dense; every refusal changes nothing, and w2 NULL removes the predictor."""
    from tools.fixtures.make_fixtures import fixture_path

    E = _patched
    P = _patched.symbols()
    path = fixture_path("deepseek2")
    facts = inspect_model(path)
    il = facts.moe_layers[0]
    d, h, e = facts.n_embd, facts.n_expert + 3, facts.n_expert
    with Engine(EngineConfig(model_path=path, n_ctx=64)) as eng:
        ctx = eng.ctx_ptr
        params = B.ggml_init_params(mem_size=16 * B.libggml_base.ggml_tensor_overhead(), mem_buffer=None,
                                    no_alloc=True)
        gctx = B.libggml_base.ggml_init(params)
        w1, b1, w2, b2 = _f32(gctx, d, h), _f32(gctx, h), _f32(gctx, h, e), _f32(gctx, e)
        bad_w1 = _f32(gctx, d + 1, h)
        lin_w2 = _f32(gctx, d, e)
        assert P.llama_ggmoe_set_predictor(ctx, il, w1, b1, w2, b2) == E.LLAMA_GGMOE_ERR_ARG  # no memory yet
        buf = B.libggml_base.ggml_backend_alloc_ctx_tensors_from_buft(gctx, B.libggml_cpu.ggml_backend_cpu_buffer_type())
        try:
            assert P.llama_ggmoe_set_predictor(ctx, il, bad_w1, b1, w2, b2) == E.LLAMA_GGMOE_ERR_ARG  # not n_embd
            assert P.llama_ggmoe_set_predictor(ctx, il, w1, b2, w2, b2) == E.LLAMA_GGMOE_ERR_ARG  # b1 of the wrong size
            assert P.llama_ggmoe_set_predictor(ctx, il, None, None, w2, b2) == E.LLAMA_GGMOE_ERR_ARG  # linear: n_embd in
            assert P.llama_ggmoe_set_predictor(ctx, 0, w1, b1, w2, b2) == E.LLAMA_GGMOE_ERR_NOT_MOE
            assert P.llama_ggmoe_set_predictor(ctx, eng.n_layer, w1, b1, w2, b2) == E.LLAMA_GGMOE_ERR_LAYER
            assert P.llama_ggmoe_set_predictor(None, il, w1, b1, w2, b2) == E.LLAMA_GGMOE_ERR_ARG
            assert P.llama_ggmoe_set_predictor(ctx, il, w1, b1, w2, b2) == E.LLAMA_GGMOE_OK
            assert P.llama_ggmoe_set_predictor(ctx, il, None, None, lin_w2, b2) == E.LLAMA_GGMOE_OK
            assert P.llama_ggmoe_set_predictor(ctx, il, None, None, None, None) == E.LLAMA_GGMOE_OK  # removed
            eng.generate("hello", 2)  # the graph without a predictor still runs
        finally:
            B.libggml_base.ggml_backend_buffer_free(buf)
            B.libggml_base.ggml_free(gctx)


def test_load_puts_the_mlp_in_the_graph(tmp_path):
    import ggmoe

    model = default_model_path()
    pred = random_predictor_file(model, tmp_path / "p.npz", stride=2, hidden=32)
    llm = ggmoe.load(model, cache_slots=8, predictor=str(pred), stride=2, n_ctx=256, decode_mode="sync",
                     verbose=False)
    try:
        assert llm.attachment.graph_predictor is not None
        out = llm.create_completion("def fib(n):", max_tokens=8, temperature=0)
        assert out["choices"][0]["text"] is not None
        assert llm.stats()["cache"]["total"]["pred_total"] > 0
    finally:
        llm.close()


class Seen:
    """Whether the callback got the router probabilities and the MoE input (not NULL)."""

    def __init__(self, probs: bool, hidden: bool) -> None:
        self.request = HookRequest(probs=probs, hidden=hidden)
        self.got: set[tuple[bool, bool]] = set()

    def on_route(self, event) -> None:
        self.got.add((event.probs is not None, event.hidden is not None))


def test_the_route_op_takes_only_the_inputs_an_observer_reads():
    """Without a reader the op drops probs and inp (on a GPU: two copies to the host per layer fewer); an
    observer that reads them brings them back at the next decode, and the logits never change."""
    from ggmoe.engine.hooks import RouteOpHook

    calls = []
    cfg = EngineConfig(model_path=default_model_path(), n_ctx=128, run=RunConfig(CacheConfig(n_slots=8)))
    with Engine(cfg) as eng:
        hook = eng._hook
        assert isinstance(hook, RouteOpHook)
        original = hook._route

        def spy(user_data, il, n_tokens, k, n_expert, n_embd, ids_p, probs_p, inp_p, *rest):
            calls.append((bool(probs_p), bool(inp_p)))
            return original(user_data, il, n_tokens, k, n_expert, n_embd, ids_p, probs_p, inp_p, *rest)

        hook._route = spy  # the C callback calls through the bound attribute
        hook.c_callback = _patched.route_cb(lambda *a: hook._route(*a))
        _patched.symbols().llama_ggmoe_set_route_cb(eng.ctx_ptr, hook.c_callback, None)
        ids = eng.tokenize("The expert cache keeps")
        plain = eng.decode(ids).copy()
        assert set(calls) == {(False, False)}
        reader = Seen(probs=True, hidden=True)
        with eng.observing(reader):
            eng.reset()
            calls.clear()
            read = eng.decode(ids).copy()
            assert set(calls) == {(True, True)} and reader.got == {(True, True)}
        eng.reset()
        calls.clear()
        again = eng.decode(ids).copy()
        assert set(calls) == {(False, False)}
    assert np.array_equal(plain, read) and np.array_equal(plain, again)
