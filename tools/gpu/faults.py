"""Why a child process of the GPU harness died, in one line: llama.cpp's abort and where Python was.

The harness runs each mode, cell and test file in its own process (a CUDA fault loses one), with
``PYTHONFAULTHANDLER=1`` (pipeline.py): on a fatal signal Python prints the stack, most recent call first.
The last lines of stderr alone ("File modes.py line 184 in <module> | Extension modules: ...") do not say
where a run died; this keeps llama.cpp's own message and the innermost ggmoe frames instead.
"""

from __future__ import annotations

import re

FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')
STRONG = ("GGML_ASSERT", "aborted the process", "CUDA error")  # llama.cpp's own word on why it stopped
WEAK = ("Error:", "error:")  # a Python exception's last line (Python's own "Fatal Python error" is not one)


def cause(stderr: str, stdout: str = "", frames: int = 3) -> str:
    """One line: the abort's message (the last line naming one) and the innermost ``frames`` ggmoe frames of
    a faulthandler stack, else the last three lines of the output."""
    lines = [ln.strip() for ln in (stderr or stdout or "").strip().splitlines() if ln.strip()]
    abort = next((ln for ln in lines if any(m in ln for m in STRONG)), None) or next(
        (ln for ln in reversed(lines) if any(m in ln for m in WEAK) and not ln.startswith("Fatal Python")), None)
    stack = []
    for ln in lines:
        m = FRAME.search(ln)
        if m and "/ggmoe/" in m["path"] and len(stack) < frames:
            stack.append(f"{m['path'].split('/ggmoe/')[-1]}:{m['line']} {m['fn']}")
    if abort is None and not stack:
        return " | ".join(lines[-3:])
    return " | ".join([*([abort] if abort else []), *(["at " + " < ".join(stack)] if stack else [])])
