"""Clean start-up failures: ``faust -A app worker`` that cannot start says why on one line, with an exit status
that tells a supervisor whether restarting can help.

``faust -A app <command>`` imports this package and reads ``app.app``, which builds the application: settings are
read and validated, the handler imported and checked, and only then is the broker contacted (topic provisioning, the
worker). An error raised on that path would reach Faust's command line as a 30-line traceback; for the two below the
process instead prints one line to stderr (what is wrong, the variable, how to fix it) and exits:

- :data:`EX_CONFIG` (78): a :class:`~rebound.errors.ConfigurationError`. The configuration is wrong and a restart will
  not fix it: fix the setting (or the topics) first. A supervisor may stop restarting on 78.
- :data:`EX_TEMPFAIL` (75): a :class:`~app.provisioning.BrokerUnavailableError`, the broker did not answer topic
  provisioning (down, restarting, unreachable) or failed it. Temporary: restart (with a delay) and it may succeed.

A handler's module that raises while it is imported ends on one line saying where it was raised too: an
``ImportError`` or ``SyntaxError`` is a ConfigurationError (:class:`~app.handlers.HandlerImportError`, 78); any other
exception (:class:`~app.handlers.HandlerStartError`) exits with Python's failure status, 1, since what failed may be
temporary (a service the module calls at its top level) and a supervisor should restart. With the worker's log level
debug (``-l debug``, :func:`debug_requested`) the traceback of what caused either is printed before the line.
Anything else (Faust's own errors, a crash) keeps its traceback and status 1.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from typing import IO, NoReturn

from rebound.errors import ConfigurationError

EX_CONFIG = 78
"""The exit status of a worker refused by its configuration: ``EX_CONFIG`` of sysexits.h ("something was found in
an unconfigured or misconfigured state"). Distinct from 75 (:data:`EX_TEMPFAIL`), from 1 (a crash, Faust's own
errors) and from the operator commands' 0 to 3 (``app/cli.py``). Every ``ConfigurationError`` of the build ends so:
the settings and the handler, checked before anything connects, and then what topic provisioning reports as one (main
topics' partition counts that differ from each other or from ``REBOUND_PARTITIONS``, missing topics with
``REBOUND_PROVISION_TOPICS`` off). Restarting cannot help until the configuration changes: a supervisor may stop."""

EX_TEMPFAIL = 75
"""The exit status of a worker that could not reach its broker at start-up: ``EX_TEMPFAIL`` of sysexits.h ("a
temporary failure ... the user is invited to retry later"). ``REBOUND_BROKER`` did not answer topic provisioning
within its timeout, refused the connection, or failed the request: the broker may be down or still starting (or the
address wrong, which the one line shows). A supervisor should restart, with a delay."""

EX_FAILURE = 1
"""The exit status of a worker whose handler module raised something other than an ``ImportError`` or
``SyntaxError`` while imported: Python's failure status, as for a crash. What failed may be temporary (a database,
secret store or DNS call at a module's top level): a supervisor restarts."""


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    """Whether Faust's command line asks for log level debug: ``-l debug``, ``-ldebug``, ``--loglevel debug`` or
    ``--loglevel=debug``, before or after the command (Faust takes it in both places), any case. Read from the
    arguments because the app is built before Faust sets up logging."""
    words = list(sys.argv if argv is None else argv)[1:]
    if "--" in words:
        words = words[: words.index("--")]
    for index, word in enumerate(words):
        if word in ("-l", "--loglevel"):
            value = words[index + 1] if index + 1 < len(words) else ""
        elif word.startswith("--loglevel="):
            value = word.partition("=")[2]
        elif word.startswith("-l") and not word.startswith("--"):
            value = word[2:]
        else:
            continue
        if value.lower() == "debug":
            return True
    return False


def exit_on_configuration_error(
    error: ConfigurationError, stream: IO[str] | None = None, *, debug: bool | None = None
) -> NoReturn:
    """Print ``error`` as one line (no traceback) and exit with :data:`EX_CONFIG`. With ``debug`` (default: what
    :func:`debug_requested` says of ``sys.argv``), the traceback of the error's cause first, when it has one (the
    exception a handler's module raised while it was imported)."""
    _print_cause(error, stream, debug)
    _exit("configuration error, not started", error, EX_CONFIG, stream)


def exit_on_handler_start_error(
    error: Exception, stream: IO[str] | None = None, *, debug: bool | None = None
) -> NoReturn:
    """Print ``error`` (a :class:`~app.handlers.HandlerStartError`) as one line, after its cause's traceback at log
    level debug as :func:`exit_on_configuration_error` does, and exit with :data:`EX_FAILURE`."""
    _print_cause(error, stream, debug)
    _exit(
        "handler module failed while imported, not started (may be temporary: a restart retries)",
        error,
        EX_FAILURE,
        stream,
    )


def _print_cause(error: Exception, stream: IO[str] | None, debug: bool | None) -> None:
    """The traceback of what caused ``error`` (a handler module's exception), at log level debug only."""
    cause = error.__cause__
    if cause is not None and (debug_requested() if debug is None else debug):
        traceback.print_exception(cause, file=stream or sys.stderr)


def exit_on_broker_unavailable(error: Exception, stream: IO[str] | None = None) -> NoReturn:
    """Print ``error`` (a :class:`~app.provisioning.BrokerUnavailableError`) as one line (no traceback) and exit with
    :data:`EX_TEMPFAIL`."""
    _exit("broker unavailable, not started (temporary: a restart retries)", error, EX_TEMPFAIL, stream)


def _exit(what: str, error: Exception, status: int, stream: IO[str] | None) -> NoReturn:
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"rebound: {what}: {message}", file=stream or sys.stderr, flush=True)
    raise SystemExit(status)
