"""A failed handler call logs one INFO line saying what happens next (``agents/failure_log.py``), at most 10 a second
per worker with a summary of the rest; a successful call logs nothing.

Before it, a worker at ``-l info`` said nothing when a handler failed: the demo's user saw no failure in the log."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from agents.failure_log import FailureLog, shown_delay, shown_key, shown_message
from rebound.errors import RetryableError
from rebound.event import RetryEvent
from rebound.log_limit import LineLimiter
from tests.agents.conftest import eventually, nothing_waits
from tests.agents.support import tier_headers

LOGGER = "agents.failure_log"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


async def test_a_retryable_and_a_permanent_failure_each_log_one_line_saying_what_happens_next(
    make_runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    runtime = make_runtime()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b'{"succeed_on": 0}', key=b"healthy")
        await agent.put(b'{"succeed_on": 1}', key=b"item-1")
        await agent.put(b'{"permanent": true}', key=b"item-3")
    assert lines(caplog) == [
        "handler failed: key 'item-1' (items partition 0 offset 1), attempt 0: rebound.errors.RetryableError: not yet "
        "(attempt 0); retry 1 in 1s on items.retry.1s",
        "handler failed: key 'item-3' (items partition 0 offset 2), attempt 0: rebound.errors.PermanentError: bad data: "
        "the script says permanent; dead-lettered to items.failed: permanent",
    ]


async def test_the_last_retry_s_failure_says_dead_lettered_exhausted(
    make_runtime: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with (
        runtime.agents["items.retry.2s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(
            b'{"fail": "always"}', key=b"k", headers=tier_headers(clock, attempt=3, due_in_ms=2000), partition=0
        )
        clock.advance(2000)
        await releaser.put(json.dumps({"origin": "items/0/7", "attempt": 3}).encode(), key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
    assert lines(caplog) == [
        "handler failed: key 'k' (items partition 0 offset 7), attempt 3 from tier 2s: rebound.errors.RetryableError: "
        "dependency still down; dead-lettered to items.failed: exhausted"
    ]


async def test_a_flood_logs_ten_lines_a_second_and_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    now = [100.0]
    failure_log = FailureLog(now=lambda: now[0])

    def fail(offset: int) -> None:
        failure_log.failed(
            key=b"k",
            topic="items",
            partition=0,
            offset=offset,
            attempt=0,
            tier=None,
            error_class="RetryableError",
            message="down",
            next_step="retry 1 in 5m on items.retry.5m",
        )

    for offset in range(1000):
        fail(offset)
    assert len(lines(caplog)) == 10
    summary = failure_log._summary
    assert summary is not None  # the summary is due when the second ends
    assert summary.when() == pytest.approx(asyncio.get_running_loop().time() + 1.0, abs=0.1)
    summary.cancel()
    now[0] += 1.0
    failure_log.summarize()
    assert lines(caplog)[-1].startswith("handler failed: 990 more failed call(s) not logged in the last 1.0s")
    fail(1000)  # the next second: logged again
    assert len(lines(caplog)) == 12 and lines(caplog)[-1].startswith(
        "handler failed: key 'k' (items partition 0 offset 1000)"
    )
    failure_log.summarize()  # nothing suppressed since: no line
    assert len(lines(caplog)) == 12


def test_the_line_limiter_counts_what_it_refuses() -> None:
    limiter = LineLimiter(per_window=2, window_s=1.0)
    assert [limiter.allow(5.0), limiter.allow(5.5), limiter.allow(5.9), limiter.allow(5.95)] == [
        True,
        True,
        False,
        False,
    ]
    assert limiter.window_ends_at == 6.0
    assert limiter.take_suppressed() == (2, 5.9)
    assert limiter.allow(6.0) and limiter.take_suppressed() == (0, None)
    with pytest.raises(ValueError):
        LineLimiter(per_window=0)


def test_keys_and_delays_are_shown_short() -> None:
    assert shown_key(None) == "null"
    assert shown_key(b"\xffitem") == "'\\\\xffitem'"
    assert shown_key(b"x" * 100) == repr("x" * 63 + "…")
    assert [shown_delay(ms) for ms in (-5, 998, 1000, 12_500, 300_000, 252_000, 3_600_000, 9_000_000)] == [
        "0ms", "998ms", "1.0s", "12.5s", "5m", "4m12s", "1h", "2h30m"
    ]  # fmt: skip


async def test_at_warning_level_nothing_is_counted_or_scheduled(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    failure_log = FailureLog(now=lambda: 0.0)
    for offset in range(20):
        failure_log.failed(
            key=b"k", topic="items", partition=0, offset=offset, attempt=0, tier=None, error_class="E", message="m",
            next_step="x",
        )  # fmt: skip
    assert failure_log.limiter.suppressed == 0 and failure_log._summary is None


class BrokenFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise RuntimeError("a logging filter broke")


async def test_a_raising_logger_does_not_turn_a_scheduled_retry_into_a_dead_letter(
    make_runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The line is written after the retry was sent: a logging filter or handler raising there ended in the main
    agent's internal-error dead letter of a message already scheduled, two ends for one message (the reviewer's probe:
    ``{'outcome.scheduled': 1, 'dead.internal-error': 1, 'outcome.dead': 1}``). The line is lost, nothing else."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    broken = BrokenFilter()
    logging.getLogger(LOGGER).addFilter(broken)
    try:
        runtime = make_runtime()
        async with runtime.agents["main"].test_context() as agent:
            await agent.put(b'{"succeed_on": 1}', key=b"item-1")
            await agent.put(b'{"permanent": true}', key=b"item-3")
            await agent.put(b'{"succeed_on": 0}', key=b"item-2")
    finally:
        logging.getLogger(LOGGER).removeFilter(broken)
    counters = dict(runtime.counters)
    assert counters.get("outcome.scheduled") == 1 and counters.get("outcome.succeeded") == 1
    assert counters.get("outcome.dead") == 1 and counters.get("dead.permanent") == 1
    assert "dead.internal-error" not in counters


async def test_a_raising_logger_does_not_break_the_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    failure_log = FailureLog(per_second=1, now=lambda: 0.0)
    broken = BrokenFilter()
    logging.getLogger(LOGGER).addFilter(broken)
    try:
        for offset in range(3):
            failure_log.failed(
                key=b"k", topic="items", partition=0, offset=offset, attempt=0, tier=None, error_class="E",
                message="m", next_step="x",
            )  # fmt: skip
        assert failure_log._summary is not None
        failure_log._summary.cancel()
        failure_log.summarize()
    finally:
        logging.getLogger(LOGGER).removeFilter(broken)


async def test_the_wait_said_is_the_tier_s_delay_or_the_longer_retry_after(
    make_runtime: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """It was ``due_at - now`` measured after the send: ``0ms`` for a send that took the whole delay (the clock moved
    on), ``1.0s`` for a tier named ``1s``. Now the tier's configured delay, or the Retry-After that made it longer."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    runtime = make_runtime()
    tier = runtime.tier_topics["items.retry.1s"]
    send = tier.send

    async def slow_send(*args: Any, **kwargs: Any) -> Any:
        clock.advance(1500)  # the broker took 1.5 s to acknowledge
        return await send(*args, **kwargs)

    tier.send = slow_send

    async def handler(event: RetryEvent) -> None:
        raise RetryableError("busy", retry_after_s=90 if event.key == b"later" else None)

    runtime.handler = handler
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"{}", key=b"now")
        await agent.put(b"{}", key=b"later")
    assert [line.rpartition("; ")[2] for line in lines(caplog)] == [
        "retry 1 in 1s on items.retry.1s",
        "retry 1 in 1m30s (its Retry-After) on items.retry.1s",
    ]


async def test_a_dead_letter_sent_as_a_too_large_stand_in_says_so(
    make_runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    runtime = make_runtime(producer_max_request_bytes=2048)
    runtime.failed_topics["items"].max_request_bytes = 2048
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(json.dumps({"permanent": True, "padding": "x" * 3000}).encode(), key=b"big")
    [line] = lines(caplog)
    assert line.endswith("; dead-lettered to items.failed: too-large"), line


async def test_the_summary_pending_when_the_worker_stops_is_logged_then(
    make_runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """It waited for the end of its second on a timer the stopping loop never ran: the count was lost."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    runtime = make_runtime()
    failure_log = runtime.failure_log
    failure_log.now = lambda: 0.0
    for offset in range(12):
        failure_log.failed(
            key=b"k", topic="items", partition=0, offset=offset, attempt=0, tier=None, error_class="E", message="m",
            next_step="x",
        )  # fmt: skip
    [closing] = [s for s in runtime.app._extra_services if getattr(s, "label", "") == "failed-call log"]
    await closing.on_stop()
    assert lines(caplog)[-1].startswith("handler failed: 2 more failed call(s) not logged")
    assert failure_log._summary is None


def test_control_characters_in_a_message_are_escaped() -> None:
    """An error message holding ESC sequences recoloured (or cleared) the operator's terminal."""
    assert shown_message("red \x1b[31mALERT\x1b[0m\x00\x7f\x9b!\r\nnext\tline é") == (
        "red \\x1b[31mALERT\\x1b[0m\\x00\\x7f\\x9b! next line é"
    )
