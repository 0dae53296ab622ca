"""Rebound's Faust application: ``faust -A app worker`` finds ``app.app`` here.

The app is built on first access rather than at import, so that ``import app.errors`` (in a handler, or in a unit
test) never needs a broker or valid settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import faust

    from app.runtime import Runtime

_runtime: Runtime | None = None


def get_runtime() -> Runtime:
    global _runtime  # noqa: PLW0603 - one application per worker process
    if _runtime is None:
        from app.factory import build

        _runtime = build()
    return _runtime


def __getattr__(name: str) -> Any:
    if name == "app":
        # ``faust -A app <command>`` for Rebound's operator commands gets a bare app: no broker, no second worker.
        from app.cli import cli_app, register_commands

        light: faust.App | None = cli_app()
        if light is not None:
            return light
        app: faust.App = get_runtime().app
        register_commands(app)
        return app
    if name == "runtime":
        return get_runtime()
    raise AttributeError(f"module 'app' has no attribute {name!r}")
