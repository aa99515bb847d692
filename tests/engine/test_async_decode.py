"""The async decode on the CPU build: experts read through the expert tables, the cache managed between tokens.

What the GPU relies on, proved here: logits bit-identical to stock for any table state (every fixture
architecture, the embedded model, several policies); no slot is read while a racing copy writes it (copies
delayed and reordered on worker threads, slots poisoned before every write, random plans over thousands of
tokens); no Python call per MoE layer on the decode path; the tables really feed the matmuls.
"""

from __future__ import annotations

import ctypes
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from test_cache_engine import EXACT, run_sequences, zero_slots

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.cache import CacheConfig
from ggmoe.cache.copy import CopyHandle, Priority
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.prefetch import build_prefetch_config
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine import ggml as B
from ggmoe.inspect import inspect_model

pytestmark = pytest.mark.engine


def _engine(path, n_slots, policy="lru", mode="async", n_ubatch=4, prefetch=None, miss_policy="wait") -> Engine:
    # n_ubatch 4 (n_batch 64): prefills run the route op per micro-batch, their last partial micro-batch and
    # every decode step read through the tables, so both paths share one cache. Fills off: this file holds the
    # reads in place and the admission copies racing the decodes (tests/engine/test_fills.py: the fills)
    run = RunConfig(CacheConfig(n_slots=n_slots, policy=policy),
                    decode=DecodeConfig(mode=mode, fills=False, miss_policy=miss_policy), prefetch=prefetch)
    return Engine(EngineConfig(model_path=path, n_ctx=256, n_batch=64, n_ubatch=n_ubatch, run=run))


