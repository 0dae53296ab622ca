"""Load the user's handler from ``REBOUND_HANDLER`` (``package.module:callable``, or an http(s):// URL).

Called by :func:`app.factory.build` before anything connects to the broker. A setting that names no usable handler (not
of the form, a module that cannot be found, no such attribute, not an async function taking one event) stops the
worker with a :class:`ConfigurationError` naming the variable (printed as one line, without a traceback, exit status 78,
by ``app/startup.py``). A module that is found but fails while it is imported stops the worker on one line too, naming
the spec, the exception's class and message and where it was raised (:func:`raised_at`); the original exception is
its ``__cause__``, whose traceback the worker prints before that line at log level debug (``-l debug``). Its exit
status says whether a restart can help: an ``ImportError`` (``ModuleNotFoundError`` of a dependency included) or a
``SyntaxError`` is a :class:`HandlerImportError`, a ConfigurationError (78: the code or its dependencies are broken);
any other exception a :class:`HandlerStartError` (exit 1: it may be transient, a database, secret store or DNS call at
a module's top level, and a supervisor restarts).

The module is looked for where the worker's Python imports from (installed packages, ``PYTHONPATH``) and then in the
working directory: ``faust -A app worker`` (the console script) puts the working directory on ``sys.path`` only while
it imports ``app``, so :func:`load_handler` appends it (after everything else: a file there never hides an installed
package of the same name) and leaves it there.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
from types import TracebackType
from typing import Any

from agents.failure_log import shown_message
from app.environment import settings_from_environment
from app.startup import debug_requested
from rebound.errors import ConfigurationError
from rebound.event import Handler
from rebound.http_mapping import check_handler_url, looks_like_url
from rebound.settings import HANDLER_EXAMPLE, HANDLER_FORM, HANDLER_PATTERN, Settings

VARIABLE = "REBOUND_HANDLER"


class HandlerImportError(ConfigurationError):
    """The handler's module was found but its code or a dependency is broken: an ``ImportError`` or ``SyntaxError``
    while it was imported. ``__cause__`` is what it raised."""


class HandlerStartError(Exception):
    """The handler's module was found but raised another exception while it was imported, which a restart may not
    meet again (a service called at a module's top level). ``__cause__`` is what it raised."""


def load_handler(spec: str | None, settings: Settings | None = None) -> Handler:
    """The handler ``spec`` names, checked. Only a setting naming no usable handler is a :class:`ConfigurationError`
    (the module not found, its package included); an exception importing a module that is found is a
    :class:`HandlerImportError` (an ``ImportError`` or ``SyntaxError``) or a :class:`HandlerStartError` (any other)
    saying where it was raised, with that exception as its ``__cause__``.

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


def import_failure(spec: str, module_name: str, error: Exception) -> HandlerImportError | HandlerStartError:
    """One line for ``error``, raised while ``module_name`` was imported: its class, its message (on one line,
    truncated, control characters escaped; the class name alone when its ``str`` raises) and where it was raised
    (:func:`raised_at`); without the hint to run with ``-l debug`` when the worker already does (the traceback is
    printed before the line). A :class:`HandlerImportError` for an ``ImportError`` or ``SyntaxError``, else a
    :class:`HandlerStartError`."""
    try:
        message = shown_message(str(error.msg if isinstance(error, SyntaxError) else error))
    except Exception:  # an exception class whose __str__ raises: its class name says what there is to say
        message = ""
    where = raised_at(error, module_name)
    hint = "" if debug_requested() else " (the traceback: run the worker with -l debug)"
    line = (
        f"{VARIABLE}={spec}: module {module_name!r} raised {type(error).__name__}{f' at {where}' if where else ''} "
        f"while imported{f': {message}' if message else ''}{hint}"
    )
    return HandlerImportError(line) if isinstance(error, ImportError | SyntaxError) else HandlerStartError(line)


def raised_at(error: BaseException, module_name: str) -> str | None:
    """Where ``error`` was raised, ``file:line`` (the file relative to the working directory when it is inside it):

    - where: a ``SyntaxError``'s own file and line; else the last frame of its traceback that runs code outside the
      import machinery and the standard library (a call into ``json`` is named by its caller's line), else the last
      frame outside the import machinery. A ``SyntaxError`` without a file (a null byte in the source) is named by the
      file of the module being imported (its spec's origin) when the traceback still shows it.
    - from where: when that is not in the handler's module, the line of the handler's module (or of its packages)
      that led there, in parentheses: ``pkg/db.py:2 (imported from pkg/items.py:2)``, ``... (called from ...)``.
    """
    frames: list[TracebackType] = []
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            frames.append(tb)
        tb = tb.tb_next
    code = [tb for tb in frames if not _is_import_machinery(tb)]
    ours_index = max(
        (i for i, tb in enumerate(frames) if _runs_module(tb, module_name)),
        default=None,
    )
    ours = frames[ours_index] if ours_index is not None else None
    where: str | None
    if isinstance(error, SyntaxError) and error.filename:
        where = f"{_shown_path(error.filename)}:{error.lineno}" if error.lineno else _shown_path(error.filename)
    elif isinstance(error, SyntaxError) and not code:  # the handler's module itself, its source unreadable
        origin = _importing_origin(frames)
        where = _shown_path(origin) if origin else _spec_origin(module_name)
    elif isinstance(error, SyntaxError) and code[-1] is ours and ours is not None:  # a module it imports, unnamed
        return f"{_at(ours)} (in a module imported there)"
    else:
        user = [tb for tb in code if not _in_standard_library(tb.tb_frame.f_code.co_filename)]
        if not (user or code):
            return _spec_origin(module_name)
        where = _at((user or code)[-1])
    if ours is None or ours_index is None or where == _at(ours):
        return where
    after = frames[ours_index + 1] if ours_index + 1 < len(frames) else None
    imported = after is None or _is_import_machinery(after) or after.tb_frame.f_code.co_name == "<module>"
    return f"{where} ({'imported' if imported else 'called'} from {_at(ours)})"


def _at(tb: TracebackType) -> str:
    return f"{_shown_path(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"


def _runs_module(tb: TracebackType, module_name: str) -> bool:
    """Whether the frame runs code of the handler's module or of one of its packages."""
    name = tb.tb_frame.f_globals.get("__name__")
    return isinstance(name, str) and (module_name == name or module_name.startswith(name + "."))


def _is_import_machinery(tb: TracebackType) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    return filename.startswith("<frozen importlib") or filename == importlib.__file__


def _in_standard_library(filename: str) -> bool:
    paths = sysconfig.get_paths()
    if any(filename.startswith(paths[name] + os.sep) for name in ("purelib", "platlib")):
        return False
    return filename.startswith("<frozen ") or any(
        filename.startswith(paths[name] + os.sep) for name in ("stdlib", "platstdlib")
    )


def _importing_origin(frames: list[TracebackType]) -> str | None:
    """The file of the module the import machinery was loading when it raised: the last ``spec`` it holds."""
    for tb in reversed(frames):
        spec = tb.tb_frame.f_locals.get("spec")
        origin = getattr(spec, "origin", None)
        if isinstance(origin, str) and os.path.isfile(origin):
            return origin
    return None


def _spec_origin(module_name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # its parent package fails to import as well: nothing better to name
        return None
    origin = spec.origin if spec is not None else None
    return _shown_path(origin) if isinstance(origin, str) and os.path.isfile(origin) else None


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
