"""Prompts files: the JSONL a trace is recorded from (``ggmoe trace --prompts``), read and checked before
the engine loads; the recording itself is ``ggmoe.engine.record``."""

from __future__ import annotations

import json
from pathlib import Path

from ggmoe.base.errors import UsageError

MAX_PROMPTS_BYTES = 1 << 30  # a prompts file above 1 GiB is surely a mistake


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file: one object per line with a ``prompt`` or ``text`` string."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompts file not found (or not a regular file): {path}")
    if path.stat().st_size > MAX_PROMPTS_BYTES:
        raise UsageError(f"{path}: larger than {MAX_PROMPTS_BYTES >> 30} GiB")
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise UsageError(f"{path}:{n}: JSON nested too deeply") from None
        except ValueError as e:  # e.g. an integer longer than Python converts
            raise UsageError(f"{path}:{n}: not valid JSON ({str(e)[:80]})") from None
        text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text:
            raise UsageError(f'{path}:{n}: expected an object with a non-empty "prompt" or "text" string')
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"{path}:{n}: the prompt holds an unpaired surrogate escape") from None
        prompts.append(text)
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts
