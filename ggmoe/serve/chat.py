"""``ggmoe chat``: an interactive terminal chat over ``GgmoeLlama.create_chat_completion``.

Answers stream as they are generated, formatted by the model's chat template.
Ctrl-C while an answer streams stops that answer at the next token (a SIGINT
handler sets the generation's cancel flag: no exception unwinds through
llama.cpp) and the chat goes on; Ctrl-D or /quit leaves. /reset forgets the
conversation, /stats prints the cache statistics.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ggmoe.context import check_prompt
from ggmoe.serve.generation import Watch
from ggmoe.serve.llama import GgmoeLlama

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

    def answer(self, text: str) -> bool:
        """Stream the reply to ``text``; False when Ctrl-C stopped it (the partial reply is kept)."""
        self.messages.append({"role": "user", "content": text})
        self.check_fits()
        watch = Watch(time.monotonic(), self.llama.n_ctx(), None, self.llama.is_eog)
        previous = signal.signal(signal.SIGINT, lambda signum, frame: watch.cancel.set())
        self.llama.watch = watch
        parts: list[str] = []
        try:
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
            signal.signal(signal.SIGINT, previous)
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        return not watch.cancel.is_set()

    def check_fits(self) -> None:
        """The conversation, rendered and tokenized as ``create_chat_completion`` will, fits the context
        (``ggmoe.context``'s rule: a ``ContextLengthError``), checked before llama-cpp-python's own check."""
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


def run_chat(llama: GgmoeLlama, options: ChatOptions, read: Callable[[str], str],
             write: Callable[[str], None]) -> None:
    """The read-answer loop until /quit or end of input."""
    chat = Chat(llama, options, write)
    write(f"ggmoe chat ({HELP})\n")
    while True:
        try:
            line = read("> ")
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
        finished = chat.answer(line)
        write("\n" if finished else " [stopped]\n")
