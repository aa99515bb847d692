"""``ggmoe chat``: an interactive terminal chat over ``GgmoeLlama.create_chat_completion``.

Answers stream as they are generated, formatted by the model's chat template.
One SIGINT handler (``CtrlC``) serves the whole chat: at the prompt Ctrl-C gives
a fresh prompt; from the moment a line is read until its answer ends it stops
that answer at the next token (it sets the generation's cancel flag: no
exception unwinds through llama.cpp), and the chat goes on. Ctrl-D or /quit
leaves. /reset forgets the conversation, /stats prints the cache statistics.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ggmoe.base.context import check_prompt
from ggmoe.engine.llama import GgmoeLlama
from ggmoe.serve.generation import Watch

HELP = "commands: /reset (forget the conversation), /stats (cache statistics), /help, /quit (or Ctrl-D)"


@dataclass(frozen=True)
class ChatOptions:
    max_tokens: int = 256  # tokens per answer
    temperature: float = 0.7
    seed: int | None = None  # None: a new seed per answer
    system: str | None = None  # the system message opening every conversation


class Chat:
    """The conversation and one model; ``answer`` streams a reply through ``write``."""

    def __init__(self, llama: GgmoeLlama, options: ChatOptions, write: Callable[[str], None]) -> None:
        self.llama = llama
        self.options = options
        self.write = write
        self.messages: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.options.system}] if self.options.system else []

    def answer(self, text: str, stop: threading.Event) -> bool:
        """Stream the reply to ``text`` until it ends or ``stop`` is set (Ctrl-C: the partial reply is kept);
        False when it was stopped."""
        watch = Watch(time.monotonic(), self.llama.n_ctx(), None, self.llama.is_eog)
        watch.cancel = stop  # set by Ctrl-C, even before the generation began: it then stops at once
        self.llama.watch = watch
        parts: list[str] = []
        try:
            self.messages.append({"role": "user", "content": text})
            try:
                self.check_fits()
            except BaseException:
                self.messages.pop()  # a question that does not fit is not kept: /reset or a shorter one
                raise
            chunks = self.llama.create_chat_completion(
                messages=self.messages, stream=True, max_tokens=self.options.max_tokens,
                temperature=self.options.temperature, seed=self.options.seed)
            for chunk in chunks:
                piece = chunk["choices"][0]["delta"].get("content") or ""
                if piece:
                    parts.append(piece)
                    self.write(piece)
        finally:
            self.llama.watch = None
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        return not watch.cancel.is_set()

    def check_fits(self) -> None:
        """The conversation, rendered and tokenized as ``create_chat_completion`` will, fits the context
        (``ggmoe.base.context``'s rule: a ``ContextLengthError``), checked before llama-cpp-python's own check."""
        result = self.llama.chat_formatter()(messages=self.messages)
        tokens = self.llama.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
        check_prompt(len(tokens), self.llama.n_ctx(), "the conversation", hint="raise --n-ctx, or /reset before "
                     "it fills")

    def command(self, line: str) -> bool:
        """Run a /command; False for /quit."""
        cmd = line.strip().lower()
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
            self.reset()
            self.write("(conversation cleared)\n")
        elif cmd == "/stats":
            self.write(json.dumps(self.llama.stats(), indent=2) + "\n")
        else:
            self.write(HELP + "\n")
        return True


class CtrlC:
    """The chat's one SIGINT handler, installed for its whole life: while the prompt reads a line Ctrl-C
    raises ``KeyboardInterrupt`` (a fresh prompt, as in a shell); at any other moment it sets ``stop``, so a
    Ctrl-C between the line's Enter and the answer's first token stops that answer too, never the chat."""

    def __init__(self) -> None:
        self.reading = False
        self.stop = threading.Event()

    def __call__(self, signum: int, frame: Any) -> None:
        if self.reading:
            raise KeyboardInterrupt
        self.stop.set()

    def read(self, read: Callable[[str], str], prompt: str) -> str:
        """One line from ``read``; a new line starts with ``stop`` clear."""
        self.stop.clear()
        self.reading = True
        try:
            return read(prompt)
        finally:
            self.reading = False


def run_chat(llama: GgmoeLlama, options: ChatOptions, read: Callable[[str], str],
             write: Callable[[str], None]) -> None:
    """The read-answer loop until /quit or end of input."""
    ctrl_c = CtrlC()
    previous = signal.signal(signal.SIGINT, ctrl_c)
    try:
        _loop(Chat(llama, options, write), ctrl_c, read, write)
    finally:
        signal.signal(signal.SIGINT, previous)


def _loop(chat: Chat, ctrl_c: CtrlC, read: Callable[[str], str], write: Callable[[str], None]) -> None:
    write(f"ggmoe chat ({HELP})\n")
    while True:
        try:
            line = ctrl_c.read(read, "> ")
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as in a shell
            write("\n")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not chat.command(line):
                return
            continue
        finished = chat.answer(line, ctrl_c.stop)
        write("\n" if finished else " [stopped]\n")
