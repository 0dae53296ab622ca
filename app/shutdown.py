"""A stop that fits a grace period: the worker exits within ``REBOUND_SHUTDOWN_TIMEOUT`` of SIGTERM, whatever hangs.

An orchestrator sends SIGTERM, waits its grace period (Kubernetes: 30 s) and then sends SIGKILL, after which
everything since the last commit runs again. The handler work a stop waits for is bounded by the dispatcher, which
cuts it short before the timeout (``Dispatcher.cut_short``); what follows (the last commit, the producer's flush,
leaving the group) waits on the broker, and an unreachable broker would hold each of them for up to a request
timeout. So the worker also keeps a watchdog: if it is still stopping when ``REBOUND_SHUTDOWN_TIMEOUT`` is up, it
says why and exits at once with :data:`SHUTDOWN_OVERRUN_EXIT_CODE`, which costs what a SIGKILL would, but at a time
the operator chose and with a line in the log saying so.

The watchdog is a thread, not a task: a handler blocking the event loop with synchronous code must not stop it. For
the same reason it is armed by a plain signal handler (which runs between two bytecodes of whatever the main thread
is doing) ahead of the event loop's, which runs only when the loop gets its turn; and by every way out of the worker
(``on_worker_shutdown``), since a stop after a crash comes with no signal at all.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import faust

log = logging.getLogger(__name__)

SHUTDOWN_OVERRUN_EXIT_CODE = 75
"""EX_TEMPFAIL: the stop took longer than ``REBOUND_SHUTDOWN_TIMEOUT`` and was ended; nothing is lost (what was not
committed runs again on the next owner), but the last commit may not have happened."""

REPORT_TIMEOUT_S = 0.5
"""How long an overrun waits for its log line before it exits anyway: logging takes its handlers' locks, and a main
thread stuck writing to a full stderr pipe holds one of them for ever."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ShutdownWatchdog:
    """Ends the process if a stop outlasts its bound, counted from the first :meth:`arm`.

    Its thread starts with the watchdog, not when a stop begins: :meth:`arm` runs in a signal handler, between two
    bytecodes of whatever the main thread was doing, and starting a thread or setting a ``threading.Event`` takes
    locks the interrupted code may hold. Arming is an assignment and one byte written to a pipe the thread waits on.
    """

    def __init__(
        self,
        bound_s: float,
        *,
        exit_process: Callable[[int], object] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound_s = bound_s
        self._exit_process = exit_process
        self._clock = clock
        self._deadline: float | None = None
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a signal handler must never wait on it
        self._thread = threading.Thread(target=self._watch, name="rebound-shutdown-watchdog", daemon=True)
        self._thread.start()

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    @property
    def deadline(self) -> float | None:
        """When the process is ended (on ``clock``), if it is still there; None when not armed."""
        return self._deadline

    def arm(self) -> None:
        """Start counting; a second stop signal keeps the first deadline. Safe in a signal handler (no lock, no I/O
        that can wait)."""
        if self._deadline is None:
            self._deadline = self._clock() + self.bound_s
            self._wake()

    def disarm(self) -> None:
        """The stop completed: what the process does after (the interpreter's own shutdown) is not an overrun."""
        self._deadline = None
        self._wake()

    def close(self) -> None:
        """Disarm and end the thread (tests; a worker keeps its watchdog until the process ends)."""
        self._deadline = None
        self._closed = True
        self._wake()
        self._thread.join(5)
        if not self._thread.is_alive():
            os.close(self._wake_write)

    def _wake(self) -> None:
        if not self._closed or self._thread.is_alive():
            with contextlib.suppress(OSError):  # full (the thread is already awake) or closed
                os.write(self._wake_write, b"!")

    def _watch(self) -> None:
        # poll, not select: a worker may hold more than FD_SETSIZE (1024) descriptors by the time it makes this pipe.
        poller = select.poll()
        poller.register(self._wake_read, select.POLLIN)
        try:
            while not self._closed:
                deadline = self._deadline
                timeout_ms = None if deadline is None else max(0, math.ceil((deadline - self._clock()) * 1000))
                if poller.poll(timeout_ms):
                    os.read(self._wake_read, 4096)  # armed, disarmed or closed: look again
                    continue
                deadline = self._deadline
                if deadline is not None and self._clock() >= deadline:
                    self._overrun()
                    return
        finally:
            os.close(self._wake_read)

    def _overrun(self) -> None:
        """Say why, if logging lets us within :data:`REPORT_TIMEOUT_S`, and exit whatever happens."""
        try:
            reporter = threading.Thread(target=self._report, name="rebound-shutdown-report", daemon=True)
            reporter.start()
            reporter.join(REPORT_TIMEOUT_S)
        finally:
            self._exit_process(SHUTDOWN_OVERRUN_EXIT_CODE)

    def _report(self) -> None:
        log.critical(
            "shutdown: still stopping %gs after the stop began (REBOUND_SHUTDOWN_TIMEOUT); exiting now with code %d. "
            "Records not committed yet run again on their partitions' next owner",
            self.bound_s,
            SHUTDOWN_OVERRUN_EXIT_CODE,
        )
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):  # exiting anyway: a handler that cannot flush must not prevent it
                handler.flush()


