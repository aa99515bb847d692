"""The CLI's one error edge: domain errors become one ``error:`` line and exit 2, Ctrl-C exit 130."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from ggmoe.errors import GgmoeError


def edge(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn domain errors into ``error: ...`` and exit code 2; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GgmoeError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper
