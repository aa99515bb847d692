"""The disk tier's reader on a file of known bytes: exact reads at unaligned offsets, and each fault (an I/O
error, a short read, a file changed or removed) one ``DiskTierError`` that names it."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from ggmoe.base.errors import DiskTierError
from ggmoe.engine import disk as disk_mod
from ggmoe.engine.disk import ExpertExtent, FileDiskReader

pytestmark = pytest.mark.engine

NB2 = 5000  # bytes of one expert: not a multiple of the 4096-byte alignment
OFFSET = 777  # expert 0's data in the file: unaligned too
N_EXPERT = 6


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "experts.bin"
    data = np.random.default_rng(0).integers(0, 256, OFFSET + N_EXPERT * NB2 + 123, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    host = np.zeros(2 * NB2, dtype=np.uint8)  # two host slots of one kind
    ext = ExpertExtent(str(path), OFFSET, NB2, host.ctypes.data, "down")
    reader = FileDiskReader({0: [ext]}, threads=2)
    yield path, data, host, reader
    reader.close()


@pytest.mark.parametrize("expert, slot", [(0, 0), (5, 1), (3, 0)])
def test_an_expert_lands_byte_for_byte_in_its_slot(model, expert, slot):
    path, data, host, reader = model
    reader.wait(reader.submit(0, expert, slot))
    want = data[OFFSET + expert * NB2: OFFSET + (expert + 1) * NB2]
    assert np.array_equal(host[slot * NB2:(slot + 1) * NB2], want)
    assert reader.bytes_read >= NB2  # whole aligned pages around the expert


def test_an_io_error_is_one_clear_error(model, monkeypatch):
    path, data, host, reader = model

    def failing(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_mod.os, "preadv", failing)
    with pytest.raises(DiskTierError, match="reading expert 2 .* failed: Input/output error"):
        reader.wait(reader.submit(0, 2, 0))


def test_a_short_read_is_one_clear_error(model, monkeypatch):
    path, data, host, reader = model
    monkeypatch.setattr(disk_mod._File, "check", lambda self: None)  # the size check would catch it first
    os.truncate(path, OFFSET + 2 * NB2)
    with pytest.raises(DiskTierError, match="short read of expert 4"):
        reader.wait(reader.submit(0, 4, 0))


@pytest.mark.parametrize("fault", ["truncate", "touch", "replace", "remove"])
def test_a_changed_file_is_refused(model, fault):
    path, data, host, reader = model
    if fault == "truncate":
        os.truncate(path, OFFSET)
    elif fault == "touch":
        os.utime(path, ns=(1, 1))
    elif fault == "replace":
        other = path.with_suffix(".new")
        other.write_bytes(data.tobytes())
        os.replace(other, path)
    else:
        path.unlink()
    with pytest.raises(DiskTierError, match="model file"):
        reader.check()
    with pytest.raises(DiskTierError, match="model file"):
        reader.wait(reader.submit(0, 1, 0))
