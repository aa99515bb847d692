"""The async decode's controller and its step changes, without llama.cpp: flips and copies in the right order."""

from __future__ import annotations

import numpy as np
import pytest

from ggmoe.base.errors import UsageError
from ggmoe.base.hook import RouteEvent
from ggmoe.cache import ExpertCache
from ggmoe.cache.copy import CopyHandle, Priority
from ggmoe.cache.decode_mode import choose_decode_mode, miss_share, sync_reasons, table_type_note, weigh_modes
from ggmoe.cache.policies import POLICIES
from ggmoe.cache.step import StepChanges
from ggmoe.control import TokenController

pytestmark = pytest.mark.unit

N_EXPERT, K = 8, 2


class ManualCopies:
    """Copies that land only when the test says so."""

    def __init__(self) -> None:
        self.handles: list[CopyHandle] = []
        self.landed: set[int] = set()

    def submit(self, il: int, expert: int, slot: int, priority: Priority, rank: float = 0.0) -> CopyHandle:
        h = CopyHandle(len(self.handles), il, expert, slot, Priority(priority))
        self.handles.append(h)
        return h

    def land_all(self) -> None:
        self.landed |= {h.id for h in self.handles}

    def done(self, h: CopyHandle) -> bool:
        return h.id in self.landed

    def wait(self, handles) -> None:
        self.landed |= {h.id for h in handles}

    def cancel(self, h: CopyHandle) -> bool:
        return False

    def close(self) -> None:
        pass


class Table:
    """A fake executor's expert table (expert -> "host" or a slot): applies each step's flips in order,
    then checks what a graph launched next would read: no entry points at a slot a copy is writing, and the
    step lists exactly the copies submitted since the last one."""

    def __init__(self, copies: ManualCopies) -> None:
        self.copies = copies
        self.entry: dict[int, object] = {}
        self.log: list[tuple[str, int, int | None]] = []
        self.n_seen = 0  # copies the steps have listed

    def apply(self, step: StepChanges) -> None:
        for f in step.flips:
            assert f.il == 0 and not f.bottom
            self.entry[f.expert] = f.slot if f.slot >= 0 else "host"
            self.log.append(("map", f.expert, f.slot) if f.slot >= 0 else ("unmap", f.expert, None))
        assert list(step.copies) == self.copies.handles[self.n_seen:]
        self.n_seen = len(self.copies.handles)
        writing = {h.slot for h in self.copies.handles if h.id not in self.copies.landed}
        assert not writing & set(self.entry.values()), f"slots {writing} readable while their copies run"


def _setup(n_slots: int = 3):
    copies = ManualCopies()
    table = Table(copies)
    cache = ExpertCache(N_EXPERT, K, {0: n_slots}, POLICIES.get("lru")(N_EXPERT, [0]), copies,
                        bytes_per_expert={0: 100})
    cache.follow_tables()
    table.apply(cache.take_step())
    events: list[RouteEvent] = []

    class Obs:
        request = None

        def on_route(self, ev: RouteEvent) -> None:
            events.append(ev)

    ctl = TokenController(cache, [Obs()])
    ctl.table = table  # the test's executor: every step's changes goes to it
    return cache, copies, table, ctl, events


def _token(ctl: TokenController, experts: list[int]) -> StepChanges:
    step = ctl.on_routing([0], np.asarray([[experts]], dtype=np.int32))
    ctl.table.apply(step)
    return step


def test_misses_are_read_from_host_then_admitted_and_mapped_only_once_landed():
    cache, copies, table, ctl, events = _setup()
    step = _token(ctl, [1, 2])
    assert step.flips == () and [(h.expert, h.priority) for h in step.copies] == \
        [(1, Priority.ADMISSION), (2, Priority.ADMISSION)]
    st = cache.stats.layers[0]
    assert (st.hits, st.misses, st.host_reads, st.host_read_bytes) == (0, 2, 2, 200)
    assert st.admission_copies == 2 and table.entry == {}  # copies in flight: entries still host
    _token(ctl, [1, 2])  # not landed yet: still read from host, not admitted twice
    assert (st.hits, st.host_reads, st.admission_copies) == (0, 4, 2)
    copies.land_all()
    step = _token(ctl, [1, 3])  # 1 and 2 land now (mapped), but this token was launched before: 1 counts as a miss
    assert {(f.expert, f.slot >= 0) for f in step.flips} == {(1, True), (2, True)} and \
        [h.expert for h in step.copies] == [3]
    assert table.entry[1] is not None and table.entry[2] is not None
    assert st.hits == 0 and st.landed == 2 and st.lag_tokens == 2 + 2  # landed 2 tokens after submission
    copies.land_all()
    _token(ctl, [1, 3])  # 3 landed meanwhile, but becomes readable only at this boundary: 1 hit
    assert st.hits == 1 and table.entry[3] is not None
    _token(ctl, [1, 3])
    assert st.hits == 3
    assert [ev.ids.tolist() for ev in events][-1] == [[1, 3]] and len(events) == 5


