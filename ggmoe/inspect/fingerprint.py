"""Model fingerprint: ties traces and predictor files to the exact GGUF they came from."""

from __future__ import annotations

import hashlib
from pathlib import Path

_HEAD = 4 << 20  # bytes hashed from the start: the whole header of any small or large model
_TAIL = 1 << 20  # bytes hashed from the end: the last tensors' data


def model_fingerprint(path: str | Path) -> str:
    """16 hex digits of sha256 over (size, first 4 MiB, last 1 MiB): fast on 100 GB files.

    The header carries the hyperparameters and every tensor's name, type and shape,
    and the sampled data tells apart two checkpoints of one shape; a different
    quantization of the same model is a different fingerprint on purpose.
    """
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with p.open("rb") as f:
        h.update(f.read(_HEAD))
        if size > _HEAD:
            f.seek(max(_HEAD, size - _TAIL))
            h.update(f.read(_TAIL))
    return h.hexdigest()[:16]
