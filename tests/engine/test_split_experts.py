"""MoEpic's expert split live on the CPU build: top segments in slots, bottoms read in place or prefetched.

What the GPU relies on, proved here: logits bit-identical to stock for every fixture architecture and the
embedded model at several top shares θ (0 and 1 included, 1 equal to whole-expert caching in every count),
split layers mixed with whole ones, under every policy, in both decode modes, with copies racing on a worker
thread; prefetched bottoms and bottoms read from host memory give the same logits; the split tables really
feed the matmuls (a zeroed top segment changes the logits, a zeroed bottom buffer too once it is read).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences

from ggmoe.base.errors import EngineError, UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.split import model_split
from ggmoe.control.prefetch import PrefetchConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.inspect import inspect_model

pytestmark = pytest.mark.engine


def _engine(path, n_slots, theta, mode="async", policy="lru", prefetch=None, copy_delay_s=None) -> Engine:
    # n_ubatch 4: prefills run micro-batches of 4 tokens, which read split layers through their tables too
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                               run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy, layer_theta=theta),
                                             decode=DecodeConfig(mode=mode), prefetch=prefetch,
                                             copy_delay_s=copy_delay_s)))


def _all(facts, t: float) -> dict[int, float]:
    return dict.fromkeys(facts.moe_layers, t)


def _mixed(facts) -> dict[int, float]:
    """Every other MoE layer split at θ 0.5, the rest whole."""
    return {il: 0.5 for j, il in enumerate(facts.moe_layers) if j % 2 == 0}


def _check(got, ref, what) -> None:
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT, what


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_split_logits_equal_stock_every_arch(arch_model, stock_logits, mode):
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    n_slots = facts.n_expert_used + 1
    for name, theta in (("θ 0", _all(facts, 0.0)), ("θ 0.5", _all(facts, 0.5)), ("mixed", _mixed(facts))):
        with _engine(path, n_slots, theta, mode) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == mode
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        _check(got, ref, (arch, mode, name))
        assert st.top_hits > 0 and st.bottom_read_bytes > 0, (arch, mode, name)  # tops found, bottoms read


@pytest.mark.immediate_copies("two runs' counts are equal only when copies land at once")
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_theta_one_is_whole_expert_caching(qwen3moe_model, mode):
    """θ = 1 rounds to the whole expert: not split, the same counts as a cache without θ."""
    facts = inspect_model(qwen3moe_model)
    runs = []
    for theta in (None, _all(facts, 1.0)):
        with _engine(qwen3moe_model, facts.n_expert_used + 2, theta, mode) as eng:
            assert not eng._runtime.split
            run_sequences(eng)
            runs.append({il: {k: v for k, v in d.items() if not k.endswith("_s")}  # counts, not timings
                         for il, d in eng.cache_stats.to_dict()["layers"].items()})
    assert runs[0] == runs[1]


def test_split_logits_equal_stock_every_policy(stock_logits):
    """The embedded model, split layers mixed with whole ones, under every policy that takes no options."""
    from ggmoe.models import default_model_path

    path = default_model_path()
    facts = inspect_model(path)
    ref = stock_logits(path)
    # every live policy that needs nothing from the caller (belady: the future; static: saved counts)
    plain = [n for n in POLICIES.names() if not n.startswith("test-") and not POLICIES.get(n).needs_future
             and n != "static"]
    assert {"lru", "lfu", "lcp", "on-demand"} <= set(plain)
    for i, policy in enumerate(plain):
        theta = _mixed(facts) if i % 2 else _all(facts, 0.5)
        with _engine(path, facts.n_expert // 4, theta, "async" if i % 2 else "sync", policy) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        _check(got, ref, policy)
        if policy != "on-demand":  # on-demand keeps nothing past its call
            assert st.top_hits + st.hits > 0, policy


def test_split_under_racing_copies(qwen3moe_model, stock_logits):
    """Copies land late on a worker thread, in priority order, while the decode reads through the tables."""
    facts = inspect_model(qwen3moe_model)
    ref = stock_logits(qwen3moe_model)
    for mode in ("sync", "async"):
        with _engine(qwen3moe_model, facts.n_expert_used + 1, _all(facts, 0.5), mode, "test-random",
                     copy_delay_s=0.002) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        _check(got, ref, mode)
        assert st.admission_copies > 0


@pytest.mark.parametrize("predictor", ["skip-gate", "reuse"])
def test_prefetched_bottoms_equal_stock(arch_model, stock_logits, predictor, copy_stream):
    """MoEpic's prefetch (sync mode): bottoms of predicted experts copied into bottom buffers and read there,
    the rest read from host memory: the logits are stock's either way."""
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    cfg = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2, layer_theta=_all(facts, 0.5)),
                    decode=DecodeConfig(mode="sync"),
                    prefetch=PrefetchConfig(predictor, stride=1, n_prefetch=facts.n_expert_used))
    with Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=cfg)) as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "sync"
        assert eng._runtime.n_bottom == facts.n_expert_used
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    _check(got, ref, (arch, predictor))
    assert st.bottom_prefetches > 0 and st.bottom_prefetch_bytes > 0
    if copy_stream == "immediate":  # a stride-1 prefetch lands within one layer of a fixture only at once
        assert st.bottom_hits > 0  # some bottoms were read from their buffers
        if predictor == "reuse":
            assert st.top_hits > 0  # and some from host memory


