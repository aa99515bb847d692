"""``TensorArena``: a ggml context of tensor descriptions and the one backend buffer that holds their data.

The small owning wrapper under the engine's own tensors (the cache's slots, the in-graph predictor's
weights): tensors are declared first (``no_alloc``), then allocated together on a buffer type (the GPU's
or the CPU's), and freed together.
"""

from __future__ import annotations

import ctypes

from ggmoe.base.errors import EngineError
from ggmoe.engine import ggml as B


class TensorArena:
    """Up to ``n_tensors`` tensors, declared with ``new_tensor``, then ``allocate``d on one buffer."""

    def __init__(self, n_tensors: int, what: str) -> None:
        """``what`` names the tensors in errors ("the cache tensors")."""
        self.what = what
        self.buffer = None
        params = B.ggml_init_params(mem_size=(n_tensors + 1) * B.libggml_base.ggml_tensor_overhead(),
                                    mem_buffer=None, no_alloc=True)
        self.ctx = B.libggml_base.ggml_init(params)
        if not self.ctx:
            raise EngineError(f"ggml_init failed for {what}")

    def new_tensor(self, ggml_type: int, ne0: int, ne1: int, ne2: int, name: str) -> int:
        """A tensor [ne0, ne1, ne2] (its address), without memory until ``allocate``."""
        t = B.libggml_base.ggml_new_tensor_3d(self.ctx, ggml_type, ne0, ne1, ne2)
        B.libggml_base.ggml_set_name(t, name.encode())
        return ctypes.cast(t, ctypes.c_void_p).value

    def new_view_1d(self, src: int, ne0: int, offset: int, name: str) -> int:
        """A 1-D view of ``ne0`` elements of tensor ``src`` from ``offset`` bytes (its address); it gets its
        memory with ``src`` in ``allocate``."""
        t = B.libggml_base.ggml_view_1d(self.ctx, ctypes.cast(src, B.ggml_tensor_p), ne0, offset)
        B.libggml_base.ggml_set_name(t, name.encode())
        return ctypes.cast(t, ctypes.c_void_p).value

    def new_view_2d(self, src: int, ne0: int, ne1: int, nb1: int, offset: int, name: str) -> int:
        """A 2-D view ``[ne0, ne1]`` (rows ``nb1`` bytes apart) of tensor ``src`` from ``offset`` bytes."""
        t = B.libggml_base.ggml_view_2d(self.ctx, ctypes.cast(src, B.ggml_tensor_p), ne0, ne1, nb1, offset)
        B.libggml_base.ggml_set_name(t, name.encode())
        return ctypes.cast(t, ctypes.c_void_p).value

    def allocate(self, buft: int) -> int:
        """Memory for every declared tensor on buffer type ``buft``; returns its size in bytes."""
        self.buffer = B.libggml_base.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft)
        if not self.buffer:
            raise EngineError(f"could not allocate {self.what} (out of device memory?)")
        return B.libggml_base.ggml_backend_buffer_get_size(self.buffer)

    def clear(self) -> None:
        """Zero every byte of the allocated memory (one memset on the buffer's device)."""
        B.libggml_base.ggml_backend_buffer_clear(self.buffer, 0)

    def close(self) -> None:
        if self.buffer:
            B.libggml_base.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            B.libggml_base.ggml_free(self.ctx)
            self.ctx = None
