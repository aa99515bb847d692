"""``serve --parallel``'s slots below HTTP: several sequences in one llama_decode, each slot's own text and
sampler, its share of the context, its KV state, and the expert cache seeing the union of the slots' experts
(the embedded model: real learned routing)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ggmoe
from ggmoe.base.errors import ContextLengthError
from ggmoe.base.hook import HookRequest, RouteRecorder
from ggmoe.engine.parallel import LanePool
from ggmoe.engine.sequences import SeqEntry

N_SLOTS = 4
N_CTX = 256 * N_SLOTS  # tokens: 256 per slot
PROMPTS = ("The king of France", "Once upon a time", "In the year 1900, the", "Water is made of")
SAMPLING = [  # (create_completion keyword arguments), each slot with its own sampler chain
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 11},
    {"temperature": 0.7, "repeat_penalty": 1.3, "seed": 5},
]


def _load(cache_slots: int | None, kv_unified: bool, **kw) -> ggmoe.GgmoeLlama:
    cache = {"cache_slots": cache_slots} if cache_slots else {}
    return ggmoe.load(None, n_ctx=N_CTX, n_seq_max=N_SLOTS, kv_unified=kv_unified, seed=1, n_threads=1,
                      n_threads_batch=1, **cache, **kw)


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("cache_slots", [None, 8], ids=["no-cache", "cache8"])
def test_a_sequence_has_the_same_logits_in_any_batch(kv_unified, cache_slots):
    """The same KV layout, one sequence's row decoded alone, with one other and with three others: equal
    to the bit."""
    with _load(cache_slots, kv_unified) as llm:
        for s in range(N_SLOTS):
            llm.decode_sequences([SeqEntry(s, 0, tuple(range(40 + 9 * s, 52 + 9 * s)))])
        rows = []
        for width in (1, 2, 4, 1):
            for s in range(N_SLOTS):
                llm._ctx.kv_cache_seq_rm(s, 12, -1)
            rows.append(llm.decode_sequences([SeqEntry(s, 12, (100 + s,)) for s in range(width)])[0])
    for r in rows[1:]:
        assert np.array_equal(rows[0], r)


def _alone(pool: LanePool, kwargs: dict) -> list[str]:
    out = []
    for i, p in enumerate(PROMPTS):
        pool.lanes[0].forget()
        out.append(pool.lanes[0].create_completion(p, max_tokens=32, **kwargs)["choices"][0]["text"])
        assert i == 0 or out[i]  # texts of something
    return out


def _together(pool: LanePool, kwargs: dict) -> list[str]:
    """Every prompt on its own slot in its own thread; the steps wait for all four slots (joined first)."""
    for s in pool.lanes:
        s.forget()
        pool.batcher.join(s.seq_id)
    res: list[str | None] = [None] * N_SLOTS

    def run(i: int) -> None:
        res[i] = pool.lanes[i].create_completion(PROMPTS[i], max_tokens=32, **kwargs)["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return res  # type: ignore[return-value]


@pytest.mark.parametrize("kwargs", SAMPLING, ids=["greedy", "top-p", "penalty"])
@pytest.mark.parametrize("cache_slots", [None, 8], ids=["no-cache", "cache8"])
def test_each_slot_gets_its_text_alone_when_decoded_together(kwargs, cache_slots):
    """With a stream of KV cells per slot (--no-kv-unified) a slot's cells are laid out as when it runs
    alone, so its logits, and with its own seeded sampler its text, are the same."""
    with _load(cache_slots, kv_unified=False) as llm:
        pool = LanePool(llm, N_SLOTS)
        pool.batcher.max_wait_s = 60.0  # every step waits for all four: the batch shapes are certain
        try:
            alone = _alone(pool, kwargs)
            together = _together(pool, kwargs)
        finally:
            pool.close()
    assert together == alone
    assert pool.batcher.stats.by_width.get(N_SLOTS, 0) >= 1  # steps of four sequences in one llama_decode


def test_a_slot_holds_only_its_share_of_the_context():
    with _load(None, kv_unified=True) as llm:
        pool = LanePool(llm, N_SLOTS)
        try:
            assert pool.n_ctx == N_CTX // N_SLOTS
            slot = pool.lanes[1]
            with pytest.raises(ContextLengthError, match="share"):
                slot.eval(list(range(10, 10 + pool.n_ctx + 1)))
            slot.eval([10, 11])  # it goes on after the refusal
            assert slot.n_tokens == 2
        finally:
            pool.close()


def test_a_slot_sequence_saved_and_restored_decodes_as_before():
    with _load(None, kv_unified=False) as llm:
        pool = LanePool(llm, N_SLOTS)
        try:
            a, b = pool.lanes[1], pool.lanes[2]
            a.eval(list(range(30, 50)))
            state = a.save_state()
            a.eval([7])
            want = a._row.copy()
            a.load_state(state)  # back to the 20 tokens
            assert a.n_tokens == 20
            a.eval([7])
            assert np.array_equal(a._row, want)
            b.load_state(state)  # another slot's sequence: same stream layout, same logits
            b.eval([7])
            assert np.array_equal(b._row, want)
        finally:
            pool.close()


def test_the_cache_sees_the_union_of_the_slots_experts():
    """One step of four sequences in the async decode (an observer of the ids only keeps the expert tables
    on): per MoE layer the cache looked up each distinct expert the four tokens selected, once."""
    rec = RouteRecorder(HookRequest(probs=False, hidden=False))
    with _load(8, kv_unified=True, observers=[rec]) as llm:
        for s in range(N_SLOTS):
            llm.decode_sequences([SeqEntry(s, 0, tuple(range(60 + 5 * s, 70 + 5 * s)))])
        rec.take()
        before = {il: s["hits"] + s["misses"] for il, s in llm.stats()["cache"]["layers"].items()}
        llm.decode_sequences([SeqEntry(s, 10, (200 + 17 * s,)) for s in range(N_SLOTS)])
        events = rec.take()
        assert llm.attachment.mode_in_effect == "async"
        after = {il: s["hits"] + s["misses"] for il, s in llm.stats()["cache"]["layers"].items()}
    assert events and all(e.n_tokens == N_SLOTS for e in events.values())
    for il, e in events.items():
        assert after[str(il)] - before[str(il)] == len(np.unique(e.ids)), il


def test_a_generation_step_decodes_on_the_generation_threads(monkeypatch):
    """A step of the slots (one token from each sequence) runs on the context's ``n_threads``, as one token
    does, and ``n_threads_batch`` is back for the next prompt; a prompt (several tokens) changes nothing."""
    import llama_cpp

    with _load(None, True) as llm:
        ctx = llm._ctx.ctx
        llama_cpp.llama_set_n_threads(ctx, 1, 2)
        calls: list[tuple[int, int]] = []
        real = llama_cpp.llama_set_n_threads
        monkeypatch.setattr(llama_cpp, "llama_set_n_threads", lambda c, a, b: (calls.append((a, b)), real(c, a, b)))
        llm.decode_sequences([SeqEntry(s, 0, (40 + s, 41 + s)) for s in range(2)])  # prompts
        assert calls == []
        llm.decode_sequences([SeqEntry(s, 2, (50 + s,)) for s in range(2)])  # a step
        assert calls == [(1, 1), (1, 2)]
        assert (llama_cpp.llama_n_threads(ctx), llama_cpp.llama_n_threads_batch(ctx)) == (1, 2)
