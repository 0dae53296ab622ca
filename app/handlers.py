"""Load the user's handler from ``REBOUND_HANDLER`` (``package.module:callable``)."""

from __future__ import annotations

import importlib
import inspect

from rebound.errors import ConfigurationError
from rebound.event import Handler


def load_handler(spec: str) -> Handler:
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"REBOUND_HANDLER={spec}: cannot import {module_name!r}: {exc}") from exc
    handler = getattr(module, attribute, None)
    if handler is None or not callable(handler):
        raise ConfigurationError(f"REBOUND_HANDLER={spec}: {module_name!r} has no callable {attribute!r}")
    call = type(handler).__call__ if not inspect.isfunction(handler) else handler
    if not (inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)):
        raise ConfigurationError(f"REBOUND_HANDLER={spec}: the handler must be an async function taking one event")
    return handler  # type: ignore[no-any-return]