@pytest.mark.parametrize("policy", ["lru", "test-random", "tinylfu"])  # tinylfu: the admission filter's path
def test_async_logits_equal_stock_path(arch_model, stock_logits, policy, copy_stream):
    arch, path = arch_model
    facts = inspect_model(path)
    ref = stock_logits(path)
    for n_slots in sorted({facts.n_expert_used, facts.n_expert // 2, facts.n_expert}):
        with _engine(path, n_slots, policy) as eng:
            assert eng.decode_mode["decode_mode_in_effect"] == "async"
            got = run_sequences(eng)
            st = eng.cache_stats.total()
            ctl = eng.pipeline.controller
        for a, b in zip(got, ref, strict=True):
            assert np.abs(a - b).max() <= EXACT, (arch, n_slots, policy)
        assert ctl.tokens >= 2 * 6  # every decode step went through the controller
        if copy_stream == "immediate":  # deferred copies land when their threads run: a short run may see none
            assert st.hits > 0
        if n_slots < facts.n_expert:  # prefills fill what fits; decode steps then miss and admit
            assert st.host_reads > 0 and st.admission_copies > 0


@pytest.mark.parametrize("n_ubatch", [4, 64])
def test_async_embedded_model_logits_equal_stock_path(stock_logits, n_ubatch):
    from ggmoe.models import default_model_path

    path = default_model_path()
    for n_slots, policy in ((4, "lru"), (16, "lfu"), (32, "lru")):
        with _engine(path, n_slots, policy, n_ubatch=n_ubatch) as eng:
            got = run_sequences(eng)
            st = eng.cache_stats.total()
        for a, b in zip(got, stock_logits(path), strict=True):
            assert np.abs(a - b).max() <= EXACT, (n_slots, policy, n_ubatch)
        if n_slots == 32:  # every expert fits: after the cold misses, only hits
            assert st.evictions == 0


@pytest.mark.parametrize("predictor", [None, "reuse"])
def test_no_python_call_per_moe_layer_when_decoding(qwen3moe_model, predictor):
    """A decode step is one llama_decode with no route callback; the controller runs once per token. With a
    predictor on, the stride prefetch reads the mailbox on its own thread: still no callback, no sync."""
    facts = inspect_model(qwen3moe_model)
    prefetch = build_prefetch_config(predictor, 1) if predictor else None
    with _engine(qwen3moe_model, facts.n_expert_used + 1, prefetch=prefetch) as eng:
        ids = eng.tokenize("The quick brown fox jumps")
        eng.decode(ids)  # prefill: route op per micro-batch of 4
        ctl = eng.pipeline.controller
        tokens0, calls0 = ctl.tokens, ctl.calls
        eng.record_hook_times()
        for t in ids[:8]:
            eng.decode([t])
        assert len(eng.hook_times) == 0  # the route callback never ran
        assert ctl.tokens - tokens0 == 8  # one controller step per decode
        assert ctl.calls - calls0 == 8 * len(facts.moe_layers)  # each layer's routing, after the decode
        if predictor:  # the mailbox's reader read decode tokens (not those an idle predictor skips), and the
            # predictor prefetched from it
            assert eng.pipeline.stride.tokens >= 1 and eng.cache_stats.total().prefetch_issued > 0
        # with an observer that reads hidden states, the same decode takes the route op again (sync path)
        rec = RouteRecorder(HookRequest(probs=True, hidden=True))
        with eng.observing(rec):
            assert eng.decode_mode["decode_mode_in_effect"] == "sync"
            eng.decode([ids[0]])
            assert len(eng.hook_times) == len(facts.moe_layers)
            assert all(ev.hidden is not None for ev in rec.take().values())
        assert eng.decode_mode["decode_mode_in_effect"] == "async"


def test_observers_get_the_routing_once_per_token(qwen3moe_model):
    """The routing leaves the device once per token; observers see the same ids as in sync mode."""
    facts = inspect_model(qwen3moe_model)
    seen = {}
    for mode in ("async", "sync"):
        rec = RouteRecorder(HookRequest(probs=False, hidden=False))
        with _engine(qwen3moe_model, facts.n_expert_used, mode=mode) as eng:
            ids = eng.tokenize("hello world, hello")
            eng.decode(ids)
            rec_events = []
            with eng.observing(rec):
                for t in ids[:5]:
                    eng.decode([t])
                    rec_events.append({il: ev.ids.copy() for il, ev in rec.take().items()})
        seen[mode] = rec_events
    assert len(seen["async"]) == 5
    for a, s in zip(seen["async"], seen["sync"], strict=True):
        assert a.keys() == s.keys() == set(facts.moe_layers)
        for il in a:
            assert np.array_equal(a[il], s[il])


def test_tables_really_feed_the_matmuls(qwen3moe_model):
    """Zeroed slots change the logits once every entry points at a slot; pointing the entries back at host
    memory restores the stock logits (the same bytes, read from the model's tensors)."""
    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert) as eng:
        ids = eng.tokenize("hello there, general")
        eng.decode(ids)
        for t in ids:  # warm: every selected expert admitted and landed
            eng.decode([t])
        eng.reset()
        before = eng.decode(ids[:3])
        zero_slots(eng)
        eng.reset()
        zeroed = eng.decode(ids[:3])  # 3 tokens: table mode; the resident experts read from zeroed slots
        for table in eng._runtime.cache.tables.values():
            table.clear()  # every entry back to host memory (the listener)
        eng.reset()
        restored = eng.decode(ids[:3])
    assert np.abs(zeroed - before).max() > 1e-3
    assert np.abs(restored - before).max() <= EXACT


class RacingCopies:
    """Copies forced to race the decodes: ``submit`` fills the slot with NaN poison at once; a worker thread
    (three of them, random short delays, so copies land out of order) writes the expert only after the next
    decode has begun (``decode_begins``, called from the pipeline right before ``llama_decode``). So every
    copy's slot holds poison while at least one decode launches and runs: a graph that read a slot before
    its copy landed would see NaN or another expert's weights. Interleavings are forced, not timed."""

    def __init__(self, pairs, seed: int) -> None:
        self.pairs = pairs
        self.rng = random.Random(seed)
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="racing-copy")
        self.futures: dict[int, Future] = {}
        self.cv = threading.Condition()
        self.decodes = 0  # decodes begun
        self.closing = False
        self.n = 0
        self.raced: list[tuple[int, int]] = []  # (decodes begun at submit, decodes begun when written)

    def decode_begins(self) -> None:
        with self.cv:
            self.decodes += 1
            self.cv.notify_all()

    def _poison(self, il: int, slot: int) -> None:
        for p in self.pairs[il]:
            poison = np.full(p.nb2, 0xFF, dtype=np.uint8)  # NaN in every float format, garbage in quants
            B.libggml_base.ggml_backend_tensor_set(ctypes.cast(p.cache, B.ggml_tensor_p), poison.ctypes.data,
                                                   slot * p.nb2, p.nb2)

    def _copy(self, il: int, expert: int, slot: int, at: int, delay: float) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.decodes > at or self.closing)
            if self.decodes <= at:
                return  # closing: no decode will read it
        time.sleep(delay)
        for p in self.pairs[il]:
            B.libggml_base.ggml_backend_tensor_set(ctypes.cast(p.cache, B.ggml_tensor_p),
                                                   p.host_data + expert * p.nb2, slot * p.nb2, p.nb2)
        with self.cv:
            self.raced.append((at, self.decodes))

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        self._poison(il, slot)  # the table stopped pointing at the slot before the cache submitted
        with self.cv:
            h = CopyHandle(self.n, il, expert, slot, Priority(priority))
            self.n += 1
            at, delay = self.decodes, self.rng.uniform(0, 0.001)
        self.futures[h.id] = self.pool.submit(self._copy, il, expert, slot, at, delay)
        return h

    def done(self, handle: CopyHandle) -> bool:
        f = self.futures[handle.id]
        if f.done():
            f.result()
            return True
        return False

    def wait(self, handles) -> None:
        for h in handles:
            self.futures[h.id].result()

    def cancel(self, handle: CopyHandle) -> bool:
        return False

    def close(self) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        self.pool.shutdown(wait=True)


def test_racing_copies_never_change_a_token(qwen3moe_model):
    """Random plans (a random-victim policy, few slots) over 1200 tokens with every copy forced to race at
    least one decode: every logit equals the stock path's."""
    facts = inspect_model(qwen3moe_model)
    rng = np.random.default_rng(7)
    n_vocab = 0
    seqs = []
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=256, gate_hook=False)) as stock:
        n_vocab = stock.n_vocab
        for _ in range(6):  # 6 sequences x 200 forced tokens
            toks = rng.integers(0, n_vocab, size=200).tolist()
            stock.reset()
            seqs.append((toks, [stock.decode([t]) for t in toks]))
    with _engine(qwen3moe_model, facts.n_expert_used + 1, "test-random") as eng:
        cache = eng._runtime.cache
        racing = RacingCopies(eng._runtime.slots.pairs, seed=3)
        cache.copies = racing
        begin = eng.pipeline.begin_step

        def begin_step(tokens):
            begin(tokens)
            racing.decode_begins()  # right before llama_decode

        eng.pipeline.begin_step = begin_step
        try:
            for toks, ref in seqs:
                eng.reset()
                for t, r in zip(toks, ref, strict=True):
                    got = eng.decode([t])
                    assert np.array_equal(got, r)
        finally:
            racing.close()
        st = cache.stats.total()
    assert racing.n >= 100 and st.landed >= 100  # copies were made and landed (a random policy on 5 of 8 slots)
    # every copy written had its slot poisoned while a decode began after it was submitted
    assert len(racing.raced) >= st.landed and all(w > a for a, w in racing.raced)
    assert st.lag_tokens >= st.landed  # so none was seen landed in the token that submitted it
    assert st.host_reads > 0


def test_decode_mode_choice(qwen3moe_model):
    facts = inspect_model(qwen3moe_model)
    with _engine(qwen3moe_model, facts.n_expert_used, mode="auto") as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "async"
    with _engine(qwen3moe_model, facts.n_expert_used + 1, mode="auto", miss_policy="cpu") as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "sync"
        assert "host path" in eng.decode_mode["decode_mode_reason"]
    with _engine(qwen3moe_model, facts.n_expert_used + 1, mode="async", miss_policy="cpu") as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "async"  # its CPU experts in the graph's host part
    with _engine(qwen3moe_model, facts.n_expert_used, mode="sync") as eng:
        assert eng.decode_mode["decode_mode_in_effect"] == "sync" and eng.pipeline.tables is None
    with pytest.raises(UsageError, match="unknown decode mode"):
        _engine(qwen3moe_model, facts.n_expert_used, mode="fast")
