"""Quantize a GGUF to another type with llama.cpp's own quantizer (``llama_model_quantize``).

For comparing quantization levels of one model (``ggmoe quantize``, then ``ggmoe compare-quants``) on a
machine that has llama-cpp-python but no ``llama-quantize`` binary. Requantizing an already quantized
model is allowed (llama.cpp dequantizes first; quality is that of the source at best). Rows that a
K-quant cannot hold (not a multiple of 256 elements) get llama.cpp's own fallback type. The output is
written to a temporary file and renamed only when llama.cpp succeeded.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

from ggmoe.base.errors import EngineError, UsageError
from ggmoe.engine import ggml as B
from ggmoe.engine.log import llama_log

llama_cpp = B.llama_cpp

# the type names llama-quantize takes -> llama_ftype
TYPES = {name.removeprefix("LLAMA_FTYPE_MOSTLY_"): getattr(llama_cpp, name) for name in dir(llama_cpp)
         if name.startswith("LLAMA_FTYPE_MOSTLY_")}
TYPES["F32"] = llama_cpp.LLAMA_FTYPE_ALL_F32


def quantize(src: Path, dst: Path, type_name: str, n_threads: int = 0) -> Path:
    """Write ``src`` quantized to ``type_name`` (e.g. Q4_K_M, Q8_0, F16) as ``dst``."""
    key = type_name.upper()
    if key not in TYPES:
        raise UsageError(f"unknown quantization type {type_name!r}; choose one of {', '.join(sorted(TYPES))}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = n_threads
    params.ftype = TYPES[key]
    params.allow_requantize = True
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    log = llama_log()
    mark = log.count
    try:
        # uint32_t llama_model_quantize(const char * fname_inp, const char * fname_out,
        #                               const llama_model_quantize_params * params);
        rc = llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params))
        if rc != 0:
            raise EngineError(f"llama.cpp could not quantize {src} to {key}: "
                              f"{log.error_since(mark) or f'error {rc}'}")
        os.replace(tmp, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dst
