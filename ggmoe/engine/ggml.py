"""Raw ctypes declarations for the ggml symbols ggmoe needs beyond llama-cpp-python.

The lowest layer: each function carries its C prototype as a comment, nothing
here owns memory or knows about MoE. llama-cpp-python already declares the
``llama_*`` API; this module adds ggml's tensor accessors and backend
registry from the libraries that sit beside ``libllama`` (``libggml-base``,
``libggml``, ``libggml-cpu``). Only ``ggmoe.engine`` imports this module.
"""

from __future__ import annotations

import ctypes
import pathlib

from ggmoe.base.errors import EngineError

try:
    import llama_cpp
    from llama_cpp import llama_cpp as _llama_lowlevel
    from llama_cpp._ctypes_extensions import load_shared_library
except ImportError as e:  # pragma: no cover - depends on the install
    raise EngineError(
        "llama-cpp-python is not installed; run `make setup` (it builds the patched engine)"
    ) from e

LIB_DIR = pathlib.Path(_llama_lowlevel._base_path)


def _load(name: str) -> ctypes.CDLL:
    """A library beside libllama, through llama-cpp-python's own loader (already mapped: libllama needs it)."""
    try:
        return load_shared_library(name, LIB_DIR)
    except (OSError, RuntimeError, FileNotFoundError) as e:
        raise EngineError(f"cannot load lib{name} from {LIB_DIR}: {e}") from e


libggml_base = _load("ggml-base")
libggml = _load("ggml")
libggml_cpu = _load("ggml-cpu")

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64  # bytes
GGML_MAX_NAME = 64  # bytes

# enum ggml_type (subset ggmoe reads directly)
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26

# enum ggml_backend_dev_type
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1


# struct ggml_tensor {
#     enum ggml_type type;
#     struct ggml_backend_buffer * buffer;
#     int64_t ne[GGML_MAX_DIMS];
#     size_t  nb[GGML_MAX_DIMS];
#     enum ggml_op op;
#     int32_t op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
#     int32_t flags;
#     struct ggml_tensor * src[GGML_MAX_SRC];
#     struct ggml_tensor * view_src;
#     size_t               view_offs;
#     void * data;
#     char name[GGML_MAX_NAME];
#     void * extra;
#     char padding[8];
# };
class ggml_tensor(ctypes.Structure):
    pass


