"""The async decode's device-side expert tables and its per-token routing output.

Engine layer (ctypes allowed). For every cached MoE layer and expert tensor
kind, an I64 table ``[n_expert]`` (``[n_expert, 3]`` for a split layer: top
address, bottom address, split; MoEpic, patch 0007) at a fixed address on the
layer's device:
entry ``e`` is the address of expert ``e``'s matrix, either its cache slot
(``slot_tensor.data + slot * nb2``) or the model's own expert tensor in host
memory (``host.data + e * nb2``; on a GPU its pinned buffer, which kernels read
through unified addressing). ``ggml_mul_mat_id_table`` (patch 0006) reads
through it, so a hit needs no host and a miss is read over the link inside the
same kernel. The tables follow the cache through its step changes
(``ggmoe.cache.step``): ``apply`` writes each ``Flip`` of a step into the host
mirror, in the cache's order, and ``flush`` sends the mirror before the next
graph reads it; so an entry points at a slot only once the copy into it has
landed, and at host memory again before any graph runs beside a copy that may
overwrite the slot.

``routing`` is I32 ``[n_expert_used, max_tokens, n_layer]``: each table layer of
a table-mode micro-batch copies its selected ids there in the graph, and the
controller reads it once per decode (after the logits, so the device is done).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ggmoe.base.errors import EngineError, EngineNotPatchedError
from ggmoe.cache.fill import Fill, FillTargets
from ggmoe.cache.split import SPLIT_PACKED
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.arena import TensorArena

if TYPE_CHECKING:
    from ggmoe.cache.cache import ExpertCache
    from ggmoe.cache.step import StepChanges
    from ggmoe.engine.slot_tensors import SlotTensors

GGML_TYPE_I32 = 26
GGML_TYPE_I64 = 27


def _check_packed_flag() -> None:
    """The installed engine's kernels read the packed flag where the tables write it (else a packed bottom
    would be read in the expert's own layout: wrong logits, silently)."""
    flag = B.split_packed_flag()
    if flag != SPLIT_PACKED:
        raise EngineNotPatchedError(
            "the installed engine reads split experts' packed flag elsewhere (built from older patches): run "
            "`ggmoe engine build --install` (or `make engine` in a clone) to rebuild it")


