"""In-graph fills on the CPU build (patch 0012): the async decode's misses filled into slots by the graph.

Exact logits on every fixture architecture; a miss crosses the link once (link bytes against the bytes of the
experts missed) at a hit rate close to sync LRU's; a free fill slot is never read before the graph filled
it (poisoned before every decode); what the graph reports it filled is what ``assign`` computes. Every test
runs on both CPU copy streams (the conftest's ``copy_stream``): nothing here relies on a copy landing at once.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_cache_engine import EXACT, TEXTS, run_sequences

from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.cache.fill import assign
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.engine import tables as tables_mod
from ggmoe.inspect import inspect_model

pytestmark = pytest.mark.engine


def _engine(path, n_slots, mode="async", fills=True, policy="lru") -> Engine:
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=4,
                               run=RunConfig(CacheConfig(n_slots=n_slots, policy=policy),
                                             decode=DecodeConfig(mode=mode, fills=fills))))


def _decode_text(eng: Engine, n: int = 24) -> None:
    """Each text's tokens as ``n + 1`` teacher-forced one-token decodes (the decodes that fill)."""
    for text in TEXTS:
        eng.reset()
        ids = eng.tokenize(text) * 4
        for t in ids[: 1 + n]:
            eng.decode([t])


def test_fills_give_stock_logits_and_replace_admissions(arch_model, stock_logits, copy_stream):
    """Stock's logits on both streams; fills happen (immediate copies: on the deferred stream an admission's copy,
    once put, cannot be cancelled, and while it is late its slot is no fill slot, so how many fills a run gets
    depends on the machine's speed)."""
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    for n_slots in sorted({facts.n_expert_used, facts.n_expert // 2}):
        with _engine(path, n_slots) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
            assert eng.pipeline.tables.fills is not None, arch
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, n_slots)
        assert st.fills > 0 or copy_stream == "deferred", (arch, n_slots)


def _link(st) -> tuple[float, float]:
    """(bytes over the link, bytes of the experts missed) of a run's totals."""
    per_expert = st.bytes_copied / max(st.demand_copies + st.admission_copies + st.prefetch_issued + st.fills, 1)
    return st.host_read_bytes + st.bytes_copied, st.misses * per_expert


def test_a_miss_crosses_the_link_once_at_sync_lrus_hit_rate(arch_model):
    """Link bytes (read in place plus copied) at most 1.10x the missed experts' bytes, and the hit rate within
    3 points of sync LRU's at the same slots, on the same tokens."""
    arch, path = arch_model
    facts = inspect_model(path)
    n_slots = max(facts.n_expert_used, facts.n_expert // 2)
    rates = {}
    for mode in ("async", "sync"):
        with _engine(path, n_slots, mode=mode) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == mode
            _decode_text(eng)
            st = eng.cache_stats.total()
        rates[mode] = st.hit_rate
        if mode == "async":
            moved, missed = _link(st)
            assert st.misses > 0 and moved <= 1.10 * missed, (arch, moved, missed, st.to_dict())
    assert rates["async"] >= rates["sync"] - 0.03, (arch, rates)


def test_without_fills_each_miss_crosses_twice(qwen3moe_model):
    """The control: fills off, the async decode reads a miss in place and then admits it."""
    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert // 2, fills=False) as eng:
        assert eng.pipeline.tables.fills is None
        _decode_text(eng)
        st = eng.cache_stats.total()
    assert st.fills == 0 and st.host_reads > 0 and st.admission_copies > 0


class _Poisoner:
    """Wraps ``FillWords.write``: after each offer is written, its free fill slots are filled with NaN poison. A
    graph that read a free fill slot before filling it would change the logits."""

    def __init__(self, eng: Engine) -> None:
        self.pairs = eng._runtime.slots.pairs
        self.words = eng.pipeline.tables.fills
        self.poisoned = 0
        self._write = self.words.write
        self.words.write = self.write

    def write(self, targets) -> None:
        self._write(targets)
        for p in targets:
            for slot, held in zip(p.slots, p.held, strict=True):
                if held < 0:
                    self._poison(p.il, slot)

    def _poison(self, il: int, slot: int) -> None:
        for pair in self.pairs[il]:
            poison = np.full(pair.nb2, 0xFF, dtype=np.uint8)  # NaN in every float format, garbage in quants
            B.libggml_base.ggml_backend_tensor_set(ctypes.cast(pair.cache, B.ggml_tensor_p), poison.ctypes.data,
                                                   slot * pair.slot_bytes, pair.nb2)
        self.poisoned += 1


def test_a_free_fill_slot_is_never_read_before_its_fill(qwen3moe_model, stock_logits):
    facts = inspect_model(qwen3moe_model)
    ref = stock_logits(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert // 2) as eng:
        poisoner = _Poisoner(eng)
        got = run_sequences(eng)
        fills = eng.cache_stats.total().fills
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT
    assert poisoner.poisoned > 0 and fills > 0


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])  # tinylfu: the admission filter's scores and bars
def test_the_graph_fills_what_assign_computes(qwen3moe_model, monkeypatch, policy):
    """The fills read back after each decode equal ``assign`` of the targets on the routing the decode reported
    and the experts readable at launch (no stride prefetch: nothing else changes the tables mid-graph)."""
    facts = inspect_model(qwen3moe_model)
    seen = []
    read = tables_mod.FillWords.read

    def checked(self):
        out = read(self)
        seen.append(out)
        return out

    monkeypatch.setattr(tables_mod.FillWords, "read", checked)
    with _engine(qwen3moe_model, facts.n_expert_used + 1, policy=policy) as eng:
        cache, tables = eng._runtime.cache, eng.pipeline.tables
        for text in TEXTS:
            eng.reset()
            ids = eng.tokenize(text)
            eng.decode(ids[:1])
            for t in ids[1:9]:
                targets = {}
                write = tables.fills.write

                def keep(ps, write=write, targets=targets):
                    targets.update({p.il: p for p in ps})
                    readable = {il: {e for s, e in enumerate(cache.tables[il].expert_in_list)
                                     if e >= 0 and cache.tables[il].copy[s] is None} for il in targets}
                    targets["readable"] = readable
                    write(ps)

                tables.fills.write = keep
                eng.decode([t])
                tables.fills.write = write
                routing = tables.read_routing(1)
                expect = []
                for il, ft in targets.items():
                    if il == "readable":
                        continue
                    expect += assign(ft, routing[il, 0].tolist(), targets["readable"][il])
                assert sorted(seen[-1], key=lambda f: (f.il, f.expert)) == sorted(expect, key=lambda f: (f.il, f.expert))
    assert any(seen)


def test_set_layer_fill_refuses_what_the_graph_cannot_fill(qwen3moe_model):
    """``llama_ggmoe_set_layer_fill``: words of the wrong type or size, an unknown layer; NULL removes them."""
    from ggmoe.engine import patch as P

    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert // 2) as eng:
        lib, ctx, tables = P.symbols(), eng.pipeline._ctx_ptr, eng.pipeline.tables
        il = facts.moe_layers[0]
        assert lib.llama_ggmoe_set_layer_fill(ctx, il, tables.routing) == P.LLAMA_GGMOE_ERR_SHAPE  # I32
        assert lib.llama_ggmoe_set_layer_fill(ctx, -1, tables.fills.views[0]) == P.LLAMA_GGMOE_ERR_LAYER
        assert lib.llama_ggmoe_set_layer_fill(ctx, il, None) == P.LLAMA_GGMOE_OK
        row = tables.fills.row[il]
        assert lib.llama_ggmoe_set_layer_fill(ctx, il, tables.fills.views[row]) == P.LLAMA_GGMOE_OK
        _decode_text(eng, 8)
        assert eng.cache_stats.total().fills > 0


def test_a_decode_that_failed_after_its_graph_is_settled_before_the_next(qwen3moe_model, stock_logits, monkeypatch):
    """The controller's step after a decode raises (the graph had filled slots): the next decode reads the fills
    back and settles them before it offers the next fill slots, so no entry is left pointing at a slot that holds another expert."""
    from ggmoe.engine.pipeline import CachePipeline

    facts = inspect_model(qwen3moe_model)
    ref = stock_logits(qwen3moe_model)
    real = CachePipeline.after_decode
    failed = []

    def once(self, n_tokens):
        if not failed and self.runtime.cache.fill_targets:
            failed.append(n_tokens)
            raise RuntimeError("the controller's step failed")
        return real(self, n_tokens)

    with _engine(qwen3moe_model, facts.n_expert // 2) as eng:
        eng.reset()
        ids = eng.tokenize(TEXTS[0])
        eng.decode(ids[:1])
        monkeypatch.setattr(CachePipeline, "after_decode", once)
        with pytest.raises(RuntimeError, match="controller's step failed"):
            for t in ids[1:6]:
                eng.decode([t])
        monkeypatch.setattr(CachePipeline, "after_decode", real)
        got = run_sequences(eng)  # from fresh sequences: every logit as stock's
        fills = eng.cache_stats.total().fills
    assert failed and fills > 0
    for a, b in zip(got, ref, strict=True):
        assert np.abs(a - b).max() <= EXACT