ggml_tensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(ggml_tensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(ggml_tensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]
ggml_tensor_p = ctypes.POINTER(ggml_tensor)

# struct ggml_object { size_t offs; size_t size; struct ggml_object * next; enum ggml_object_type type; char padding[4]; };
GGML_OBJECT_SIZE = 32  # bytes, used to check the ggml_tensor mirror above

# size_t ggml_tensor_overhead(void);
libggml_base.ggml_tensor_overhead.argtypes = []
libggml_base.ggml_tensor_overhead.restype = ctypes.c_size_t

# size_t ggml_nbytes(const struct ggml_tensor * tensor);
libggml_base.ggml_nbytes.argtypes = [ggml_tensor_p]
libggml_base.ggml_nbytes.restype = ctypes.c_size_t

# const char * ggml_get_name(const struct ggml_tensor * tensor);
libggml_base.ggml_get_name.argtypes = [ggml_tensor_p]
libggml_base.ggml_get_name.restype = ctypes.c_char_p

# void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
libggml_base.ggml_backend_tensor_get.argtypes = [ggml_tensor_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
libggml_base.ggml_backend_tensor_get.restype = None

# ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer);
libggml_base.ggml_backend_buffer_get_type.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_buffer_get_type.restype = ctypes.c_void_p

# const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
libggml_base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_buft_name.restype = ctypes.c_char_p

# void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
libggml_base.ggml_backend_buffer_clear.argtypes = [ctypes.c_void_p, ctypes.c_uint8]
libggml_base.ggml_backend_buffer_clear.restype = None

# bool ggml_backend_buffer_is_host(ggml_backend_buffer_t buffer);
libggml_base.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_buffer_is_host.restype = ctypes.c_bool

# typedef void (*ggml_abort_callback_t)(const char * error_message);
ggml_abort_callback_t = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
# GGML_API ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback);
libggml_base.ggml_set_abort_callback.argtypes = [ggml_abort_callback_t]
libggml_base.ggml_set_abort_callback.restype = ctypes.c_void_p  # the previous callback (ggml's default: NULL)

# ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);
libggml_cpu.ggml_backend_cpu_buffer_type.argtypes = []
libggml_cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p

# ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p

# ggml_backend_buffer_type_t ggml_backend_dev_host_buffer_type(ggml_backend_dev_t device);
libggml.ggml_backend_dev_host_buffer_type.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_dev_host_buffer_type.restype = ctypes.c_void_p

# const char * ggml_backend_dev_name(ggml_backend_dev_t device);
libggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_dev_name.restype = ctypes.c_char_p



# --------------------------------------------------------------------------- ggml buffer usage
# (cache slot buffers can be marked as weights, as llama.cpp marks its own weight buffers)

# enum ggml_backend_buffer_usage
GGML_BACKEND_BUFFER_USAGE_ANY = 0
GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1
GGML_BACKEND_BUFFER_USAGE_COMPUTE = 2

# void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer, enum ggml_backend_buffer_usage usage);
libggml_base.ggml_backend_buffer_set_usage.argtypes = [ctypes.c_void_p, ctypes.c_int]
libggml_base.ggml_backend_buffer_set_usage.restype = None


# struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; };
class llama_model_tensor_buft_override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# --------------------------------------------------------------------------- ggml contexts, buffers, copies
# (what the expert cache needs to allocate slot tensors and copy experts into them)

# struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
class ggml_init_params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


# struct ggml_context * ggml_init(struct ggml_init_params params);
libggml_base.ggml_init.argtypes = [ggml_init_params]
libggml_base.ggml_init.restype = ctypes.c_void_p

# void ggml_free(struct ggml_context * ctx);
libggml_base.ggml_free.argtypes = [ctypes.c_void_p]
libggml_base.ggml_free.restype = None

# struct ggml_tensor * ggml_new_tensor_3d(struct ggml_context * ctx, enum ggml_type type,
#                                         int64_t ne0, int64_t ne1, int64_t ne2);
libggml_base.ggml_new_tensor_3d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64]
libggml_base.ggml_new_tensor_3d.restype = ggml_tensor_p

# struct ggml_tensor * ggml_view_1d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, size_t offset);
libggml_base.ggml_view_1d.argtypes = [ctypes.c_void_p, ggml_tensor_p, ctypes.c_int64, ctypes.c_size_t]
libggml_base.ggml_view_1d.restype = ggml_tensor_p

# struct ggml_tensor * ggml_view_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
#                                   size_t nb1, size_t offset);
libggml_base.ggml_view_2d.argtypes = [ctypes.c_void_p, ggml_tensor_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t,
                                      ctypes.c_size_t]
libggml_base.ggml_view_2d.restype = ggml_tensor_p

# struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name);
libggml_base.ggml_set_name.argtypes = [ggml_tensor_p, ctypes.c_char_p]
libggml_base.ggml_set_name.restype = ggml_tensor_p

# ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx,
#                                                                ggml_backend_buffer_type_t buft);
libggml_base.ggml_backend_alloc_ctx_tensors_from_buft.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
libggml_base.ggml_backend_alloc_ctx_tensors_from_buft.restype = ctypes.c_void_p

# void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
libggml_base.ggml_backend_buffer_free.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_buffer_free.restype = None

# size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);
libggml_base.ggml_backend_buffer_get_size.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_buffer_get_size.restype = ctypes.c_size_t

# void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
libggml_base.ggml_backend_tensor_set.argtypes = [ggml_tensor_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
libggml_base.ggml_backend_tensor_set.restype = None

# void ggml_backend_tensor_set_async(ggml_backend_t backend, struct ggml_tensor * tensor, const void * data,
#                                    size_t offset, size_t size);
libggml_base.ggml_backend_tensor_set_async.argtypes = [ctypes.c_void_p, ggml_tensor_p, ctypes.c_void_p,
                                                       ctypes.c_size_t, ctypes.c_size_t]
libggml_base.ggml_backend_tensor_set_async.restype = None

# void ggml_backend_tensor_set_2d(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size,
#                                 size_t n_copies, size_t stride_tensor, size_t stride_data);
libggml_base.ggml_backend_tensor_set_2d.argtypes = [ggml_tensor_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                                    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
libggml_base.ggml_backend_tensor_set_2d.restype = None

# void ggml_backend_tensor_set_2d_async(ggml_backend_t backend, struct ggml_tensor * tensor, const void * data,
#                                       size_t offset, size_t size, size_t n_copies, size_t stride_tensor,
#                                       size_t stride_data);
libggml_base.ggml_backend_tensor_set_2d_async.argtypes = [ctypes.c_void_p, ggml_tensor_p, ctypes.c_void_p,
                                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                                          ctypes.c_size_t, ctypes.c_size_t]
libggml_base.ggml_backend_tensor_set_2d_async.restype = None

# void ggml_backend_synchronize(ggml_backend_t backend);
libggml_base.ggml_backend_synchronize.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_synchronize.restype = None

# ggml_backend_event_t ggml_backend_event_new(ggml_backend_dev_t device);
libggml_base.ggml_backend_event_new.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_event_new.restype = ctypes.c_void_p

# void ggml_backend_event_free(ggml_backend_event_t event);
libggml_base.ggml_backend_event_free.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_event_free.restype = None

# void ggml_backend_event_record(ggml_backend_event_t event, ggml_backend_t backend);
libggml_base.ggml_backend_event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
libggml_base.ggml_backend_event_record.restype = None

# void ggml_backend_event_synchronize(ggml_backend_event_t event);
libggml_base.ggml_backend_event_synchronize.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_event_synchronize.restype = None


def event_query_fn() -> ctypes._CFuncPtr | None:
    """``bool ggml_backend_event_query(ggml_backend_event_t event)`` (patch 0008: a non-blocking readiness
    query), or None when the installed engine predates it."""
    fn = getattr(libggml_base, "ggml_backend_event_query", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_bool
    return fn


def split_packed_flag() -> int | None:
    """``int64_t ggml_mmid_split_packed_flag(void)`` (patch 0007): the bit this build's kernels read as a split
    expert's packed bottom, or None when the installed engine predates the function (its flag was bit 32 of
    the split word then)."""
    fn = getattr(libggml_base, "ggml_mmid_split_packed_flag", None)
    if fn is None:
        return None
    fn.argtypes = []
    fn.restype = ctypes.c_int64
    return int(fn())


# void ggml_backend_free(ggml_backend_t backend);
libggml_base.ggml_backend_free.argtypes = [ctypes.c_void_p]
libggml_base.ggml_backend_free.restype = None

# ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
libggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p

# ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
libggml.ggml_backend_dev_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
libggml.ggml_backend_dev_init.restype = ctypes.c_void_p


def check_tensor_layout() -> None:
    """The ggml_tensor mirror must match the library's size, or every read is garbage."""
    expected = libggml_base.ggml_tensor_overhead() - GGML_OBJECT_SIZE
    if ctypes.sizeof(ggml_tensor) != expected:
        raise EngineError(
            f"ggml_tensor layout mismatch: ctypes {ctypes.sizeof(ggml_tensor)} bytes, "
            f"library {expected} bytes; the installed llama-cpp-python is not the pinned version"
        )


check_tensor_layout()

__all__ = ["llama_cpp", "LIB_DIR", "libggml_base", "libggml", "libggml_cpu", "ggml_tensor", "ggml_tensor_p"]
