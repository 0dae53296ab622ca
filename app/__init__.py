"""Rebound's Faust application: ``faust -A app worker`` finds ``app.app`` here.

The app is built on first access rather than at import, so that ``import app.errors`` (in a handler, or in a unit
test) never needs a broker or valid settings. On Faust's command line, a configuration mistake found while building
it (a bad setting, a missing or unusable handler, all checked before anything connects) prints one line and exits
with status 78, a handler module raising something else than an ImportError or SyntaxError while imported one line and
status 1, and a broker that does not answer topic provisioning one line and status 75 (``app/startup.py``);
elsewhere the :class:`~rebound.errors.ConfigurationError`, :class:`~app.handlers.HandlerStartError` or
:class:`~app.provisioning.BrokerUnavailableError` is raised.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rebound.errors import ConfigurationError

if TYPE_CHECKING:
    import faust

    from agents.runtime import Runtime

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
        from app.cli import cli_app, is_faust_cli, register_commands

        light: faust.App | None = cli_app()
        if light is not None:
            return light
        from app.handlers import HandlerStartError
        from app.provisioning import BrokerUnavailableError

        try:
            runtime = get_runtime()
        except (ConfigurationError, BrokerUnavailableError, HandlerStartError) as error:
            if not is_faust_cli(sys.argv):
                raise
            from app.startup import exit_on_broker_unavailable, exit_on_configuration_error, exit_on_handler_start_error

            if isinstance(error, ConfigurationError):
                exit_on_configuration_error(error)
            if isinstance(error, HandlerStartError):
                exit_on_handler_start_error(error)
            exit_on_broker_unavailable(error)
        app: faust.App = runtime.app
        register_commands(app)
        return app
    if name == "runtime":
        return get_runtime()
    raise AttributeError(f"module 'app' has no attribute {name!r}")