def test_a_victims_entry_goes_back_to_host_before_its_slot_is_rewritten():
    cache, copies, table, ctl, _ = _setup(n_slots=2)
    _token(ctl, [1, 2])
    copies.land_all()
    _token(ctl, [1, 2])  # both mapped
    victims_slots = {table.entry[1], table.entry[2]}
    step = _token(ctl, [3, 4])  # evicts both: Table.apply asserts their slots are no longer readable
    assert cache.stats.layers[0].evictions == 2
    assert sorted(step.evictions) == [(0, 1), (0, 2)] and step.by_priority(Priority.ADMISSION) == step.copies
    assert {h.slot for h in step.copies} == victims_slots  # the copies go where the victims were
    unmaps = [i for i, (op, e, _) in enumerate(table.log) if op == "unmap" and e in (1, 2)]
    assert len(unmaps) >= 2 and table.entry[1] == table.entry[2] == "host"


def test_decode_mode_choice_is_explained():
    assert choose_decode_mode("auto", []).mode == "async"
    why = sync_reasons("cpu", None, None, auto=True)
    m = choose_decode_mode("auto", why)
    assert m.mode == "sync" and "host path" in m.reason
    assert sync_reasons("cpu", None, None) == []  # asked for: the async decode's host part (patch 0016)
    assert choose_decode_mode("sync", []).mode == "sync"
    with pytest.raises(UsageError, match="async cannot run here"):
        choose_decode_mode("async", sync_reasons("wait", "predictor 'expert-map' reads router probabilities", None))
    assert sync_reasons("wait", None, None) == []  # a predictor on the mailbox leaves the async decode free
    with pytest.raises(UsageError, match="unknown decode mode"):
        choose_decode_mode("fastest", [])


MB = 1 << 20


@pytest.mark.parametrize(("slots", "sync_s", "read_bw", "fills", "faster"), [
    # without fills a miss crosses the link twice in async (read in place, then admitted): a sync per layer
    # costs less (the H200 loan: async 0.66x sync at 50 % of gpt-oss-20b's shape)
    (2, 57e-6, 25e9, False, "sync"),
    (2, 2e-3, 25e9, False, "async"),  # a sync per layer dearer than a second pass of the misses over the link
    (2, 57e-6, 2e9, False, "sync"),  # reads in place ten times slower than copies: waiting for copies wins
    (8, 57e-6, 2e9, False, "async"),  # every expert cached: no misses, only the sync per layer is left
    (2, 0.0, None, False, "async"),  # the CPU build: in place costs nothing, both copy each miss once: a tie
    # with fills a miss crosses once, at the read's rate: as fast as a copy, async saves the sync per layer
    (2, 57e-6, 25e9, True, "async"),
    (2, 57e-6, 2e9, True, "sync"),  # a fill at a tenth of the copies' rate: waiting for copies still wins
    (8, 57e-6, 2e9, True, "async"),
    (2, 0.0, None, True, "async"),  # the CPU build: a fill is the memcpy an admission was: a tie
])
def test_auto_weighs_the_two_modes(slots, sync_s, read_bw, fills, faster):
    """Two layers of 8 experts, top-2, 4 MiB experts, copies at 25 GB/s + 10 us (by hand: at 2 of 8 slots a
    layer misses 1.5 experts a token)."""
    copy_s = lambda nb: 10e-6 + nb / 25e9  # noqa: E731
    read_s = (lambda nb: nb / read_bw) if read_bw else None  # noqa: E731
    est = weigh_modes({0: 4 * MB, 1: 4 * MB}, {0: slots, 1: slots}, 8, 2, copy_s, sync_s, read_s, "by hand",
                      fills=fills)
    misses = 2 * 1.5 if slots == 2 else 0.0
    assert est.sync_s == pytest.approx(2 * sync_s + misses * copy_s(4 * MB))
    read = 4 * MB / read_bw if read_bw else 0.0
    per_miss = (read if read_bw else copy_s(4 * MB)) if fills else read + copy_s(4 * MB)
    assert est.async_s == pytest.approx(misses * per_miss)
    m = choose_decode_mode("auto", [], est)
    assert m.mode == faster and "estimates" in m.reason and "by hand" in m.reason and "on a GPU" in m.reason
    assert ("fills each miss once" in m.reason) == fills
    assert "with a stride prefetch" in choose_decode_mode("auto", [], est, "with a stride prefetch").reason
    assert choose_decode_mode("async", [], est).mode == "async"  # asked for: no weighing
    assert choose_decode_mode("sync", [], est).mode == "sync"


@pytest.mark.parametrize(("slots", "counts", "share"), [
    (2, None, 0.75),  # uniform routing: 6 of 8 experts not cached
    (2, [0] * 8, 0.75),  # nothing counted: uniform
    (2, [50, 30, 10, 10, 0, 0, 0, 0], 0.2),  # the two hottest cover 80 of 100 selections
    (4, [50, 30, 10, 10, 0, 0, 0, 0], 0.0),
    (1, [5, 5, 5, 5, 5, 5, 5, 5], 0.875),
])
def test_a_layers_misses_come_from_routing_statistics_when_there_are_any(slots, counts, share):
    assert miss_share(slots, 8, counts) == pytest.approx(share)


def test_skewed_routing_statistics_move_auto_towards_the_sync_decode():
    """Reads in place ten times slower than copies: with uniform routing the misses make sync faster; with
    statistics where 2 slots cover every selection, only sync's per-layer sync is left and async wins."""
    copy_s = lambda nb: nb / 25e9  # noqa: E731
    args = ({0: 4 * MB}, {0: 2}, 8, 2, copy_s, 57e-6, lambda nb: nb / 2.5e9, "by hand")
    assert choose_decode_mode("auto", [], weigh_modes(*args)).mode == "sync"
    est = weigh_modes(*args, counts={0: [60, 40, 0, 0, 0, 0, 0, 0]})
    assert est.async_s == 0.0 and "routing statistics" in est.source
    assert choose_decode_mode("auto", [], est).mode == "async"


@pytest.mark.parametrize(("backend", "types", "refused"), [
    ("CPU", ["TQ1_0", "F16"], None),  # ggml-cpu reads every type through a table
    ("CUDA0", ["Q4_K", "Q6_K", "MXFP4", "Q8_0"], None),
    ("CUDA0", ["Q4_K", "TQ2_0"], ("blk.1.ffn_gate_exps.weight", "TQ2_0")),
    ("CUDA0", ["F16"], ("blk.0.ffn_up_exps.weight", "F16")),
    ("CUDA0", ["TQ1_0"], ("blk.0.ffn_up_exps.weight", "TQ1_0")),
    ("Vulkan0", ["Q4_K"], ("Vulkan0",)),
])
def test_the_table_path_refuses_what_the_backend_cannot_read(backend, types, refused):
    """A type the table path cannot read is refused with one line naming the tensor and its type (on CUDA:
    any type without an MMVQ kernel), never left to crash in the kernel."""
    names = ["blk.0.ffn_up_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight",
             "blk.3.ffn_up_exps.weight"]
    note = table_type_note(backend, list(zip(names, types, strict=False)))  # fewer types than names
    if refused is None:
        assert note is None
        return
    assert note is not None and all(part in note for part in refused)
    with pytest.raises(UsageError, match="async cannot run here") as e:
        choose_decode_mode("async", [note])
    assert all(part in str(e.value) for part in refused)
    assert choose_decode_mode("auto", [note]).mode == "sync"


class Counting:
    """An observer that only counts (its presence keeps the controller on the per-layer path)."""

    def __init__(self) -> None:
        self.events = 0

    def on_route(self, event: RouteEvent) -> None:
        self.events += 1


