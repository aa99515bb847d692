"""uvicorn around the app: on SIGTERM or Ctrl-C the generations are stopped first, so the server exits at once
and every stream in flight still ends with its route's final events.

uvicorn's own shutdown stops listening, closes idle connections and waits for the requests in flight; the
app's ``Server.stop_generations``, run from uvicorn's signal handler, makes those requests end at their next
token. sse-starlette's own reaction to the signal (cutting every stream off where it is, without its last
events) is turned off: the streams end themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

GRACE_S = 2  # seconds uvicorn waits for a request told to stop (one token step) before it cancels it


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the app to stop its generations when a signal asks it to exit."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def run_app(app: FastAPI, host: str, port: int, log_level: str) -> None:
    """Serve ``app`` (``ggmoe.serve.app.create_app``'s) until a signal stops it."""
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()  # the streams end themselves, final events included
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S)
    _Uvicorn(config, app.state.server.stop_generations).run()
