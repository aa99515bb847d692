"""Raw ctypes declarations of the symbols ggmoe's llama.cpp patches add (see patches/README.md).

The lowest layer for the expert cache: each function carries its C prototype
as a comment, nothing here owns memory or holds policy. The symbols live in
llama-cpp-python's ``libllama``; a library built without ``patches/`` lacks
them, and ``symbols()`` then raises ``EngineNotPatchedError`` naming the first
missing symbol.

Usage (engine layer only)::

    P = _patched.symbols()
    P.llama_ggmoe_set_route_cb(ctx, P.route_cb(fn), None)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from ggmoe.base.errors import EngineNotPatchedError

# Return codes of llama_ggmoe_set_layer_cache and errors of llama_ggmoe_get_error
# (mirror of the LLAMA_GGMOE_* defines in llama.h; negative so they never collide
# with a route callback's own nonzero return value).
LLAMA_GGMOE_OK = 0
LLAMA_GGMOE_ERR_LAYER = -1001  # il out of range [0, n_layer)
LLAMA_GGMOE_ERR_NOT_MOE = -1002  # the layer has no routed expert tensors
LLAMA_GGMOE_ERR_TENSOR = -1003  # cache tensor missing for a kind the layer has, or given for one it lacks
LLAMA_GGMOE_ERR_TYPE = -1004  # cache tensor type differs from the expert tensor's
LLAMA_GGMOE_ERR_SHAPE = -1005  # cache tensor is not [ne0, ne1, n_slots] of the expert tensor (or not contiguous)
LLAMA_GGMOE_ERR_ALLOC = -1006  # cache tensor has no memory
LLAMA_GGMOE_ERR_SLOT = -1007  # the route callback wrote a slot outside [0, n_slots)
LLAMA_GGMOE_ERR_NO_CB = -1008  # a cache layer ran without a route callback
LLAMA_GGMOE_ERR_ARG = -1009  # NULL context or negative n_slots
LLAMA_GGMOE_ERR_HOST = -1010  # the host path cannot serve the layer (no cache, or fewer than 2 slots)

# A route callback's answer for a selected expert: computed by the CPU from the model's host tensor.
LLAMA_GGMOE_SLOT_HOST = -1
# Micro-batches of at most this many tokens may use the host path (below the GPU backends' op offload).
LLAMA_GGMOE_HOST_MAX_TOKENS = 16
ERROR_NAMES: dict[int, str] = {
    LLAMA_GGMOE_ERR_LAYER: "LLAMA_GGMOE_ERR_LAYER",
    LLAMA_GGMOE_ERR_NOT_MOE: "LLAMA_GGMOE_ERR_NOT_MOE",
    LLAMA_GGMOE_ERR_TENSOR: "LLAMA_GGMOE_ERR_TENSOR",
    LLAMA_GGMOE_ERR_TYPE: "LLAMA_GGMOE_ERR_TYPE",
    LLAMA_GGMOE_ERR_SHAPE: "LLAMA_GGMOE_ERR_SHAPE",
    LLAMA_GGMOE_ERR_ALLOC: "LLAMA_GGMOE_ERR_ALLOC",
    LLAMA_GGMOE_ERR_SLOT: "LLAMA_GGMOE_ERR_SLOT",
    LLAMA_GGMOE_ERR_NO_CB: "LLAMA_GGMOE_ERR_NO_CB",
    LLAMA_GGMOE_ERR_ARG: "LLAMA_GGMOE_ERR_ARG",
    LLAMA_GGMOE_ERR_HOST: "LLAMA_GGMOE_ERR_HOST",
}

# typedef int32_t (*llama_ggmoe_route_cb)(
#         void * user_data, int32_t il, int32_t n_tokens, int32_t n_expert_used, int32_t n_expert, int32_t n_embd,
#         const int32_t * ids, const float * probs, const float * inp, int32_t * slots,
#         const float * scores, int32_t n_scores);
route_cb = ctypes.CFUNCTYPE(
    ctypes.c_int32,
    ctypes.c_void_p,  # user_data
    ctypes.c_int32,  # il
    ctypes.c_int32,  # n_tokens
    ctypes.c_int32,  # n_expert_used
    ctypes.c_int32,  # n_expert
    ctypes.c_int32,  # n_embd
    ctypes.c_void_p,  # ids   [n_tokens][n_expert_used] int32
    ctypes.c_void_p,  # probs [n_tokens][n_expert] float32
    ctypes.c_void_p,  # inp   [n_tokens][n_embd] float32
    ctypes.c_void_p,  # slots [n_tokens][n_expert_used] int32, NULL in observe mode
    ctypes.c_void_p,  # scores [n_tokens][n_scores] float32, the in-graph predictor's; NULL without one
    ctypes.c_int32,  # n_scores
)

# typedef int32_t (*llama_ggmoe_wait_cb)(void * user_data, int32_t il);
wait_cb = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)

# (name, argtypes, restype) of every patched symbol; ggml tensors are passed as void pointers
# so that callers may hand in any ctypes tensor pointer or address.
_SIGNATURES: tuple[tuple[str, list[Any], Any], ...] = (
    # struct ggml_tensor * llama_ggmoe_model_get_tensor(const struct llama_model * model, const char * name);
    ("llama_ggmoe_model_get_tensor", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
    # void llama_ggmoe_set_route_cb(struct llama_context * ctx, llama_ggmoe_route_cb cb, void * user_data);
    # (pass route_cb() -- a NULL function pointer -- to remove the hook)
    ("llama_ggmoe_set_route_cb", [ctypes.c_void_p, route_cb, ctypes.c_void_p], None),
    # int32_t llama_ggmoe_get_error(struct llama_context * ctx);
    ("llama_ggmoe_get_error", [ctypes.c_void_p], ctypes.c_int32),
    # int32_t llama_ggmoe_set_layer_cache(struct llama_context * ctx, int32_t il, int32_t n_slots,
    #         struct ggml_tensor * up, struct ggml_tensor * gate, struct ggml_tensor * down,
    #         struct ggml_tensor * gate_up);
    ("llama_ggmoe_set_layer_cache",
     [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
     ctypes.c_int32),
    # int32_t llama_ggmoe_set_host_path(struct llama_context * ctx, int32_t il, int32_t zero_slot);
    ("llama_ggmoe_set_host_path", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    # void llama_ggmoe_set_route_inputs(struct llama_context * ctx, bool probs, bool inp);
    ("llama_ggmoe_set_route_inputs", [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    # int32_t llama_ggmoe_set_predictor(struct llama_context * ctx, int32_t il, struct ggml_tensor * w1,
    #         struct ggml_tensor * b1, struct ggml_tensor * w2, struct ggml_tensor * b2);
    ("llama_ggmoe_set_predictor",
     [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
     ctypes.c_int32),
    # int32_t llama_ggmoe_set_layer_table(struct llama_context * ctx, int32_t il, struct ggml_tensor * up,
    #         struct ggml_tensor * gate, struct ggml_tensor * down, struct ggml_tensor * gate_up);
    ("llama_ggmoe_set_layer_table",
     [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
     ctypes.c_int32),
    # int32_t llama_ggmoe_set_table_mode(struct llama_context * ctx, int32_t max_tokens,
    #         struct ggml_tensor * routing);
    ("llama_ggmoe_set_table_mode", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p], ctypes.c_int32),
    # int32_t llama_ggmoe_set_forced_routing(struct llama_context * ctx, struct ggml_tensor * forced);
    ("llama_ggmoe_set_forced_routing", [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int32),
    # int32_t llama_ggmoe_set_mailbox(struct llama_context * ctx, int64_t * seq, int32_t * ids, float * hidden,
    #                                 int64_t * ack, int32_t max_tokens, int64_t n_embd);
    ("llama_ggmoe_set_mailbox", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int32, ctypes.c_int64], ctypes.c_int32),
    # int32_t llama_ggmoe_set_layer_fill(struct llama_context * ctx, int32_t il, struct ggml_tensor * fill);
    ("llama_ggmoe_set_layer_fill", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p], ctypes.c_int32),
    # int32_t llama_ggmoe_set_layer_table_host(struct llama_context * ctx, int32_t il, int32_t * flags);
    ("llama_ggmoe_set_layer_table_host", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p], ctypes.c_int32),
    # int32_t llama_ggmoe_set_layer_identity(struct llama_context * ctx, int32_t il, bool on);
    ("llama_ggmoe_set_layer_identity", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool], ctypes.c_int32),
    # bool llama_ggmoe_set_mmap_prefetch(bool prefetch);
    ("llama_ggmoe_set_mmap_prefetch", [ctypes.c_bool], ctypes.c_bool),
    # int32_t llama_ggmoe_set_host_threads(struct llama_context * ctx, int32_t n_threads, int32_t order);
    ("llama_ggmoe_set_host_threads", [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    # int32_t llama_ggmoe_set_host_spin(struct llama_context * ctx, int32_t spin_us);
    ("llama_ggmoe_set_host_spin", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    # void llama_ggmoe_set_wait_cb(struct llama_context * ctx, llama_ggmoe_wait_cb cb, void * user_data);
    # (pass wait_cb() -- a NULL function pointer -- to remove the hook)
    ("llama_ggmoe_set_wait_cb", [ctypes.c_void_p, wait_cb, ctypes.c_void_p], None),
    # int32_t llama_ggmoe_get_host_stats(struct llama_context * ctx, int64_t * out);
    ("llama_ggmoe_get_host_stats", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)], ctypes.c_int32),
)

SYMBOLS: tuple[str, ...] = tuple(name for name, _, _ in _SIGNATURES)


@dataclass(frozen=True)
class PatchedLib:
    """The patched entry points, bound with argtypes/restype (attribute = C function)."""

    llama_ggmoe_model_get_tensor: Any
    llama_ggmoe_set_route_cb: Any
    llama_ggmoe_get_error: Any
    llama_ggmoe_set_layer_cache: Any
    llama_ggmoe_set_host_path: Any
    llama_ggmoe_set_route_inputs: Any
    llama_ggmoe_set_predictor: Any
    llama_ggmoe_set_layer_table: Any
    llama_ggmoe_set_table_mode: Any
    llama_ggmoe_set_forced_routing: Any
    llama_ggmoe_set_mailbox: Any
    llama_ggmoe_set_layer_fill: Any
    llama_ggmoe_set_layer_table_host: Any
    llama_ggmoe_set_layer_identity: Any
    llama_ggmoe_set_mmap_prefetch: Any
    llama_ggmoe_set_host_threads: Any
    llama_ggmoe_set_host_spin: Any
    llama_ggmoe_get_host_stats: Any
    llama_ggmoe_set_wait_cb: Any
    route_cb: Any = route_cb
    wait_cb: Any = wait_cb


def _libllama() -> ctypes.CDLL:
    try:
        from llama_cpp import llama_cpp as lowlevel
    except ImportError as e:  # pragma: no cover - depends on the install
        raise EngineNotPatchedError(
            "llama-cpp-python is not installed, so the ggmoe engine is missing: run `ggmoe engine build "
            "--install` (or `make engine` in a clone)"
        ) from e
    return lowlevel._lib


def bind(lib: ctypes.CDLL) -> PatchedLib:
    """Declare every patched symbol of ``lib``; raise EngineNotPatchedError if one is missing."""
    funcs = {}
    for name, argtypes, restype in _SIGNATURES:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise EngineNotPatchedError(
                f"the llama.cpp library {getattr(lib, '_name', lib)!s} lacks `{name}`: the ggmoe engine "
                "is not patched; run `ggmoe engine build --install` (or `make engine` in a clone) to build "
                "and install llama-cpp-python with ggmoe's patches applied"
            ) from None
        fn.argtypes = argtypes
        fn.restype = restype
        funcs[name] = fn
    return PatchedLib(**funcs)


_loaded: PatchedLib | None = None


def symbols() -> PatchedLib:
    """The patched symbols of llama-cpp-python's libllama (bound once, then cached)."""
    global _loaded
    if _loaded is None:
        _loaded = bind(_libllama())
    return _loaded


def is_patched() -> bool:
    """True if the installed libllama exports every symbol ggmoe's patches add."""
    try:
        symbols()
    except EngineNotPatchedError:
        return False
    return True
