"""The mailbox's reader behind the device (issue 41, item 5): a layer read after the layer it predicts has started
issues no prefetch, since the copy would land after the read it was for. On a loaded 2-core machine the reader
fell that far behind for 7 of 8 layers; its late prefetches held free slots that LRU would have kept, and the
async decode with a trained mlp hit 5.7 points under async LRU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from test_stride_cache import Fixed, _cache

from ggmoe.control.prefetch import Prefetcher
from ggmoe.engine.stride import StrideReader
from ggmoe.predict import ModelShape


class FakeMailbox:
    """Every layer has written its ids for one token (the decode ran ahead of the reader)."""

    def __init__(self, started: set[int]) -> None:
        self.started = started
        self.lockstep = False

    def written(self, il: int) -> tuple[int, bool]:
        return (1 if il in self.started else 0), False

    def read(self, il: int, n: int, with_hidden: bool) -> tuple[np.ndarray, None]:
        return np.array([[4 + il, 5 + il]], dtype=np.int32), None

    def clear(self) -> None:
        pass

    def hold(self) -> None:
        pass

    def acknowledge(self, il: int) -> None:
        pass

    def release_all(self) -> None:
        pass


def _reader(started: set[int], done: bool) -> tuple[StrideReader, object]:
    cache, _ = _cache(n_slots=8)
    pf = Prefetcher(cache, Fixed(ModelShape("x", (0, 1), 16, 2, 4), 1), [0, 1], n_prefetch=4)
    pf.free_only = pf.via_mailbox = True
    pf._decoding = True
    reader = StrideReader(FakeMailbox(started), pf, cache, [0, 1])
    reader._decode_done = done
    return reader, cache


def test_a_layer_read_after_its_target_started_prefetches_nothing():
    reader, cache = _reader({0, 1}, done=False)  # layer 1, which layer 0 predicts, has started already
    reader._read_token()
    reader.close()
    assert reader.layers_behind == 1 and cache.stats.total().prefetch_issued == 0
    assert reader.layers_targeted == 1  # layer 1 predicts none (the last): not counted


def test_a_layer_read_before_its_target_started_prefetches():
    reader, cache = _reader({0}, done=False)
    reader.layers = (0,)  # layer 1 has not written: read layer 0 only, as the running decode would let it
    reader._read_token()
    reader.close()
    assert reader.layers_behind == 0 and cache.stats.total().prefetch_issued > 0


def test_after_the_decode_ended_nothing_is_prefetched():
    reader, cache = _reader({0, 1}, done=True)
    reader._read_token()
    reader.close()
    assert cache.stats.total().prefetch_issued == 0


class _Eng:
    """What the run's summary line reads of an engine: its report's prefetch entry."""

    def __init__(self, prefetch: dict | None) -> None:
        self._prefetch = prefetch

    def report(self) -> dict:
        return {"prefetch": self._prefetch} if self._prefetch is not None else {}


def _line(runs_on: str, behind: int, targeted: int) -> str:
    from ggmoe.cli.options import reader_behind_line

    return reader_behind_line(_Eng({"runs_on": runs_on, "layers_behind": behind, "layers_targeted": targeted}))


def test_a_run_says_when_its_reader_fell_behind():
    """``ggmoe run``'s summary names a mailbox reader that read a quarter or more of its layers too late."""
    line = _line("mailbox", 60, 100)
    assert line.startswith("\npredictor: read 60 of 100 layers only after") and "--decode-mode sync" in line
    assert _line("mailbox", 24, 100) == ""  # under a quarter: nothing to say
    assert _line("route op", 60, 100) == ""  # the sync decode's predictor has no reader
    assert _line("mailbox", 0, 0) == ""
    from ggmoe.cli.options import reader_behind_line

    assert reader_behind_line(_Eng(None)) == ""  # no predictor


READER_NOTES = [  # (prefetch report, said?)
    (None, False),
    ({"runs_on": "route op", "layers_targeted": 8, "layers_behind": 8}, False),  # the sync decode reads in step
    ({"runs_on": "mailbox", "layers_targeted": 0, "layers_behind": 0}, False),  # never read
    ({"runs_on": "mailbox", "layers_targeted": 100, "layers_behind": 24}, False),
    ({"runs_on": "mailbox", "layers_targeted": 100, "layers_behind": 25}, True),
    ({"runs_on": "mailbox", "layers_targeted": 100, "layers_behind": 100}, True),
]


@pytest.mark.parametrize("report, said", READER_NOTES)
def test_a_reader_a_quarter_behind_is_said(report, said):
    from ggmoe.control.prefetch import reader_behind_note

    note = reader_behind_note(report)
    assert (note is not None) is said
    if said:
        assert f"read {report['layers_behind']} of {report['layers_targeted']} layers" in note


class _Llama:
    """What ``Server.note_reader`` reads of the model: its run configuration and its statistics."""

    def __init__(self, behind: int, targeted: int) -> None:
        self.run_config = SimpleNamespace(prefetch=object())
        self.behind, self.targeted = behind, targeted

    def stats(self) -> dict:
        return {"cache": {"prefetch": {"runs_on": "mailbox", "layers_targeted": self.targeted,
                                       "layers_behind": self.behind}}}


def test_serve_logs_a_lagging_reader_once(caplog):
    from ggmoe.serve.app import Server

    server = Server.__new__(Server)  # its state but the model: only note_reader runs
    server.llama, server._reader_noted = _Llama(behind=30, targeted=40), False
    with caplog.at_level(logging.WARNING, logger="ggmoe.serve"):
        server.note_reader()  # 30 of 40: too few layers read to judge yet
        server.llama.behind, server.llama.targeted = 20, 400
        server.note_reader()  # 20 of 400: keeping pace
        server.llama.behind = 300
        server.note_reader()
        server.note_reader()
    said = [r.getMessage() for r in caplog.records if "predictor: read" in r.getMessage()]
    assert said == ["predictor: read 300 of 400 layers only after the layer it predicts had started, so those "
                    "prefetched nothing (the decode ran ahead of the mailbox's reader: no core was free for it; "
                    "--decode-mode sync runs the predictor in the route op instead)"]