@pytest.mark.parametrize("predictor", ["skip-gate", "reuse"])
def test_async_prefetched_bottoms_equal_stock(arch_model, stock_logits, predictor, copy_stream, monkeypatch):
    """The async decode's stride prefetch fills split layers' bottom buffers while the graph runs (the mailbox's
    reader, in lockstep so that every layer is read before its matmuls): each bottom's table entry flips to
    its buffer on the copy stream once the bottom landed (one word: address and packed flag), racing the
    kernels that read the table on the deferred stream. The logits are stock's."""
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    cfg = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2, layer_theta=_all(facts, 0.5)),
                    decode=DecodeConfig(mode="async"),
                    prefetch=PrefetchConfig(predictor, stride=1, n_prefetch=facts.n_expert_used, in_graph=False))
    if arch == "llama4" and predictor == "skip-gate":  # its MoE input is weighted first: the mailbox has ids only
        with pytest.raises(UsageError, match="weights before its experts"):
            Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=cfg))
        return
    with Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4, run=cfg)) as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "async"
        got = run_sequences(eng)
        st = eng.cache_stats.total()
    _check(got, ref, (arch, predictor))
    assert st.prefetch_issued >= st.bottom_prefetches
    if copy_stream == "immediate":  # tops readable from the next token on: bottoms go into a running graph
        assert st.bottom_prefetches > 0 and st.bottom_hits > 0 and st.prefetch_hits > 0


def test_async_bottom_flip_is_one_word_of_row_one(qwen3moe_model):
    """A bottom copy's table write (``entry_flip`` with a bottom target) is row 1's entry of the expert: its
    buffer's address or-ed with the packed flag; a top slot of a split layer gets none (its rows change
    between tokens)."""
    from ggmoe.cache.copy import bottom_target
    from ggmoe.cache.split import SPLIT_PACKED

    facts = inspect_model(qwen3moe_model)
    cfg = RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2, layer_theta=_all(facts, 0.5)),
                    decode=DecodeConfig(mode="async"),
                    prefetch=PrefetchConfig("reuse", stride=1, n_prefetch=facts.n_expert_used, in_graph=False))
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4, run=cfg)) as eng:
        tables = eng.pipeline.tables
        il = facts.moe_layers[0]
        lt = tables.layers[il]
        assert tables.entry_flip(il, 0, 3, 1) is None
        tensor, offset, value = tables.entry_flip(il, 0, 3, bottom_target(1))
        n_expert = lt.views[0].shape[1]
        assert offset == (lt.offsets[0] + n_expert + 3) * 8 and value & SPLIT_PACKED
        assert value & ~SPLIT_PACKED == lt.bottom_data[0] + lt.bottom_bytes[0]


