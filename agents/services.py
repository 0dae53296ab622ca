"""A worker's long-running parts as ``mode`` services, started and stopped with the Faust app.

Faust starts the services registered with ``app.service`` once the app has started, and stops them with it; a
service's ``Service.task`` ends when it stops, and ``Service.sleep`` returns early then. That replaces tasks kept
alive by hand (``app.task`` with a ``while True`` loop and its own restart logic).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import faust
from mode import Service


class Restarting(Service):
    """Runs ``body`` for as long as the worker runs. A failure is reported to ``on_failure`` and the body runs again
    ``restart_after_s`` later (a reader whose broker went away, say); the body returning ends the service's work."""

    def __init__(
        self,
        name: str,
        body: Callable[[], Awaitable[None]],
        on_failure: Callable[[Exception], None],
        *,
        restart_after_s: float = 1.0,
        **kwargs: Any,
    ) -> None:
        self._name = name
        self._body = body
        self._on_failure = on_failure
        self._restart_after_s = restart_after_s
        self.failures = 0
        super().__init__(**kwargs)

    @property
    def label(self) -> str:
        return self._name  # mode prefixes its log lines with it: "[^--release timer]: Starting..."

    @Service.task
    async def _run(self) -> None:
        while not self.should_stop:
            try:
                await self._body()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                self._on_failure(exc)
                await self.sleep(self._restart_after_s)


class Closing(Service):
    """Owns a resource that must be closed when the worker stops (the failed-topic reader's consumers)."""

    def __init__(self, name: str, close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        self._name = name
        self._close = close
        super().__init__(**kwargs)

    @property
    def label(self) -> str:
        return self._name  # (not "Closing: ...", which read like a close at start-up)

    async def on_stop(self) -> None:
        await self._close()


def start_with(app: faust.App, service: Service) -> Service:
    """Register ``service`` to start once ``app`` has started, and stop with it."""
    app.service(cast(Any, service))
    return service
