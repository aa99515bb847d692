"""The CLI's one error edge: domain errors become one ``error:`` line and exit 2, Ctrl-C exit 130."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from ggmoe.base.errors import GgmoeError


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


class EdgeGroup(click.Group):
    """The ``ggmoe`` group: click's own usage errors also end as one ``error:`` line and exit 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"error: {' '.join(e.format_message().split())}{hint}", err=True)
            sys.exit(2)
        except click.exceptions.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            click.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code if e.exit_code else 2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)
