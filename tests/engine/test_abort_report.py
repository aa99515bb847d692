"""A fatal ggml error says why on stderr, also when llama.cpp's log goes to ggmoe's ring (not verbose)."""

from __future__ import annotations

import signal
import subprocess
import sys

# In a child: an error line logged the way ggml-cuda logs a CUDA error before aborting, then a real
# GGML_ASSERT (reading a tensor that has no buffer), which calls ggml_abort.
CHILD = """
import ctypes
from ggmoe.engine import ggml as G
from ggmoe.engine.log import llama_log, GGML_LOG_LEVEL_ERROR
log = llama_log()
log._on_log(GGML_LOG_LEVEL_ERROR, b"CUDA error: an illegal memory access was encountered\\n", None)
ctx = G.libggml_base.ggml_init(G.ggml_init_params(G.libggml_base.ggml_tensor_overhead() * 4, None, True))
t = G.libggml_base.ggml_new_tensor_3d(ctx, 0, 4, 1, 1)  # F32, no_alloc: no buffer
buf = (ctypes.c_char * 16)()
G.libggml_base.ggml_backend_tensor_get(t, buf, 0, 16)
print("not reached")
"""


def test_abort_prints_the_cause_and_the_assert():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGABRT, r
    assert "not reached" not in r.stdout
    lines = r.stderr.splitlines()
    assert "llama.cpp: CUDA error: an illegal memory access was encountered" in lines
    aborted = [s for s in lines if s.startswith("llama.cpp aborted the process: ")]
    assert len(aborted) == 1 and "tensor buffer not set" in aborted[0], r.stderr
