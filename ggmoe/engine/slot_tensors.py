"""The expert cache's device buffers: every cached layer's slot tensors, and where each expert comes from.

Engine layer (ctypes allowed). ``SlotTensors`` allocates, for every MoE layer,
one cache tensor ``[ne0, ne1, n_slots]`` per expert tensor kind with ggml's
allocator on the layer's device buffer type (a split layer's hold packed tops,
and it gets bottom buffers beside them). ``SlotPair`` is one kind of one layer:
the model's expert tensor in host memory and its slot tensor, and what a copy
of one expert into one slot writes. The copies themselves are
``ggmoe.engine.copies``; ``ggmoe.engine.runtime`` owns both.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from ggmoe.base.errors import EngineError
from ggmoe.cache.split import KindSplit, LayerSplit, Pieces
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.arena import TensorArena
from ggmoe.inspect.names import CACHED_KINDS, expert_weight_name


@dataclass(frozen=True)
class SlotPair:
    """One kind of one layer: where experts live on the host and their slot tensor."""

    host: int  # ggml_tensor * of the model's expert tensor [ne0, ne1, n_expert]
    host_data: int  # its data pointer (host memory)
    cache: int  # ggml_tensor * of the slot tensor [ne0, ne1, n_slots]
    nb2: int  # bytes of one expert slice (same in both)
    split: KindSplit | None = None  # a split layer's kind: the slot tensor holds top segments, packed
    bottom: int = 0  # ggml_tensor * of a split layer's bottom buffers, packed bottoms of this kind (0: none)
    whole: Pieces = field(init=False, repr=False, compare=False)  # what a whole-expert copy writes (``__post_init__``)

    def __post_init__(self) -> None:
        # a whole expert's one contiguous run, made once: every copy into the slot tensor writes it
        object.__setattr__(self, "whole", Pieces(0, 0, self.nb2, 1, self.nb2, self.nb2))

    @property
    def slot_bytes(self) -> int:
        """Bytes from one slot to the next in the slot tensor: a whole expert, or a top segment."""
        return self.split.top_bytes if self.split is not None else self.nb2


class SlotTensors:
    """Owns the ggml context and backend buffer of every layer's slot tensors."""

    def __init__(self, model_ptr: int, n_slots: dict[int, int], buft: int, zero_slot: bool = False,
                 split: dict[int, LayerSplit] | None = None, n_bottom: int = 0) -> None:
        """``zero_slot``: one more slot per layer, after the others, filled with zeros (the host path's).
        ``split``: layers whose slots hold top segments (MoEpic); their slot tensors are ``[ne0, ne1, m]`` with
        m whole experts' bytes enough for every top (``registered``), and ``n_bottom`` packed bottom buffers each."""
        split = split or {}
        P = _patched.symbols()
        self.buft = buft  # the slots' buffer type (the expert tables go on the same device)
        self.pairs: dict[int, list[SlotPair]] = {}
        found: dict[int, dict[str, int]] = {}
        for il in n_slots:
            found[il] = {k: P.llama_ggmoe_model_get_tensor(model_ptr, expert_weight_name(il, k).encode())
                         for k in CACHED_KINDS}
            found[il] = {k: v for k, v in found[il].items() if v}
            if not found[il]:
                raise EngineError(f"layer {il} has no expert tensors")
        n_bottom = n_bottom if split else 0
        self.arena = TensorArena(sum(len(v) for v in found.values()) * (2 if n_bottom else 1), "the expert cache")
        # slots the context is told each layer has: a split layer's slot tensors hold its tops in whole experts'
        # room (the tensors are the tables' template, so they keep the expert's shape)
        self.registered: dict[int, int] = {}
        try:
            self.tensors: dict[int, dict[str, int]] = {}
            bottoms: dict[int, dict[str, int]] = {}
            for il, kinds in found.items():
                self.tensors[il], bottoms[il] = {}, {}
                ks = {k.kind: k for k in split[il].kinds} if il in split else {}
                n = n_slots[il] + int(zero_slot)
                if ks:  # tops packed: enough whole experts' bytes for n_slots tops of the largest share
                    n = max(1, max(-(-n_slots[il] * ks[k].top_bytes // ks[k].nb2) for k in kinds))
                self.registered[il] = n
                for kind, host_ptr in kinds.items():
                    h = ctypes.cast(host_ptr, B.ggml_tensor_p).contents
                    self.tensors[il][kind] = self.arena.new_tensor(h.type, h.ne[0], h.ne[1], n,
                                                                   f"ggmoe_slots.{il}.{kind}")
                    if ks and n_bottom:  # packed bottoms, in whole experts' room (a tensor of the expert's shape)
                        nb = max(1, -(-n_bottom * ks[kind].bottom_bytes // ks[kind].nb2))
                        bottoms[il][kind] = self.arena.new_tensor(h.type, h.ne[0], h.ne[1], nb,
                                                                  f"ggmoe_bottoms.{il}.{kind}")
            self.nbytes = self.arena.allocate(buft)  # bytes
            for il, kinds in found.items():
                ks = {k.kind: k for k in split[il].kinds} if il in split else {}
                self.pairs[il] = [self._pair(host_ptr, self.tensors[il][kind], ks.get(kind),
                                             bottoms[il].get(kind, 0)) for kind, host_ptr in kinds.items()]
        except BaseException:
            self.close()
            raise
        if zero_slot:
            # every slot zeros: the zero slot, and the slots the patch hands a token's other host entries (their
            # device product is masked to zero: a slot never filled must read finite numbers, not NaN garbage)
            self.arena.clear()

    @staticmethod
    def _pair(host_ptr: int, cache_ptr: int, split: KindSplit | None = None, bottom: int = 0) -> SlotPair:
        h = ctypes.cast(host_ptr, B.ggml_tensor_p).contents
        if not h.buffer or not B.libggml_base.ggml_backend_buffer_is_host(h.buffer) or not h.data:
            raise EngineError(f"expert tensor {h.name.decode()} is not in host memory; "
                              "load the model with experts_on_host=True")
        return SlotPair(host=host_ptr, host_data=h.data, cache=cache_ptr, nb2=h.nb[2], split=split, bottom=bottom)

    def bytes_per_expert(self) -> dict[int, int]:
        return {il: sum(p.nb2 for p in pairs) for il, pairs in self.pairs.items()}

    def close(self) -> None:
        self.arena.close()
