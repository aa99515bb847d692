"""Option groups: click options whose values reach the command as one typed record, not as flat parameters."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def option_group(record: type, name: str, *options: Decorator) -> Decorator:
    """A decorator that adds ``options`` (click option decorators, applied in order) to a command and hands it
    their values as ``name=record(...)``: the options' parameter names are the record's fields (a field without
    an option keeps its default)."""
    fields = tuple(f.name for f in dataclasses.fields(record))

    def group(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            values = {k: kwargs.pop(k) for k in fields if k in kwargs}
            return fn(*args, **kwargs, **{name: record(**values)})

        for option in options:
            command = option(command)
        return command

    return group
