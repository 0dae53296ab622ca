"""One INFO line per failed handler call, rate-limited per worker.

``agents/attempt.py`` calls :meth:`FailureLog.failed` once a failure's outcome has been carried out (the retry sent
to its tier, or the dead letter to its failed topic), so the line says what happened next, for example::

    handler failed: key 'item-1' (items partition 0 offset 3), attempt 0: rebound.errors.RetryableError: item item-1
    does not exist yet; retry 1 in 1s on items.retry.1s

At most :data:`LINES_PER_SECOND` such lines a second per worker (:class:`rebound.log_limit.LineLimiter`); when a
second suppressed some, one line at its end (or when the worker stops: :meth:`FailureLog.flush`) says how many
(every attempt is counted in ``rebound_attempts_total`` and written to the attempts topic whatever the log shows).
Only failures reach this code: a successful call costs nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from rebound.log_limit import LineLimiter

log = logging.getLogger(__name__)
LINES_PER_SECOND = 10
_KEY_CHARS = 64
_MESSAGE_CHARS = 200


def shown_key(key: bytes | None) -> str:
    """A record's key for a log line: its text (bytes that are not UTF-8 escaped), quoted, cut to 64 characters."""
    if key is None:
        return "null"
    text = key.decode("utf-8", errors="backslashreplace")
    return repr(text if len(text) <= _KEY_CHARS else text[: _KEY_CHARS - 1] + "…")


def shown_message(message: str, limit: int = _MESSAGE_CHARS) -> str:
    """An error's message on one line (whitespace runs made one space), its other C0 and C1 control characters and DEL
    escaped as ``repr`` escapes them (``\\x1b``: a message cannot recolour or rewrite the operator's terminal), cut to
    ``limit`` characters."""
    text = " ".join(message.split()).translate(_CONTROL_ESCAPES)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_CONTROL_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}


def shown_delay(ms: int) -> str:
    """``850ms``, ``1.0s``, ``12.5s``, ``5m``, ``4m12s``, ``1h``, ``2h30m``."""
    ms = max(0, ms)
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}s"
    minutes, seconds = divmod(round(ms / 1000), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s" if seconds else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"


class FailureLog:
    """This worker's failed-call lines and their limit."""

    def __init__(
        self,
        *,
        per_second: int = LINES_PER_SECOND,
        now: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.limiter = LineLimiter(per_window=per_second, window_s=1.0)
        self.now = now
        self.logger = logger
        self._summary: asyncio.TimerHandle | None = None

    def failed(
        self,
        *,
        key: bytes | None,
        topic: str,
        partition: int,
        offset: int,
        attempt: int,
        tier: str | None,
        error_class: str,
        message: str,
        next_step: str,
    ) -> None:
        """Never raises: it runs after the outcome was carried out (the retry or dead letter sent), where an error
        would make the main agent dead-letter ``internal-error`` a message already scheduled. A logger cannot be
        trusted there (a filter, handler or formatter of the application's may raise), so the line is then lost."""
        with contextlib.suppress(Exception):  # (nothing to report it with but the logger that raised)
            if not self.logger.isEnabledFor(logging.INFO):
                return
            now = self.now()
            if not self.limiter.allow(now):
                self._summarize_at(self.limiter.window_ends_at - now)
                return
            self.logger.info(
                "handler failed: key %s (%s partition %d offset %d), attempt %d%s: %s: %s; %s",
                shown_key(key),
                topic,
                partition,
                offset,
                attempt,
                f" from tier {tier}" if tier else "",
                error_class,
                shown_message(message),
                next_step,
            )

    def summarize(self) -> None:
        """Log how many lines were suppressed, if any (called when their window ends). Never raises, as ``failed``."""
        self._summary = None
        count, since = self.limiter.take_suppressed()
        if not count:
            return
        with contextlib.suppress(Exception):
            self.logger.info(
                "handler failed: %d more failed call(s) not logged in the last %.1fs (at most %d lines a second; "
                "every attempt is counted in rebound_attempts_total)",
                count,
                max(0.0, self.now() - since) if since is not None else 0.0,
                self.limiter.per_window,
            )

    async def flush(self) -> None:
        """When the worker stops: the summary of the lines suppressed in the last window, now rather than never."""
        if self._summary is not None:
            self._summary.cancel()
        self.summarize()

    def _summarize_at(self, delay_s: float) -> None:
        if self._summary is None:
            self._summary = asyncio.get_running_loop().call_later(max(0.0, delay_s), self.summarize)