class _LayerTable:
    """One layer's tables (one per expert tensor kind), following its slot table's flips and, for a split
    layer, its bottom buffers' (``ExpertTables.apply``). Writes go to the host mirror (``ExpertTables.flat``)
    and mark the changed span; ``ExpertTables.flush`` sends it to the device before the next read.

    Whole experts: one row per table, the address of each expert's matrix. A split layer (MoEpic): three
    rows, top address, bottom address, split (``ggml_mul_mat_id_table_split``): a mapped expert's top is its
    slot's top segment and its bottom is its bottom buffer once that landed (the address or-ed with
    ``SPLIT_PACKED``: a buffer holds a packed bottom), else its host tensor; an unmapped expert is whole at its
    host address (split -1). A bottom moves between host memory and a buffer by one 8-byte write (row 1), which
    the copy stream may make while a graph runs (``entry_flip``); the three rows change together only between
    tokens."""

    def __init__(self, owner: ExpertTables, views: list[np.ndarray], offsets: list[int], pairs: list, n_expert: int,
                 slot_data: list[int], bottom_data: list[int]) -> None:
        self.owner = owner
        self.views = views  # [kind] the table's rows in the mirror: [1 or 3, n_expert]
        self.offsets = offsets  # [kind] element offset of the table in the mirror
        self.host = [np.asarray([p.host_data + e * p.nb2 for e in range(n_expert)], dtype=np.int64)
                     for p in pairs]  # [kind][expert] host address
        self.slot_data = slot_data  # [kind] address of slot 0 of the kind's slot tensor
        self.slot_bytes = [p.slot_bytes for p in pairs]  # [kind] bytes from one slot to the next
        self.split = [p.split.split if p.split is not None else -1 for p in pairs]  # [kind] the table's split
        self.bottom_bytes = [p.split.bottom_bytes if p.split is not None else 0 for p in pairs]  # [kind] a buffer
        self.bottom_data = bottom_data  # [kind] address of bottom buffer 0 (split layers with buffers)
        self.is_split = pairs[0].split is not None
        self.bottoms = None  # the cache's BottomTable of the layer (split layers with bottom buffers)
        if self.is_split:
            _check_packed_flag()
            if any((a | b | int(np.bitwise_or.reduce(h))) & SPLIT_PACKED for a, b, h in
                   zip(bottom_data, self.bottom_bytes, self.host, strict=True)):
                raise EngineError("a split layer's bottom addresses are odd: the packed flag has no bit to go in")
        # the host part (patch 0016): the experts the CPU computes whenever no slot holds them (None: none), and
        # what the graph's host part reads, I32 [n_expert]: 1 where such an expert is unmapped (its entries 0)
        self.cpu: Sequence[bool] | None = None
        self.flags = np.zeros(n_expert, dtype=np.int32)
        self.is_mapped = np.zeros(n_expert, dtype=bool)  # [expert] an entry points at its slot
        for k, v in enumerate(views):  # every expert starts whole in host memory
            v[0] = self.host[k]
            if self.is_split:
                v[1] = self.host[k]
                v[2] = -1

    def _write(self, k: int, row: int, expert: int, value: int) -> None:
        v = self.views[k]
        if v[row, expert] != value:
            v[row, expert] = value
            self.owner.touch(self.offsets[k] + row * v.shape[1] + expert)

    def _bottom(self, k: int, expert: int) -> tuple[int, int]:
        """(bottom address, split entry) of a mapped expert: its landed bottom buffer (packed), else its host
        tensor (the expert's layout)."""
        bt = self.bottoms
        if bt is not None and bt.ready(expert):
            return self.buffer_entry(k, bt.buffer_of[expert]), self.split[k]
        return int(self.host[k][expert]), self.split[k]

    def buffer_entry(self, k: int, buffer: int) -> int:
        """Row 1's value for a bottom in ``buffer``: its address, or-ed with the packed flag."""
        return (self.bottom_data[k] + buffer * self.bottom_bytes[k]) | SPLIT_PACKED

    def mapped(self, expert: int, slot: int) -> None:
        self.is_mapped[expert] = True
        self.flags[expert] = 0  # read from its slot: the host part leaves it to the device
        for k in range(len(self.views)):
            if self.is_split:  # bottom and split before the top: the old top was host memory, whole
                addr, split = self._bottom(k, expert)
                self._write(k, 1, expert, addr)
                self._write(k, 2, expert, split)
            self._write(k, 0, expert, self.slot_data[k] + slot * self.slot_bytes[k])

    def unmapped(self, expert: int) -> None:
        self.is_mapped[expert] = False
        on_cpu = self.cpu is not None and self.cpu[expert]
        self.flags[expert] = int(on_cpu)
        for k in range(len(self.views)):  # an expert the CPU computes: 0, which the device part skips
            self._write(k, 0, expert, 0 if on_cpu else int(self.host[k][expert]))
            if self.is_split:
                self._write(k, 2, expert, -1)

    def host_moved(self, expert: int, addresses: Sequence[int]) -> None:
        """The expert's host address of each kind is now ``addresses`` (a disk tier's host slot, or the file in
        place): an entry reading host memory follows at once (whole experts only)."""
        for k, a in enumerate(addresses):
            old = int(self.host[k][expert])
            self.host[k][expert] = a
            if int(self.views[k][0, expert]) == old:
                self._write(k, 0, expert, a)

    def bottom_mapped(self, expert: int, buffer: int) -> None:
        if self.views[0][2, expert] >= 0:  # the top is mapped: read the bottom from the buffer now
            for k in range(len(self.views)):
                self._write(k, 1, expert, self.buffer_entry(k, buffer))

    def bottom_unmapped(self, expert: int) -> None:
        for k in range(len(self.views)):  # (an unmapped expert's row 1 is never read: split -1)
            self._write(k, 1, expert, int(self.host[k][expert]))


