"""llama.cpp's log, through one place: a ring buffer for error messages, stderr only when verbose.

The first use initializes llama.cpp's backends (``llama_backend_init``) and
installs the log callback, once per process. It also installs ggml's abort
callback: a fatal error (a CUDA error, a failed GGML_ASSERT) logs its cause
at error level and then aborts the process, so the ring would die with the
one line that says why; the callback writes the recent error lines and the
abort's message to stderr first.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections import deque

from ggmoe.engine.ggml import ggml_abort_callback_t, libggml_base, llama_cpp

# enum ggml_log_level (ggml.h)
GGML_LOG_LEVEL_WARN = 3
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5  # continues the previous message at its level


class LlamaLog:
    """Receives every llama.cpp log line; keeps the recent ones and echoes them when ``verbose``."""

    def __init__(self) -> None:
        self.verbose = False
        # recent (level, line) pairs, for error messages and tests; CONT lines carry their message's level
        self.lines: deque[tuple[int, str]] = deque(maxlen=4096)
        self.count = 0  # lines seen in all
        self._level = 0  # level of the last message, for CONT lines
        self._cb = llama_cpp.llama_log_callback(self._on_log)  # kept alive as long as the process
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))
        self._abort_cb = ggml_abort_callback_t(self._on_abort)  # kept alive as long as the process
        libggml_base.ggml_set_abort_callback(self._abort_cb)

    def _on_log(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        s = text.decode("utf-8", errors="replace")
        if level != GGML_LOG_LEVEL_CONT:
            self._level = level
        self.lines.append((self._level, s))
        self.count += 1
        if self.verbose:
            print(s, end="", file=sys.stderr, flush=True)

    def abort_report(self, message: str) -> str:
        """What a fatal abort prints: the last error lines (already on stderr when verbose) and the message."""
        errs = [] if self.verbose else [s.rstrip() for lv, s in list(self.lines)[-64:]
                                         if lv == GGML_LOG_LEVEL_ERROR and s.strip()][-8:]
        return "".join(f"llama.cpp: {e}\n" for e in errs) + f"llama.cpp aborted the process: {message}\n"

    def _on_abort(self, message: bytes) -> None:
        # called by ggml_abort just before abort(): os.write, since nothing buffered in Python gets flushed
        report = self.abort_report((message or b"").decode("utf-8", errors="replace"))
        os.write(2, report.encode("utf-8", errors="replace"))

    def since(self, mark: int) -> list[tuple[int, str]]:
        """(level, line) pairs logged after ``count`` was ``mark`` (as many as the ring still holds)."""
        n = min(self.count - mark, len(self.lines))
        return list(self.lines)[len(self.lines) - n:] if n > 0 else []

    def error_since(self, mark: int = 0) -> str:
        """The root cause of a failure logged since ``mark``: its first error line ("" if none).

        llama.cpp logs the inner error first ("error loading model: ... tensor 'x' not found") and then
        each caller's generic report ("failed to load model"), so the first one says why.
        """
        lines = self.since(mark)
        errs = [s.strip() for lv, s in lines if lv == GGML_LOG_LEVEL_ERROR and s.strip()]
        if not errs:  # a failure reported as a warning only
            errs = [s.strip() for lv, s in lines if lv == GGML_LOG_LEVEL_WARN
                    and ("error" in s.lower() or "failed" in s.lower())]
        return errs[0] if errs else ""


_log: LlamaLog | None = None


def llama_log() -> LlamaLog:
    """The process's log receiver; the first call also initializes llama.cpp's backends."""
    global _log
    if _log is None:
        _log = LlamaLog()
        llama_cpp.llama_backend_init()
    return _log
