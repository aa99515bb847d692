"""The mailbox: each table-mode MoE layer's routing reaches the host while the device goes on (patch 0010).

Engine layer (ctypes allowed). Three arrays in host memory the device can write (on a GPU the pinned host
buffer of its device, on the CPU build plain host memory), registered with ``llama_ggmoe_set_mailbox`` whenever table mode comes on (``attach``):

- ``seq`` I64 ``[n_layer]``: cleared by the host before each decode; layer ``il``'s first expert matmul stores
  ``2*n + (hidden written)`` there after it wrote the rest (release order; on CUDA a system-wide fence);
- ``ids`` I32 ``[n_layer, max_tokens, n_expert_used]``: the layer's selected experts, its first ``n`` tokens;
- ``hidden`` F32 ``[n_layer, max_tokens, n_embd]`` (only when a predictor reads the MoE input): the layer's
  input rows;
- ``ack`` I64 ``[n_layer]``, the CPU build's benchmarks only (``GGMOE_MAILBOX_LOCKSTEP=1``): ggml-cpu waits
  after layer ``il``'s mailbox write until ``ack[il]`` is set, so the host handles every layer before its
  matmuls run, as a GPU machine's idle cores keep pace with the device. Named in every result it produces.

A host thread polls ``seq`` while ``llama_decode`` runs (ctypes releases the GIL) and reads a layer's entry as
soon as its count is there. Nothing in the graph waits for the host: one small device-to-host write per layer.
x86 keeps loads in order, so a count seen means its ids are seen (the writer stored them first).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from ggmoe.base.errors import EngineError, UsageError
from ggmoe.engine import ggml as B
from ggmoe.engine import patch as _patched
from ggmoe.engine.arena import TensorArena

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_TYPE_I64 = 27
LOCKSTEP_ENV = "GGMOE_MAILBOX_LOCKSTEP"  # 1: the CPU build's benchmark lockstep (see the module's doc)


def lockstep_from_env(on_gpu: bool) -> bool:
    """Whether ``GGMOE_MAILBOX_LOCKSTEP`` asks for lockstep; refused on a GPU (whose device never waits)."""
    raw = os.environ.get(LOCKSTEP_ENV, "").strip()
    if raw in ("", "0"):
        return False
    if raw != "1":
        raise UsageError(f"{LOCKSTEP_ENV}={raw!r}: expected 1 or 0")
    if on_gpu:
        raise UsageError(f"{LOCKSTEP_ENV}=1 is the CPU build's benchmark mode: a GPU never waits for the host")
    return True


def host_buffer_type() -> int:
    """Host memory the device can write: the GPU's pinned host buffer type, else the CPU's."""
    dev = B.libggml.ggml_backend_dev_by_type(B.GGML_BACKEND_DEVICE_TYPE_GPU)
    if dev:
        buft = B.libggml.ggml_backend_dev_host_buffer_type(dev)
        if buft:
            return buft
        raise EngineError("the GPU backend has no pinned host buffer type for the mailbox")
    return B.libggml_cpu.ggml_backend_cpu_buffer_type()


def _array(tensor: int, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of a host tensor's memory (valid while its arena lives)."""
    data = ctypes.cast(tensor, B.ggml_tensor_p).contents.data
    n = int(np.prod(shape))
    buf = (ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(data)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


class Mailbox:
    """The mailbox of one context (see the module's doc); ``close`` after ``detach``."""

    def __init__(self, ctx_ptr: int, n_layer: int, max_tokens: int, n_expert_used: int, n_embd: int,
                 hidden: bool, lockstep: bool = False) -> None:
        self.ctx_ptr = ctx_ptr
        self.max_tokens = max_tokens
        self.lockstep = lockstep
        self.arena = TensorArena(4, "the mailbox")
        try:
            seq = self.arena.new_tensor(GGML_TYPE_I64, n_layer, 1, 1, "ggmoe_mailbox_seq")
            ids = self.arena.new_tensor(GGML_TYPE_I32, n_expert_used, max_tokens, n_layer, "ggmoe_mailbox_ids")
            hid = (self.arena.new_tensor(GGML_TYPE_F32, n_embd, max_tokens, n_layer, "ggmoe_mailbox_hidden")
                   if hidden else None)
            ack = self.arena.new_tensor(GGML_TYPE_I64, n_layer, 1, 1, "ggmoe_mailbox_ack") if lockstep else None
            self.arena.allocate(host_buffer_type())
            self.ack = _array(ack, np.int64, (n_layer,)) if ack is not None else None
            self.release_all()
            self.seq = _array(seq, np.int64, (n_layer,))
            self.ids = _array(ids, np.int32, (n_layer, max_tokens, n_expert_used))
            self.hidden = _array(hid, np.float32, (n_layer, max_tokens, n_embd)) if hid is not None else None
            self.seq.fill(0)
            data = lambda t: ctypes.cast(t, B.ggml_tensor_p).contents.data if t else None  # noqa: E731
            self._args = (data(seq), data(ids), data(hid), data(ack), max_tokens, n_embd if hid is not None else 0)
        except BaseException:
            self.arena.close()
            raise

    def attach(self) -> None:
        """Register with the context: after table mode came on (turning it off drops the mailbox)."""
        rc = _patched.symbols().llama_ggmoe_set_mailbox(self.ctx_ptr, *self._args)
        if rc != _patched.LLAMA_GGMOE_OK:
            raise EngineError(f"registering the mailbox failed: {_patched.ERROR_NAMES.get(rc, rc)}")

    def clear(self) -> None:
        """Before a decode: no layer has written (the previous decode's graph has finished)."""
        self.seq.fill(0)

    def hold(self) -> None:
        """Lockstep: before a decode the reader reads, every layer waits for its acknowledgement."""
        if self.ack is not None:
            self.ack.fill(0)

    def acknowledge(self, il: int) -> None:
        """Lockstep: the host has handled layer ``il``; its matmuls may run."""
        if self.ack is not None:
            self.ack[il] = 1

    def release_all(self) -> None:
        """Lockstep: no layer waits (a decode nobody reads, an error, teardown)."""
        if self.ack is not None:
            self.ack.fill(1)

    def written(self, il: int) -> tuple[int, bool]:
        """(tokens layer ``il`` wrote, whether with its input rows); (0, False) while it has not."""
        v = int(self.seq[il])
        return v >> 1, bool(v & 1)

    def read(self, il: int, n_tokens: int, with_hidden: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of layer ``il``'s ids [n_tokens, n_expert_used] and input rows [n_tokens, n_embd] (or None)."""
        ids = self.ids[il, :n_tokens].copy()
        hidden = self.hidden[il, :n_tokens].copy() if with_hidden and self.hidden is not None else None
        return ids, hidden

    def detach(self) -> None:
        """Take the mailbox off the context (before its memory is freed)."""
        self.release_all()
        if self.ctx_ptr:
            _patched.symbols().llama_ggmoe_set_mailbox(self.ctx_ptr, None, None, None, None, 0, 0)
            self.ctx_ptr = 0

    def close(self) -> None:
        self.detach()
        self.arena.close()
