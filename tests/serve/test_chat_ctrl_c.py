"""``CtrlC``, the chat's one SIGINT handler: a Ctrl-C at each moment of a turn, forced by sending the signal
from inside that moment (no timing)."""

from __future__ import annotations

import os
import signal

import pytest

from ggmoe.serve.chat import CtrlC


@pytest.fixture()
def ctrl_c():
    handler = CtrlC()
    previous = signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, previous)


def interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this thread before kill returns to Python


def test_ctrl_c_while_reading_is_a_fresh_prompt(ctrl_c):
    def read(prompt: str) -> str:
        interrupt()
        return "never returned"

    with pytest.raises(KeyboardInterrupt):
        ctrl_c.read(read, "> ")
    assert not ctrl_c.stop.is_set() and not ctrl_c.reading


def test_ctrl_c_after_enter_stops_the_coming_answer(ctrl_c):
    line = ctrl_c.read(lambda prompt: "Tell me a story", "> ")
    interrupt()  # after Enter, before the answer's first token: no exception, the answer is stopped
    assert line == "Tell me a story" and ctrl_c.stop.is_set()


def test_a_new_line_starts_unstopped(ctrl_c):
    ctrl_c.read(lambda prompt: "first", "> ")
    interrupt()
    assert ctrl_c.stop.is_set()
    ctrl_c.read(lambda prompt: "second", "> ")
    assert not ctrl_c.stop.is_set()