@pytest.mark.parametrize("flag", [None, 1 << 32])
def test_an_engine_that_reads_the_packed_flag_elsewhere_is_refused(qwen3moe_model, monkeypatch, flag):
    """An engine built from older patches (no ggml_mmid_split_packed_flag, or a flag in another bit) would read a
    packed bottom in the expert's own layout: a split cache refuses it with one message, before any decode."""
    from ggmoe.base.errors import EngineNotPatchedError

    monkeypatch.setattr(B, "split_packed_flag", lambda: flag)
    facts = inspect_model(qwen3moe_model)
    with pytest.raises(EngineNotPatchedError, match="engine build --install"):
        _engine(qwen3moe_model, facts.n_expert_used + 1, _all(facts, 0.5))


def _zero(ptrs) -> None:
    for ptr in ptrs:
        t = ctypes.cast(ptr, B.ggml_tensor_p)
        n = B.libggml_base.ggml_nbytes(t)
        zeros = np.zeros(n, dtype=np.uint8)
        B.libggml_base.ggml_backend_tensor_set(t, zeros.ctypes.data, 0, n)


@pytest.mark.parametrize("theta", [0.0, 0.5])
def test_split_tables_feed_the_matmuls(qwen3moe_model, theta):
    """Zeroed slot tensors change the logits when the tops hold something (θ 0.5) and not when they are empty
    (θ 0: every byte comes from the host tensors)."""
    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert, _all(facts, theta)) as eng:
        ids = eng.tokenize("The quick brown fox jumps over")
        eng.decode(ids)
        for t in ids[:3]:  # every used expert's top admitted and landed by now
            eng.decode([t])
        eng.reset()
        before = eng.decode(ids[:1]).copy()
        _zero(p for kinds in eng._runtime.slots.tensors.values() for p in kinds.values())
        eng.reset()
        after = eng.decode(ids[:1]).copy()
    if theta == 0.0:
        assert np.array_equal(before, after)
    else:
        assert np.abs(before - after).max() > 1e-3


def _land_all(eng: Engine) -> None:
    """Wait for every copy in flight into the cache's slots and bottom buffers (their next access sees them)."""
    cache = eng._runtime.cache
    handles = [h for t in cache.tables.values() for h in t.copy if h is not None]
    handles += [h for bt in cache.bottoms.values() for h in bt.copy if h is not None]
    cache.copies.wait(handles)


def test_prefetched_bottom_buffers_feed_the_matmuls(qwen3moe_model):
    """Zeroed bottom buffers change the logits of a step that reads bottoms there (skip-gate's prefetches,
    MoEpic's own predictor: the next layer's router on this layer's hidden state)."""
    facts = inspect_model(qwen3moe_model)
    cfg = RunConfig(CacheConfig(n_slots=facts.n_expert, layer_theta=_all(facts, 0.5)),
                    decode=DecodeConfig(mode="sync"),
                    prefetch=PrefetchConfig("skip-gate", stride=1, n_prefetch=facts.n_expert_used))
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4, run=cfg)) as eng:
        ids = eng.tokenize("The quick brown fox jumps over")
        eng.decode(ids)
        bottoms = [p.bottom for ps in eng._runtime.slots.pairs.values() for p in ps]
        assert all(bottoms)
        eng.decode([ids[1]])  # prefetches this token's bottoms
        _land_all(eng)  # landed (on any copy stream): the same token reads them from their buffers
        ref = eng.decode([ids[1]]).copy()
        hits0 = eng.cache_stats.total().bottom_hits
        _zero(bottoms)
        got = eng.decode([ids[1]]).copy()
        assert eng.cache_stats.total().bottom_hits > hits0
    assert np.abs(got - ref).max() > 1e-3


