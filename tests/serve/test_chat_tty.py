"""``ggmoe chat`` driven through a pseudo-terminal: answers stream, /stats, /reset, Ctrl-C stops an answer."""

from __future__ import annotations

import sys

import pexpect
import pytest

PROMPT = "> "


@pytest.fixture()
def chat(tmp_path):
    stats = tmp_path / "stats.json"
    child = pexpect.spawn(sys.executable, ["-m", "ggmoe", "chat", "--cache-slots", "8", "--n-ctx", "2048",
                                           "-n", "1500", "--temp", "0.8", "--seed", "3", "--stats-json", str(stats)],
                          encoding="utf-8", timeout=60, dimensions=(40, 200))
    child.expect("ggmoe chat")
    child.expect_exact(PROMPT)
    yield child, stats
    if child.isalive():
        child.terminate(force=True)


def test_chat_session(chat):
    child, stats = chat
    child.sendline("/help")
    child.expect("/reset")
    child.expect_exact(PROMPT)
    # a long answer, stopped by Ctrl-C: the chat goes on
    child.sendline("Tell me a long story")
    child.expect_exact("Tell me a long story\r\n")  # readline took the line (its echo ends at Enter)
    child.expect(r"\S")  # the answer starts streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect('"hit_rate"')
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.expect_exact(PROMPT)
    child.sendintr()  # Ctrl-C at the prompt: a fresh prompt, not an exit
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert stats.is_file() and '"layers"' in stats.read_text()


def test_chat_ends_on_ctrl_d(chat):
    child, _ = chat
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