def arm_on_signals(watchdog: ShutdownWatchdog, signals: Iterable[signal.Signals] = STOP_SIGNALS) -> None:
    """Arm ``watchdog`` from a plain signal handler put in front of the one already installed (the event loop's).

    asyncio's ``add_signal_handler`` installs a Python handler that does nothing and learns of the signal through
    the wakeup file descriptor, which the interpreter writes to whichever Python handler is installed: the loop's
    callback still runs, when the loop gets its turn; this one runs as soon as the main thread runs Python code
    again. A signal with no Python handler (default action, or ignored) is left as it is. Main thread only.
    """
    for signum in signals:
        previous = signal.getsignal(signum)
        if callable(previous):
            signal.signal(signum, _arming_handler(watchdog, previous))


def _arming_handler(
    watchdog: ShutdownWatchdog, previous: Callable[[int, FrameType | None], Any]
) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        watchdog.arm()  # first: nothing here logs (the interrupted code may hold a logging lock)
        previous(signum, frame)

    return handler


class ReboundWorker(faust.Worker):
    """Faust's worker (``faust -A app worker``), with the shutdown watchdog armed by the first stop signal or by any
    other way out of the worker, and disarmed once its stop completed.

    The bound is read from the app (``rebound_shutdown_timeout_s``, set by the factory): Faust makes the worker
    from the app's ``Worker`` setting, with no way to pass it more.
    """

    _rebound_watchdog: ShutdownWatchdog | None = None

    def _watchdog(self) -> ShutdownWatchdog | None:
        """The worker's watchdog, made on first use (never in a signal handler: it starts a thread)."""
        if self._rebound_watchdog is None:
            bound = getattr(self.app, "rebound_shutdown_timeout_s", None)
            if isinstance(bound, int | float):
                self._rebound_watchdog = ShutdownWatchdog(float(bound))
        return self._rebound_watchdog

    def install_signal_handlers(self) -> None:
        super().install_signal_handlers()
        watchdog = self._watchdog()
        if watchdog is not None and sys.platform != "win32" and threading.current_thread() is threading.main_thread():
            arm_on_signals(watchdog)

    def _schedule_shutdown(self, signal: signal.Signals) -> None:
        watchdog = self._watchdog()
        if watchdog is not None and not self._signal_stop_time:
            watchdog.arm()  # (armed already by the plain handler, when the signal came from outside)
            log.info("shutdown: %s received; the worker exits within %gs of it", signal.name, watchdog.bound_s)
        super()._schedule_shutdown(signal)

    def on_worker_shutdown(self) -> None:
        """Every way out of the worker passes here (mode's ``execute_from_commandline``), a crash's too."""
        watchdog = self._watchdog()
        if watchdog is not None and not watchdog.armed:
            watchdog.arm()
            log.info("shutdown: the worker is stopping without a signal; it exits within %gs", watchdog.bound_s)
        super().on_worker_shutdown()

    def stop_and_shutdown(self) -> None:
        try:
            super().stop_and_shutdown()
        finally:
            if self._rebound_watchdog is not None:
                self._rebound_watchdog.disarm()


WORKER_CLASS = "app.shutdown:ReboundWorker"
"""The app's ``Worker`` setting: the class ``faust -A app worker`` runs."""


def bound_shutdown(app: Any, timeout_s: float) -> None:
    """Give the app's worker (:class:`ReboundWorker`, see :data:`WORKER_CLASS`) its bound on a stop."""
    app.rebound_shutdown_timeout_s = timeout_s
