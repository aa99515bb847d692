"""llama.cpp's log, through one place: a ring buffer for error messages, stderr only when verbose.

The first use initializes llama.cpp's backends (``llama_backend_init``) and
installs the log callback, once per process.
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque

from ggmoe.engine.ggml import llama_cpp


class LlamaLog:
    """Receives every llama.cpp log line; keeps the recent ones and echoes them when ``verbose``."""

    def __init__(self) -> None:
        self.verbose = False
        self.lines: deque[str] = deque(maxlen=4096)  # recent lines: error messages, tests
        self.count = 0  # lines seen in all
        self._cb = llama_cpp.llama_log_callback(self._on_log)  # kept alive as long as the process
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        s = text.decode("utf-8", errors="replace")
        self.lines.append(s)
        self.count += 1
        if self.verbose:
            print(s, end="", file=sys.stderr, flush=True)

    def since(self, mark: int) -> list[str]:
        """Lines logged after ``count`` was ``mark`` (as many as the ring still holds)."""
        n = min(self.count - mark, len(self.lines))
        return list(self.lines)[len(self.lines) - n:] if n > 0 else []

    def last_error(self, mark: int = 0) -> str:
        """The last line since ``mark`` that reports an error or a failure ("" if none)."""
        errs = [ln.strip() for ln in self.since(mark) if "error" in ln.lower() or "failed" in ln.lower()]
        return errs[-1] if errs else ""


_log: LlamaLog | None = None


def llama_log() -> LlamaLog:
    """The process's log receiver; the first call also initializes llama.cpp's backends."""
    global _log
    if _log is None:
        _log = LlamaLog()
        llama_cpp.llama_backend_init()
    return _log
