"""Copy streams (ggmoe.engine.streams): a copy is seen landed only through the readiness query.

The deferred stream is the CPU build behaving like a GPU's copy stream: copies land later, on their own
threads, out of order. Interleavings are forced with events, never timed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.cache import CacheConfig
from ggmoe.cache.decode_mode import DecodeConfig
from ggmoe.control.run_config import RunConfig
from ggmoe.engine import Engine, EngineConfig
from ggmoe.engine.streams import (
    DeferredStream,
    ImmediateStream,
    copy_stream_kind,
    deferred_delay_s,
    open_stream,
)
from ggmoe.inspect import inspect_model

pytestmark = pytest.mark.engine


def test_deferred_copies_land_later_and_out_of_order():
    s = DeferredStream(max_delay_s=0.0, workers=2)
    first_may_land, order = threading.Event(), []

    def first(handle):
        assert handle is None  # the CPU build writes at once, on the worker
        first_may_land.wait(5)
        order.append("first")

    try:
        a = s.put(first)
        b = s.put(lambda h: order.append("second"))
        s.wait(b)  # the second lands while the first is still in flight
        assert s.ready(b) and not s.ready(a)
        first_may_land.set()
        s.wait(a)
        assert s.ready(a) and order == ["second", "first"]
    finally:
        first_may_land.set()
        s.close()


def test_a_failed_copy_is_raised_by_whoever_asks_and_close_lands_what_is_in_flight():
    s = DeferredStream(max_delay_s=0.0)
    gate, done = threading.Event(), []

    def boom(h):
        raise OSError("link down")

    def slow(h):
        gate.wait(5)
        done.append(1)

    bad = s.put(boom)
    pending = s.put(slow)
    with pytest.raises(OSError, match="link down"):
        s.wait(bad)
    with pytest.raises(OSError, match="link down"):
        s.ready(bad)
    threading.Timer(0.05, gate.set).start()
    s.close()  # waits for the copy in flight: it never writes freed slots
    assert done == [1] and pending.done()  # landed before close returned (the stream refuses questions after)


def test_immediate_stream_lands_inside_put():
    s, seen = ImmediateStream(), []
    m = s.put(seen.append)
    assert seen == [None] and s.ready(m)


@pytest.mark.parametrize(("env", "kind", "delay_ms"), [
    ({}, "immediate", 0.2), ({"GGMOE_COPY_STREAM": "deferred"}, "deferred", 0.2),
    ({"GGMOE_COPY_STREAM": " Deferred ", "GGMOE_COPY_DELAY_MS": "3"}, "deferred", 3.0),
    ({"GGMOE_COPY_STREAM": "immediate", "GGMOE_COPY_DELAY_MS": "0"}, "immediate", 0.0),
])
def test_the_environment_names_the_stream(monkeypatch, env, kind, delay_ms):
    monkeypatch.delenv("GGMOE_COPY_STREAM", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert copy_stream_kind() == kind
    assert deferred_delay_s() == pytest.approx(delay_ms / 1000)
    s = open_stream(None, None)
    try:
        assert s.name == kind
    finally:
        s.close()


@pytest.mark.parametrize(("key", "value", "match"), [
    ("GGMOE_COPY_STREAM", "cuda", "GGMOE_COPY_STREAM='cuda': expected one of immediate, deferred"),
    ("GGMOE_COPY_DELAY_MS", "-1", "GGMOE_COPY_DELAY_MS='-1': expected milliseconds"),
    ("GGMOE_COPY_DELAY_MS", "fast", "GGMOE_COPY_DELAY_MS='fast': expected milliseconds"),
])
def test_a_bad_stream_setting_is_one_clear_error(monkeypatch, qwen3moe_model, key, value, match):
    monkeypatch.setenv(key, value)
    if key == "GGMOE_COPY_DELAY_MS":
        monkeypatch.setenv("GGMOE_COPY_STREAM", "deferred")
    with pytest.raises(UsageError, match=match):
        Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=64, run=RunConfig(CacheConfig(n_slots=4))))


def test_the_async_cache_sees_a_copy_only_once_it_landed(qwen3moe_model, monkeypatch):
    """A deferred copy held back by the test is not readable, token after token, until it lands; then the
    next token boundary maps it and later tokens hit it. The logits never change."""
    monkeypatch.setenv("GGMOE_COPY_STREAM", "deferred")
    facts = inspect_model(qwen3moe_model)
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128, gate_hook=False)) as stock:
        ids = stock.tokenize("hello hello hello hello hello")
        ref = [stock.decode([t]) for t in ids]
    with Engine(EngineConfig(model_path=qwen3moe_model, n_ctx=128, n_batch=64, n_ubatch=4,
                             # one slot short of every expert (a cache of all is preloaded) and no fills (the
                             # graph's fills land with the token): the misses are admitted as copies
                             run=RunConfig(CacheConfig(n_slots=facts.n_expert - 1),
                                           decode=DecodeConfig(mode="async", fills=False)))) as eng:
        stream = eng._runtime.stream.stream
        assert isinstance(stream, DeferredStream) and eng.decode_mode["copy_stream"] == "deferred"
        hold = threading.Event()
        put = stream.put
        stream.put = lambda work: put(lambda h: (hold.wait(10), work(h)))  # every copy waits for the test
        cache = eng._runtime.cache
        got = [eng.decode([ids[0]])]
        for t in ids[1:3]:
            got.append(eng.decode([t]))
        st = cache.stats.total()
        assert st.admission_copies > 0 and st.landed == 0 and st.hits == 0  # nothing readable yet
        assert any(c is not None for tb in cache.tables.values() for c in tb.copy)  # still in flight
        held = st.admission_copies
        hold.set()
        stream.synchronize()  # the test waits; the cache still learns only at the next token boundary
        for t in ids[3:]:
            got.append(eng.decode([t]))
        st = cache.stats.total()
    # the held copies were seen at the next token boundary, none in the token that issued it
    assert st.landed >= held and st.hits > 0 and st.lag_tokens >= st.landed
    for a, b in zip(got, ref, strict=True):
        assert np.array_equal(a, b)


class _FakeEvents:
    """ggml's event calls as EventStream makes them, on fake handles (the GPU stream's logic without a GPU)."""

    def __init__(self):
        self.made, self.recorded, self.synced = 0, [], []

    def ggml_backend_event_new(self, device):
        self.made += 1
        return 1000 + self.made

    def ggml_backend_event_record(self, ev, backend):
        self.recorded.append(ev)

    def ggml_backend_event_synchronize(self, ev):
        self.synced.append(ev)

    def ggml_backend_synchronize(self, backend):
        assert backend, "GGML_ASSERT(backend): the process aborts on a GPU"
        self.synced.append(backend)

    def ggml_backend_event_free(self, ev):
        pass

    def ggml_backend_free(self, backend):
        self.freed = getattr(self, "freed", 0) + 1


def _event_stream(monkeypatch):
    from ggmoe.engine import ggml as B
    from ggmoe.engine.streams import EventStream

    monkeypatch.setattr(B, "libggml_base", _FakeEvents())
    monkeypatch.setattr(B, "event_query_fn", lambda: lambda ev: True)
    return EventStream(backend=7, device=0)


@pytest.mark.parametrize("make", [lambda mp: ImmediateStream(), lambda mp: DeferredStream(max_delay_s=0.0),
                                  _event_stream], ids=["immediate", "deferred", "events"])
def test_a_closed_stream_refuses_work_and_closing_twice_is_harmless(make, monkeypatch):
    """On CUDA a closed stream's synchronize aborts the process (the fourth GPU loan: every cached run died in
    ``close``). Every stream raises instead, so a teardown that uses its stream after closing it fails here."""
    from ggmoe.base.errors import EngineError

    s = make(monkeypatch)
    marker = s.put(lambda handle: None)
    s.synchronize()
    s.close()
    s.close()
    for use in (s.synchronize, lambda: s.put(lambda handle: None), lambda: s.ready(marker), lambda: s.wait(marker)):
        with pytest.raises(EngineError, match="used after it was closed"):  # a GPU's events are freed by then
            use()


def test_an_event_stream_recycles_each_event_once_when_another_thread_sees_it_land(monkeypatch):
    """GPU semantics, forced: while one thread queries a copy's event, another sees the same copy land and
    recycles the event. The marker is then empty (landed) for both, the event is free once, and the next
    copy records it again."""
    from ggmoe.engine import ggml as B
    from ggmoe.engine.streams import EventStream

    fake, s = _FakeEvents(), None
    monkeypatch.setattr(B, "libggml_base", fake)

    def query(ev):  # the copy landed; meanwhile the other thread's query of the same marker recycles it
        if not inner:
            inner.append(None)
            inner[0] = s.ready(marker)
        return True

    monkeypatch.setattr(B, "event_query_fn", lambda: query)
    s, inner = EventStream(backend=7, device=0), []
    marker = s.put(lambda handle: None)
    assert s.ready(marker) and inner == [True] and marker == []
    assert s._free == [1001]  # once, not twice
    again = s.put(lambda handle: None)
    assert again == [1001] and fake.made == 1 and fake.recorded == [1001, 1001]
    s.wait(marker)  # landed already: no synchronize
    assert fake.synced == [] and s.ready(marker)
