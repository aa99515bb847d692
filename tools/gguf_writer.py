"""The GGUF writer of every model tools/ makes: the fixtures, the real-shape and big models, the tiny model.

gguf's ``GGUFWriter`` does the file format; this module is what the models share on top of it:

- the header: hparam keys in the order the caller lists them (``Key``: a ``GGUFWriter.add_<name>`` method and
  its value, so each model keeps its own key order and its files their bytes), then the byte-level BPE
  vocabulary (``BpeVocab``: ``tokenizer.ggml.model = gpt2``);
- ``tensor_name``: llama.cpp's tensor names (``blk.3.ffn_up_exps.weight``);
- ``write_gguf``: header and tensors to a file, atomically (in a temporary directory beside it, then renamed
  into place), split into shards on request; ``write_out`` finishes a writer a caller set up itself.

The real-shape writer (tools/gpu/realshape.py) writes the same header, then streams its tensor data itself.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QType = gguf.GGMLQuantizationType

# A header key: the name of a ``GGUFWriter.add_<name>`` method and its value, e.g. ("block_count", 4).
Key = tuple[str, object]
# A tensor to write: its name, its data, its GGUF type (None: the numpy dtype's).
Tensor = tuple[str, np.ndarray, QType | int | None]


@dataclass(frozen=True)
class BpeVocab:
    """A byte-level BPE vocabulary as GGUF stores it (``tokenizer.ggml.model = gpt2``)."""

    tokens: list[str]  # [n_vocab], byte-level unicode strings
    token_types: list[int]  # [n_vocab] gguf.TokenType values
    merges: list[str]  # "left right", in rank order
    bos_id: int
    eos_id: int
    pre: str = "default"  # tokenizer.ggml.pre: llama.cpp's pre-tokenizer
    pad_id: int | None = None  # None: no padding token written
    add_bos: bool = True

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


def tensor_name(kind: gguf.MODEL_TENSOR, il: int | None = None, suffix: str = "weight") -> str:
    """llama.cpp's name of a tensor, e.g. ``blk.3.ffn_up_exps.weight`` (``il``: the layer, None for a global)."""
    base = gguf.TENSOR_NAMES[kind]
    return f"{base.format(bid=il) if il is not None else base}.{suffix}"


def add_vocab(w: gguf.GGUFWriter, vocab: BpeVocab) -> None:
    """The tokenizer keys of ``vocab``."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(vocab.add_bos)


def add_header(w: gguf.GGUFWriter, keys: Iterable[Key], vocab: BpeVocab) -> None:
    """The hparam ``keys`` in their order, then the vocabulary."""
    for name, value in keys:
        getattr(w, f"add_{name}")(value)
    add_vocab(w, vocab)


def write_out(w: gguf.GGUFWriter, tensors: Iterable[Tensor]) -> None:
    """Add ``tensors`` to a writer whose keys are set, write the file(s) and close them."""
    for name, data, raw_dtype in tensors:
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: Path, arch: str, keys: Iterable[Key], vocab: BpeVocab, tensors: Iterable[Tensor],
               split_max_tensors: int = 0) -> Path:
    """Write a model to ``path`` and return it (the first shard's path when split).

    ``tensors`` is consumed in order, after the header (a seeded generator draws the same values each time).
    With ``split_max_tensors`` > 0 the model is split into shards of at most that many tensors, named like
    llama.cpp's splits: ``<stem>-00001-of-0000N.gguf``. The files are written in a temporary directory and
    renamed into place, so concurrent test workers never see half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp_dir:
        w = gguf.GGUFWriter(Path(tmp_dir) / path.name, arch=arch, split_max_tensors=split_max_tensors)
        add_header(w, keys, vocab)
        write_out(w, tensors)
        written = sorted(Path(tmp_dir).iterdir())
        for f in written:
            os.replace(f, path.parent / f.name)
    return path.parent / written[0].name