class ExpertTables:
    """Every cached layer's expert tables and the routing output, on the slots' device, registered with the
    context. ``attach`` hooks them to the cache's slot tables; ``enable``/``disable`` switch table mode."""

    def __init__(self, ctx_ptr: int, slots: SlotTensors, n_expert: int, n_expert_used: int, n_layer: int,
                 max_tokens: int, fill_layers: Sequence[int] = (), f_max: int = 0) -> None:
        """``slots``: the runtime's ``SlotTensors`` (its pairs give host and slot addresses per kind).
        ``fill_layers``: the layers whose misses the graph fills into up to ``f_max`` slots (patch 0012)."""
        self.ctx_ptr = ctx_ptr
        self.n_expert_used = n_expert_used
        self.n_layer = n_layer
        self.max_tokens = max_tokens
        self.enabled = False
        self.identity: set[int] = set()  # the layers read with stock's matmuls (patch 0017)
        pairs = slots.pairs  # il -> [SlotPair] in the order of slots.tensors[il]'s kinds
        n_tables = sum(len(p) for p in pairs.values())
        rows_of = {il: 3 if ps[0].split is not None else 1 for il, ps in pairs.items()}  # split layers: 3
        total = sum(rows_of[il] * len(ps) for il, ps in pairs.items()) * n_expert
        # every table is a view of one I64 tensor: one write per token (the changed span) sends them all
        self.flat = np.zeros(total, dtype=np.int64)  # the host mirror
        self._lo, self._hi = total, 0  # the span of elements changed since the last flush
        self.dirty = 0  # entries changed since the last flush
        self.flushes = 0  # flushes that wrote the tables (tests, statistics)
        self.changed = 0  # entries changed in all
        fill_layers = [il for il in fill_layers if il in pairs and pairs[il][0].split is None] if f_max > 0 else []
        self.arena = TensorArena(n_tables + 4 + len(fill_layers), "the expert tables")
        self.layers: dict[int, _LayerTable] = {}
        self.fills: FillWords | None = None
        try:
            kinds = {il: list(slots.tensors[il]) for il in pairs}  # the kinds, in the pairs' order
            made, offsets = self._new_tables(kinds, rows_of, n_expert, total)
            self._new_routing(n_expert_used, max_tokens, n_layer)
            if fill_layers:
                self.fills = FillWords(self.arena, fill_layers, f_max, n_expert)
            self.arena.allocate(slots.buft)
            self._all_p = ctypes.cast(self.all, B.ggml_tensor_p)  # cast once: written every token
            self._new_layers(pairs, offsets, rows_of, n_expert)
            self._lo, self._hi, self.dirty = 0, total, 1  # the whole mirror goes to the device once
            self.flush()
            self._register(kinds, made)
            if self.fills is not None:
                self.fills.register(ctx_ptr)
        except BaseException:  # a later layer refused: the earlier ones are taken back before the arena goes
            self.detach()
            self.close()
            raise
        self._start_routing(n_layer, max_tokens, n_expert_used)

    def _new_tables(self, kinds: dict[int, list[str]], rows_of: dict[int, int], n_expert: int,
                    total: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """The one I64 tensor of every table (``self.all``) and each table as a 2-D view of it: (views per
        layer, element offset of each view in the mirror per layer), both in the kinds' order."""
        self.all = self.arena.new_tensor(GGML_TYPE_I64, total, 1, 1, "ggmoe_tables")
        made: dict[int, list[int]] = {}
        offsets: dict[int, list[int]] = {}
        off = 0
        for il, kind_list in kinds.items():
            made[il], offsets[il] = [], []
            for k in kind_list:
                made[il].append(self.arena.new_view_2d(self.all, n_expert, rows_of[il], n_expert * 8, off * 8,
                                                       f"ggmoe_table.{il}.{k}"))
                offsets[il].append(off)
                off += rows_of[il] * n_expert
        return made, offsets

    def _new_routing(self, n_expert_used: int, max_tokens: int, n_layer: int) -> None:
        """The routing output the graph writes, and the forced routing benchmarks replay (the same shape)."""
        self.routing = self.arena.new_tensor(GGML_TYPE_I32, n_expert_used, max_tokens, n_layer, "ggmoe_routing")
        # benchmarks only: trace-replay routing's ids for table-mode micro-batches (the routing's shape)
        self.forced = self.arena.new_tensor(GGML_TYPE_I32, n_expert_used, max_tokens, n_layer,
                                            "ggmoe_forced_routing")

    def _new_layers(self, pairs: dict[int, list], offsets: dict[int, list[int]], rows_of: dict[int, int],
                    n_expert: int) -> None:
        """One ``_LayerTable`` per layer over its rows of the mirror, once the slot tensors have addresses."""
        data = lambda t: ctypes.cast(t, B.ggml_tensor_p).contents.data if t else 0  # noqa: E731
        for il, ps in pairs.items():
            views = [self.flat[o: o + rows_of[il] * n_expert].reshape(rows_of[il], n_expert) for o in offsets[il]]
            self.layers[il] = _LayerTable(self, views, offsets[il], ps, n_expert, [data(p.cache) for p in ps],
                                          [data(p.bottom) for p in ps])

    def _register(self, kinds: dict[int, list[str]], made: dict[int, list[int]]) -> None:
        """Hand every layer's tables to the patched context, by kind (a kind the layer lacks: none)."""
        from ggmoe.inspect.names import CACHED_KINDS

        P = _patched.symbols()
        for il, kind_list in kinds.items():
            by_kind = dict(zip(kind_list, made[il], strict=True))
            rc = P.llama_ggmoe_set_layer_table(self.ctx_ptr, il, *(by_kind.get(k) for k in CACHED_KINDS))
            if rc != _patched.LLAMA_GGMOE_OK:
                raise EngineError(f"registering the expert tables of layer {il} failed: "
                                  f"{_patched.ERROR_NAMES.get(rc, rc)}")

    def _start_routing(self, n_layer: int, max_tokens: int, n_expert_used: int) -> None:
        """The host buffers of the routing output and the forced routing; both device tensors start defined."""
        self._buf = np.zeros((n_layer, max_tokens, n_expert_used), dtype=np.int32)  # routing, read back
        # both start defined (-1: no expert; the forced routing is written before each decode that reads it)
        none = np.full_like(self._buf, -1)
        for t in (self.routing, self.forced):
            B.libggml_base.ggml_backend_tensor_set(ctypes.cast(t, B.ggml_tensor_p), none.ctypes.data, 0, none.nbytes)
        self._routing_p = ctypes.cast(self.routing, B.ggml_tensor_p)  # cast once: read every token
        self._buf_ptr, self._buf_bytes = self._buf.ctypes.data, self._buf.nbytes
        self._forced = np.zeros_like(self._buf)  # forced routing, written before a decode
        self.forcing = False

    def touch(self, i: int) -> None:
        """Element ``i`` of the mirror changed: it goes with the next flush."""
        self.dirty += 1
        if i < self._lo:
            self._lo = i
        if i >= self._hi:
            self._hi = i + 1

    def follow(self, cache: ExpertCache) -> None:
        """Make every cached layer's table follow the cache's flips (its slots and, for a split layer, its
        bottom buffers): the entries of the slots that hold a landed copy now, the rest with each step."""
        for il, bt in cache.bottoms.items():
            self.layers[il].bottoms = bt  # a mapped split expert reads its bottom where this says it landed
        cache.follow_tables()
        self.apply(cache.take_step())
        self.flush()

    def apply(self, step: StepChanges) -> None:
        """Write a step's flips into the mirror, in order (``flush`` sends them). A flip of an identity layer
        turns its identity off first: its graph then reads the tables again."""
        layers = self.layers
        if self.identity and step.flips:
            self.set_identity(self.identity.intersection(f[0] for f in step.flips), False)
        for il, expert, slot, bottom in step.flips:
            lt = layers[il]
            if bottom:
                if slot >= 0:
                    lt.bottom_mapped(expert, slot)
                else:
                    lt.bottom_unmapped(expert)
            elif slot >= 0:
                lt.mapped(expert, slot)
            else:
                lt.unmapped(expert)

    def flush(self) -> None:
        """Send the entries changed since the last flush to the device: the changed span of every table in one
        write (on a GPU one copy of at most the tables' bytes). Called before every decode, and in the route
        callback of a layer that reads through its tables: a victim's entry has pointed at host memory in the
        mirror since before its slot's copy was submitted, and no graph reads the tables until this write has
        landed (``ggml_backend_tensor_set`` returns then)."""
        if not self.dirty:
            return
        self.changed += self.dirty
        self.dirty = 0
        lo, hi = self._lo, self._hi
        self._lo, self._hi = self.flat.size, 0
        B.libggml_base.ggml_backend_tensor_set(self._all_p, self.flat.ctypes.data + lo * 8, lo * 8, (hi - lo) * 8)
        self.flushes += 1

    def enable(self) -> None:
        """Table mode on: micro-batches of at most ``max_tokens`` tokens read experts through the tables."""
        self.enabled = True
        self._mode(self.max_tokens, self.routing)

    def disable(self) -> None:
        """Table mode off (the route op serves every micro-batch); the tables stay current."""
        self.enabled = False
        self._mode(0, None)

    def _mode(self, max_tokens: int, routing: int | None) -> None:
        rc = _patched.symbols().llama_ggmoe_set_table_mode(self.ctx_ptr, max_tokens, routing)
        if rc != _patched.LLAMA_GGMOE_OK:
            raise EngineError(f"switching table mode failed: {_patched.ERROR_NAMES.get(rc, rc)}")
        if routing is not None and self.forcing:  # table mode off dropped it: set it again
            self.force(True)

    def force(self, on: bool) -> None:
        """Benchmarks only: table-mode micro-batches read the ids given to ``write_forced`` (on) or the
        router's (off)."""
        self.forcing = on
        if not self.enabled:
            return  # applied when table mode comes on (table mode off drops it)
        rc = _patched.symbols().llama_ggmoe_set_forced_routing(self.ctx_ptr, self.forced if on else None)
        if rc != _patched.LLAMA_GGMOE_OK:
            raise EngineError(f"setting the forced routing failed: {_patched.ERROR_NAMES.get(rc, rc)}")

    def write_forced(self, layers: list[int], ids: list[np.ndarray]) -> None:
        """The next table-mode micro-batch's experts per layer: ``ids[j]`` [n_tokens, n_expert_used] for
        layer ``layers[j]``."""
        for il, a in zip(layers, ids, strict=True):
            self._forced[il, : a.shape[0], :] = a
        B.libggml_base.ggml_backend_tensor_set(ctypes.cast(self.forced, B.ggml_tensor_p),
                                               self._forced.ctypes.data, 0, self._forced.nbytes)

    def clear_routing(self) -> None:
        """Fill the routing output with -1 before a table-mode decode: a layer that computes fewer tokens than
        the micro-batch has (llama.cpp's last layer computes only the tokens whose logits are wanted) leaves
        the rest of its columns -1, not a previous token's ids."""
        self._buf.fill(-1)
        B.libggml_base.ggml_backend_tensor_set(ctypes.cast(self.routing, B.ggml_tensor_p), self._buf.ctypes.data,
                                               0, self._buf.nbytes)

    def read_routing(self, n_tokens: int) -> np.ndarray:
        """The last table-mode micro-batch's selected experts, I32 [n_layer, n_tokens, n_expert_used] (a view
        of a buffer reused by the next call; -1 for tokens a layer did not compute). Call after the decode's
        logits were read (device idle)."""
        B.libggml_base.ggml_backend_tensor_get(self._routing_p, self._buf_ptr, 0, self._buf_bytes)
        return self._buf[:, :n_tokens, :]

    def entry_flip(self, il: int, kind: int, expert: int, slot: int) -> tuple[int, int, int] | None:
        """(tables tensor, byte offset, value) that points layer ``il``'s entry of ``expert`` for tensor kind
        ``kind`` (the slot tensors' order) at ``slot``: what the copy stream writes once that kind's copy into
        the slot landed. A split layer: for a bottom buffer (``slot`` < 0, ``bottom_target``) its row 1, one
        word (harmless while the expert's top is unmapped: split -1, row 1 unread); None for a top slot (its
        three rows change together, between tokens)."""
        lt = self.layers.get(il)
        if lt is None:
            return None
        if lt.is_split:
            if slot >= 0:
                return None
            n_expert = lt.views[kind].shape[1]
            return self.all, (lt.offsets[kind] + n_expert + expert) * 8, lt.buffer_entry(kind, -1 - slot)
        return self.all, (lt.offsets[kind] + expert) * 8, lt.slot_data[kind] + slot * lt.slot_bytes[kind]

    @property
    def writes(self) -> int:
        """Table entries changed since load (each sent to the device by the next flush)."""
        return self.changed + self.dirty

    def is_identity(self, il: int) -> bool:
        """Whether layer ``il``'s every expert is ready in its own slot (slot e holds expert e), with no host part:
        what identity needs (patch 0017)."""
        lt = self.layers.get(il)
        if lt is None or lt.is_split or lt.cpu is not None or not lt.is_mapped.all():
            return False
        n_expert = lt.is_mapped.size
        own = np.arange(n_expert, dtype=np.int64)
        return all(np.array_equal(v[0], data + own * nb) for v, data, nb in zip(lt.views, lt.slot_data, lt.slot_bytes,
                                                                                strict=True))

    def set_identity(self, layers: Iterable[int], on: bool) -> None:
        """Identity on or off for ``layers`` (patch 0017): on, a layer's graph reads its slot tensors at the
        selected ids with stock's matmuls, no table; the caller has checked ``is_identity``."""
        P = _patched.symbols()
        for il in sorted(layers):
            rc = P.llama_ggmoe_set_layer_identity(self.ctx_ptr, il, on)
            if rc != _patched.LLAMA_GGMOE_OK:
                raise EngineError(f"identity of layer {il} failed: {_patched.ERROR_NAMES.get(rc, rc)}")
            (self.identity.add if on else self.identity.discard)(il)

    def set_host_part(self, cpu_of: Mapping[int, Sequence[bool]]) -> None:
        """The async decode's host part (patch 0016): per layer, the experts the CPU computes whenever no slot
        holds them (``ExpertCache.cpu_of``). Their entries become 0 while unmapped, which the device part skips,
        and the layer's flags, which the graph's host part reads, say so."""
        P = _patched.symbols()
        for il, cpu in cpu_of.items():
            lt = self.layers[il]
            if lt.is_split:
                raise EngineError(f"layer {il}'s experts are split: the host part reads whole experts")
            lt.cpu = cpu
            for e in np.flatnonzero(~lt.is_mapped):
                lt.unmapped(int(e))
            rc = P.llama_ggmoe_set_layer_table_host(self.ctx_ptr, il, lt.flags.ctypes.data)
            if rc != _patched.LLAMA_GGMOE_OK:
                raise EngineError(f"registering the host part of layer {il} failed: "
                                  f"{_patched.ERROR_NAMES.get(rc, rc)}")
        self.flush()

    def detach(self) -> None:
        """Take the tables out of the context (before it is freed or the slots change)."""
        if self.ctx_ptr:
            P = _patched.symbols()
            P.llama_ggmoe_set_table_mode(self.ctx_ptr, 0, None)  # also drops a forced routing
            for il in self.layers:  # (a layer's fill words and identity go with its tables)
                P.llama_ggmoe_set_layer_table(self.ctx_ptr, il, None, None, None, None)
            self.identity.clear()
            self.ctx_ptr = 0

    def close(self) -> None:
        self.arena.close()


class FillWords:
    """Every fill layer's words (patch 0012, ``ggml_mul_mat_id_set_fill``): one I64 tensor ``[W, n]``, a row per
    layer of ``GGML_MMID_FILL_WORDS(f_max, n_expert)`` words, each row a view handed to the layer's matmuls. ``write``
    sends the targets and a new stamp before a table-mode decode; ``read`` says what the graph filled."""

    def __init__(self, arena: TensorArena, layers: Sequence[int], f_max: int, n_expert: int) -> None:
        self.f_max = f_max
        self.width = 5 + 6 * f_max + n_expert  # words per layer (GGML_MMID_FILL_WORDS)
        self.scores = 5 + 6 * f_max  # where each expert's admission score starts in a row
        self.row = {il: i for i, il in enumerate(layers)}
        self.words = np.zeros((len(layers), self.width), dtype=np.int64)  # the host mirror
        self.words[:, 1] = f_max
        self.tensor = arena.new_tensor(GGML_TYPE_I64, self.width, len(layers), 1, "ggmoe_fill_words")
        self.views = [arena.new_view_1d(self.tensor, self.width, i * self.width * 8, f"ggmoe_fill.{il}")
                      for il, i in self.row.items()]
        self.stamp = 0
        self.targets: dict[int, FillTargets] = {}  # what the last write handed each layer
        self._back = np.zeros_like(self.words)  # read back after a decode

    def register(self, ctx_ptr: int) -> None:
        P = _patched.symbols()
        self._p = ctypes.cast(self.tensor, B.ggml_tensor_p)  # cast once: written and read every token
        self.write(())  # defined words (no targets) before any graph can read them: device memory starts undefined
        for il, view in zip(self.row, self.views, strict=True):
            rc = P.llama_ggmoe_set_layer_fill(ctx_ptr, il, view)
            if rc != _patched.LLAMA_GGMOE_OK:
                raise EngineError(f"registering the fill words of layer {il} failed: "
                                  f"{_patched.ERROR_NAMES.get(rc, rc)}")

    def write(self, targets: Sequence[FillTargets]) -> None:
        """Before a table-mode decode: each layer's fill slots and the experts they hold (none for a layer
        without targets), under a new stamp, so the layer's first matmul assigns afresh."""
        w, f_max = self.words, self.f_max
        self.stamp += 1
        w[:, 0] = 0
        w[:, 2] = self.stamp
        self.targets = {p.il: p for p in targets}
        for p in targets:
            r, f = self.row[p.il], len(p.slots)
            w[r, 0] = f
            w[r, 3: 3 + f] = p.slots
            w[r, 3 + f_max: 3 + f_max + f] = p.held
            w[r, 3 + 2 * f_max: 3 + 2 * f_max + f] = p.bar or -1  # -1: any miss takes the slot
            w[r, self.scores:] = p.score if p.score is not None else 0
        B.libggml_base.ggml_backend_tensor_set(self._p, w.ctypes.data, 0, w.nbytes)

    def read(self) -> list[Fill]:
        """After the decode (device idle): the experts each layer's graph filled, and into which slots."""
        if not self.targets:
            return []
        back, f_max = self._back, self.f_max
        B.libggml_base.ggml_backend_tensor_get(self._p, back.ctypes.data, 0, back.nbytes)
        out, base = [], 3 + 3 * f_max
        for il, t in self.targets.items():
            r = back[self.row[il]]
            if r[base] != self.stamp:
                continue  # the layer did not run this decode's matmuls
            held_of = dict(zip(t.slots, t.held, strict=True))
            for i in range(int(r[base + 1])):
                slot = int(r[base + 2 + f_max + i])
                out.append(Fill(il, int(r[base + 2 + i]), slot, held_of.get(slot, -1)))
        self.targets = {}
        return out
