"""Load the user's handler from ``REBOUND_HANDLER`` (``package.module:callable``, or an http(s):// URL).

Called by :func:`app.factory.build` before anything connects to the broker. A setting that names no usable handler (not
of the form, a module that cannot be found, no such attribute, not an async function taking one event) stops the
worker with a :class:`ConfigurationError` naming the variable (printed as one line, without a traceback, exit status 78,
by ``app/startup.py``). A module that is found but fails while it is imported (its own ``ImportError`` or
``ModuleNotFoundError`` of a dependency, a ``SyntaxError``, any exception its code raises) is a
:class:`HandlerImportError`, a ConfigurationError too: one line naming the spec, the exception's class and message and
the file and line it was raised at in the handler's module, exit 78; the original exception is its ``__cause__``, whose
traceback the worker prints before that line at log level debug (``-l debug``).

The module is looked for where the worker's Python imports from (installed packages, ``PYTHONPATH``) and then in the
working directory: ``faust -A app worker`` (the console script) puts the working directory on ``sys.path`` only while
it imports ``app``, so :func:`load_handler` appends it (after everything else: a file there never hides an installed
package of the same name) and leaves it there.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from types import TracebackType
from typing import Any

from app.environment import settings_from_environment
from rebound.errors import ConfigurationError
from rebound.event import Handler
from rebound.http_mapping import check_handler_url, looks_like_url
from rebound.settings import HANDLER_EXAMPLE, HANDLER_FORM, HANDLER_PATTERN, Settings

VARIABLE = "REBOUND_HANDLER"
_LONGEST_MESSAGE = 200


class HandlerImportError(ConfigurationError):
    """The handler's module was found but raised while it was imported; ``__cause__`` is what it raised."""


def load_handler(spec: str | None, settings: Settings | None = None) -> Handler:
    """The handler ``spec`` names, checked. Only a setting naming no usable handler is a :class:`ConfigurationError`
    (the module not found, its package included); any exception importing a module that is found is a
    :class:`HandlerImportError` saying where it was raised, with that exception as its ``__cause__``.

    A URL (``http://`` or ``https://``) is the HTTP push handler (``app/http_handler.py``), configured from
    ``settings`` (the environment's when not given: ``app/environment.py``); a malformed URL or another scheme is a
    ConfigurationError. The service is not contacted here: one that is down when the worker starts fails its calls
    retryably, and ``/ready`` says so, rather than stopping a worker a supervisor would only restart in a loop.
    """
    if spec and looks_like_url(spec):
        from app.http_handler import build_http_handler

        url = check_handler_url(spec, variable=VARIABLE)
        settings = (
            settings if settings is not None and settings.handler == url else settings_from_environment(handler=url)
        )
        return build_http_handler(settings)
    if not spec or not HANDLER_PATTERN.fullmatch(spec.strip()):
        raise ConfigurationError(
            f"{VARIABLE} is not set: set {VARIABLE}={HANDLER_FORM} (an async function taking one event), "
            f"for example {HANDLER_EXAMPLE}"
            if not spec or not spec.strip()
            else f"{VARIABLE}={spec!r} is not of the form {HANDLER_FORM}, for example {HANDLER_EXAMPLE}"
        )
    spec = spec.strip()
    module_name, _, attribute = spec.partition(":")
    _working_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
            raise import_failure(spec, module_name, exc) from exc  # a module the handler's module imports
        raise ConfigurationError(
            f"{VARIABLE}={spec}: no module named {missing!r}; check the module path, and that its package is "
            "installed in the worker's Python, on PYTHONPATH or in the working directory"
        ) from None
    except Exception as exc:
        raise import_failure(spec, module_name, exc) from exc
    handler = getattr(module, attribute, None)
    if handler is None:
        raise ConfigurationError(
            f"{VARIABLE}={spec}: module {module_name!r} has no {attribute!r}; name a function it defines after the ':'"
        )
    if not callable(handler):
        raise ConfigurationError(
            f"{VARIABLE}={spec}: {attribute!r} is not callable (a value of type {type(handler).__name__}); name the "
            "async function that handles an event"
        )
    call = type(handler).__call__ if not (inspect.isfunction(handler) or inspect.ismethod(handler)) else handler
    if not (inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)):
        raise ConfigurationError(
            f"{VARIABLE}={spec}: {attribute!r} is not an async function; define it as `async def "
            f"{attribute}(event)` (Rebound awaits each call)"
        )
    if not _takes_one_argument(handler):
        raise ConfigurationError(
            f"{VARIABLE}={spec}: {attribute!r} must take exactly one argument, the event: `async def {attribute}(event)`"
        )
    return handler  # type: ignore[no-any-return]


def import_failure(spec: str, module_name: str, error: Exception) -> HandlerImportError:
    """One line for ``error``, raised while ``module_name`` was imported: its class, its message (on one line,
    truncated) and where it was raised (:func:`raised_at`)."""
    message = " ".join(str(error.msg if isinstance(error, SyntaxError) else error).split())
    if len(message) > _LONGEST_MESSAGE:
        message = message[: _LONGEST_MESSAGE - 1] + "…"
    where = raised_at(error, module_name)
    return HandlerImportError(
        f"{VARIABLE}={spec}: module {module_name!r} raised {type(error).__name__}{f' at {where}' if where else ''} "
        f"while imported{f': {message}' if message else ''} (the traceback: run the worker with -l debug)"
    )


def raised_at(error: BaseException, module_name: str) -> str | None:
    """``file:line`` of ``error``: a ``SyntaxError``'s own; else the last frame of its traceback that runs code of the
    handler's module or of one of its packages (the top level or a function it defines); else the last frame outside
    the import machinery. The file is relative to the working directory when it is inside it."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{_shown_path(error.filename)}:{error.lineno}" if error.lineno else _shown_path(error.filename)
    ours, last = None, None
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_globals.get("__name__")
        if isinstance(name, str) and (module_name == name or module_name.startswith(name + ".")):
            ours = tb
        if not frame.f_code.co_filename.startswith("<frozen importlib"):
            last = tb
        tb = tb.tb_next
    found = ours or last
    if found is None or found.tb_frame.f_code.co_filename == __file__:
        return None
    return f"{_shown_path(found.tb_frame.f_code.co_filename)}:{found.tb_lineno}"


def _shown_path(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def attach_handler(app: Any, handler: Handler) -> None:
    """Tie what the handler owns to the worker's life: the HTTP handler's session is closed when the worker stops
    (a service of the app, stopped after the app's own stop has drained the handler calls)."""
    from app.http_handler import HttpHandler

    if isinstance(handler, HttpHandler):
        from agents.services import Closing, start_with

        start_with(app, Closing("HTTP handler session", handler.aclose))


def handler_readiness(handler: Handler) -> dict[str, Any] | None:
    """What ``/ready`` shows of the handler: the HTTP handler's reachability; nothing for a Python handler."""
    from app.http_handler import HttpHandler

    return handler.readiness() if isinstance(handler, HttpHandler) else None


def _takes_one_argument(handler: object) -> bool:
    try:
        signature = inspect.signature(handler)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature to read (some builtins): let the first call tell
        return True
    try:
        signature.bind(object())
    except TypeError:
        return False
    return True


def _working_directory_on_path() -> None:
    """Let a handler module kept in the working directory be found, as under ``python -m faust``: appended, so it never
    hides an installed package, and kept (the worker may import the module's own imports later)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
