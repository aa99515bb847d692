"""The copy stream's table flips (``GgmlCopyBackend._flip_all``): an expert's kinds' entries, one table apart in the
one tables tensor, go in one strided write after its copy (a GPU's copy stream takes each write as an API call
of its own); entries that are not one strided run go one by one. The ggml calls are recorded, not made."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from ggmoe.engine import copies
from ggmoe.engine.copies import GgmlCopyBackend

pytestmark = pytest.mark.engine

TABLES = 0x10000  # a tensor address: only cast to a pointer, never read


@pytest.fixture
def calls(monkeypatch):
    """Every ggml write the flips make, as (name, offset, values, n, stride)."""
    out = []

    def rec(name):
        def f(*a):
            a = a[1:] if name.endswith("async") else a  # the stream handle
            data, offset = a[1], a[2]
            n, stride = (a[4], a[5]) if "2d" in name else (1, 8)
            values = list((ctypes.c_int64 * n).from_address(data))
            out.append((name, offset, values, n, stride))
        return f

    names = ("ggml_backend_tensor_set", "ggml_backend_tensor_set_async", "ggml_backend_tensor_set_2d",
             "ggml_backend_tensor_set_2d_async")
    monkeypatch.setattr(copies.B, "libggml_base", SimpleNamespace(**{n: rec(n) for n in names}))
    return out


@pytest.mark.parametrize("stream", [None, 7], ids=["at once", "on a stream"])
def test_an_experts_entries_go_in_one_strided_write(calls, stream):
    n_expert = 32
    entries = [(TABLES, (k * n_expert + 5) * 8, 1000 + k) for k in range(3)]  # expert 5, kinds 0..2
    GgmlCopyBackend._flip_all(entries, stream)
    want = "ggml_backend_tensor_set_2d" + ("_async" if stream else "")
    assert calls == [(want, 5 * 8, [1000, 1001, 1002], 3, n_expert * 8)]


@pytest.mark.parametrize("entries, n_calls", [
    ([], 0),
    ([(TABLES, 40, 1)], 1),  # one entry: a plain write
    ([(TABLES, 40, 1), (TABLES, 296, 2), (TABLES, 600, 3)], 3),  # not evenly spaced
    ([(TABLES, 40, 1), (TABLES + 8, 296, 2)], 2),  # two tensors
    ([(TABLES, 296, 1), (TABLES, 40, 2)], 2),  # descending
])
def test_entries_not_one_strided_run_go_one_by_one(calls, entries, n_calls):
    GgmlCopyBackend._flip_all(entries, None)
    assert len(calls) == n_calls and all(c[0] == "ggml_backend_tensor_set" for c in calls)
    assert sorted((c[1], c[2][0]) for c in calls) == sorted((off, v) for _, off, v in entries)