def _one_call_and_per_layer(policy: str, n_slots: int, cpu_of: dict[int, list[bool]] | None = None):
    """The same routings through the controller twice: without observers (one cache call a token,
    ``after_one_token``) and with one (the per-layer path). Returns each run's cache, controller and the number
    of one-call tokens; the copies land as they are submitted, as the CPU build's do."""
    layers = [0, 1, 2]
    rng = np.random.default_rng(7)
    routings = [np.stack([rng.choice(N_EXPERT, size=(1, K), replace=False) for _ in layers]).astype(np.int32)
                for _ in range(60)]
    runs = []
    for observers in ([], [Counting()]):
        cache = ExpertCache(N_EXPERT, K, dict.fromkeys(layers, n_slots), POLICIES.get(policy)(N_EXPERT, layers))
        if cpu_of:
            cache.cpu_of = cpu_of
        whole = []
        cache.after_one_token = lambda ls, rows, _c=cache, _w=whole: (_w.append(1),
                                                                       type(_c).after_one_token(_c, ls, rows))[1]
        ctl = TokenController(cache, observers)
        for routing in routings:
            ctl.on_routing(layers, routing)
        runs.append((cache, ctl, len(whole)))
    return runs, layers, len(routings)


def _same(fast, fctl, slow, sctl, layers, n_tokens):
    assert fast.stats.total() == slow.stats.total() and fctl.calls == sctl.calls == n_tokens * len(layers)
    for il in layers:
        assert fast.stats.layers[il] == slow.stats.layers[il]
        assert fast.tables[il].expert_in_list == slow.tables[il].expert_in_list


@pytest.mark.parametrize("policy", ["lru", "lfu", "fmoe"])
def test_a_roomy_cache_counts_in_one_call_what_the_layer_calls_count(policy):
    """Every layer has a slot for every expert: the controller hands the cache the whole token at once
    (``after_one_token``), which counts a layer whose experts were all resident itself and sends the rest
    (misses: admissions; copies landing) down the per-layer path. Statistics and residency equal the
    per-layer path's (an observer keeps the controller on it); the policy, whose ranks a cache that never
    evicts never asks for, is told of the misses' calls only."""
    ((fast, fctl, n_fast), (slow, sctl, n_slow)), layers, n_tokens = _one_call_and_per_layer(policy, N_EXPERT)
    assert fast.roomy and n_fast == n_tokens and n_slow == 0
    assert fast.stats.total().misses > 0  # some tokens took the per-layer path inside the whole-token call
    _same(fast, fctl, slow, sctl, layers, n_tokens)
    assert fast.stats.total().evictions == slow.stats.total().evictions == 0


@pytest.mark.parametrize(("policy", "n_slots", "cpu"), [
    ("lru", 3, False),  # evictions and admissions
    ("lfu", 4, True),  # every miss computed by the host part, then admitted
    ("on-demand", K, True),  # the host part computes every expert, nothing kept
    ("on-demand", K, False),  # read in place, nothing kept
])
def test_any_cache_steps_in_one_call_as_layer_by_layer(policy, n_slots, cpu):
    """Without a planner or an observer, every cache (not only a roomy one) takes a decoded token in one call
    under one lock (``after_one_token``): the same statistics, residency and evictions as the per-layer path."""
    cpu_of = {il: [True] * N_EXPERT for il in range(3)} if cpu else None
    ((fast, fctl, n_fast), (slow, sctl, n_slow)), layers, n_tokens = _one_call_and_per_layer(policy, n_slots, cpu_of)
    assert not fast.roomy and n_fast == n_tokens and n_slow == 0
    assert fast.stats.total().misses > 0
    assert (fast.stats.total().host_computed > 0) == cpu
    _same(fast, fctl, slow, sctl, layers, n_tokens)


def test_a_cache_with_a_layer_that_cannot_hold_every_expert_is_not_roomy():
    layers = [0, 1]
    cache = ExpertCache(N_EXPERT, K, {0: N_EXPERT, 1: N_EXPERT - 1}, POLICIES.get("lru")(N_EXPERT, layers))
    assert not cache.roomy and cache.partial_layers == (1,)
    on_demand = ExpertCache(N_EXPERT, K, dict.fromkeys(layers, N_EXPERT), POLICIES.get("on-demand")(N_EXPERT, layers))
    assert not on_demand.roomy  # a policy that releases what it loaded: every call may admit