@pytest.mark.immediate_copies("the bottoms a token prefetched must have landed before the next token reads them")
def test_async_prefetched_bottom_buffers_feed_the_matmuls(qwen3moe_model, monkeypatch):
    """The async decode's bottoms, prefetched into a running graph, are read from their buffers through row 1 of
    the table (flipped on the copy stream): zeroing the buffers changes the logits of a token that reads them."""
    facts = inspect_model(qwen3moe_model)
    monkeypatch.setenv("GGMOE_MAILBOX_LOCKSTEP", "1")
    cfg = RunConfig(CacheConfig(n_slots=facts.n_expert, layer_theta=_all(facts, 0.5)),
                    decode=DecodeConfig(mode="async"),
                    prefetch=PrefetchConfig("reuse", stride=1, n_prefetch=facts.n_expert_used, in_graph=False))
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4, run=cfg)) as eng:
        ids = eng.tokenize("The quick brown fox jumps over")
        eng.decode(ids)
        for _ in range(4):  # tops admitted and landed, then reuse's bottoms prefetched into the running graphs
            eng.decode([ids[1]])
        st = eng.cache_stats.total()
        assert st.bottom_prefetches > 0
        ref = eng.decode([ids[1]]).copy()
        hits0 = eng.cache_stats.total().bottom_hits
        _zero(p.bottom for ps in eng._runtime.slots.pairs.values() for p in ps)
        got = eng.decode([ids[1]]).copy()
        assert eng.cache_stats.total().bottom_hits > hits0
    assert np.abs(got - ref).max() > 1e-3


@pytest.mark.parametrize("cache_kw, message", [
    ({"miss_policy": "cpu"}, "host path"),
    ({"layer_theta": {0: 1.5}}, "from 0 to 1"),
    ({"layer_theta": {999: 0.5}}, "not MoE layers"),
])
def test_split_usage_errors(qwen3moe_model, cache_kw, message):
    facts = inspect_model(qwen3moe_model)
    kw = {"layer_theta": _all(facts, 0.5), **cache_kw}
    miss = kw.pop("miss_policy", "wait")
    with pytest.raises((UsageError, EngineError), match=message):
        run = RunConfig(CacheConfig(n_slots=4, **kw), decode=DecodeConfig(miss_policy=miss))
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, run=run))


def test_split_geometry_matches_the_slot_tensors(qwen3moe_model):
    """What the cache counts per top segment is what the engine allocates and copies."""
    facts = inspect_model(qwen3moe_model)
    split = model_split(facts, _all(facts, 0.5))
    with _engine(qwen3moe_model, 5, _all(facts, 0.5)) as eng:
        for il, ps in eng._runtime.slots.pairs.items():
            assert sum(p.slot_bytes for p in ps) == split[il].top_bytes
            assert sum(p.nb2 for p in ps) == split[il].expert_bytes
            assert eng._runtime.cache.slot_bytes[il] == split[il].top_bytes


def test_reconfigure_between_requests_keeps_stock_logits(qwen3moe_model, stock_logits):
    """The cache rebuilt between sequences (whole experts -> split -> other slots, both decode modes) and in
    the middle of one (the KV cache stays): every logit is stock's; the new configuration is the one in use."""
    facts = inspect_model(qwen3moe_model)
    ref = stock_logits(qwen3moe_model)
    configs = [RunConfig(CacheConfig(n_slots=facts.n_expert_used), decode=DecodeConfig(mode="async")),
               RunConfig(CacheConfig(n_slots=facts.n_expert_used + 2, layer_theta=_mixed(facts)),
                         decode=DecodeConfig(mode="sync")),
               RunConfig(CacheConfig(n_slots=facts.n_expert, layer_theta=_all(facts, 0.5)),
                         decode=DecodeConfig(mode="async"))]
    from test_cache_engine import N_DECODE, TEXTS

    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, n_batch=64, n_ubatch=4,
                             run=configs[0])) as eng:
        got = []
        for i, text in enumerate(TEXTS):
            eng.reset()
            ids = eng.tokenize(text)
            got.append(eng.decode(ids, all_logits=True))
            for j, t in enumerate(ids[1: 1 + N_DECODE]):
                if j == 2:  # mid-sequence: the next configuration
                    eng.reconfigure(configs[(2 * i + 1) % len(configs)])
                    assert eng.config.run is configs[(2 * i + 1) % len(configs)]
                got.append(eng.decode([t]))
            eng.reconfigure(configs[(2 * i + 2) % len(configs)])
        assert eng.cache_slots == dict.fromkeys(facts.moe_layers, configs[(2 * len(TEXTS)) % 3].cache.n_slots)
        with pytest.raises(UsageError, match="not MoE layers"):  # a bad plan leaves the cache as it was
            eng.reconfigure(RunConfig(CacheConfig(n_slots=4, layer_theta={999: 0.5})))
        assert eng.cache_stats is not None
    _check(got, ref, "reconfigured")
