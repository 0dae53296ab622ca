"""Producing Rebound's own records, with the guarantees the consumer side relies on.

A forward to a tier or the failed topic is awaited until the broker acknowledges it (acks=all) before the agent moves
on, because moving on is what lets Faust commit the source offset. A failing send is retried, never skipped: losing
the forward would lose the message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from json.encoder import encode_basestring as _encode_string  # the C one when there is one, as the encoder's
from typing import Any

import faust

from agents.runtime import Runtime
from rebound.attempts import Outcome, event_id, key_text
from rebound.backoff import backoff_s
from rebound.errors import RecordTooLargeError, UnsendableRecordError
from rebound.headers import Header, Provenance
from rebound.records import producible
from tables.kafka_errors import is_too_large

log = logging.getLogger(__name__)
_COUNTER = {outcome: f"outcome.{outcome.value}" for outcome in Outcome}
_VALUE = {outcome: outcome.value for outcome in Outcome}
"""Each outcome's value: ``Enum.value`` is a Python-level descriptor, read per message otherwise."""
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # as AttemptEvent.to_json's


_TEXTS: dict[str, str] = {}
"""Topic, group and tier names as ``_ENCODE`` writes them: a few configured names, encoded once."""
_OUTCOMES = {outcome: _encode_string(outcome.value) for outcome in Outcome}


def _text(value: str | None) -> str:
    """A name (topic, group, tier) as ``_json`` writes it, from :data:`_TEXTS` after its first time."""
    if value is None:
        return "null"
    encoded = _TEXTS.get(value) if type(value) is str else None
    if encoded is None:
        encoded = _json(value)
        if type(value) is str and len(_TEXTS) < 1024:
            _TEXTS[value] = encoded
    return encoded


def _json(value: object) -> str:
    """One value as ``_ENCODE`` writes it: the attempt event's strings, ints and nulls without the encoder's
    machinery (a third of the record's cost), anything else through it."""
    if value is None:
        return "null"
    if type(value) is str:
        return _encode_string(value)
    if type(value) is int:
        return int.__repr__(value)  # (a bool is an int of another type: the encoder's)
    return _ENCODE(value)


async def deliver(
    topic: Any,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    partition: int | None,
) -> Any:
    """Send and wait for the broker's acknowledgement, retrying with back-off until it comes.

    A record too large to produce can never succeed, so it raises :class:`RecordTooLargeError` for the caller to
    route instead of retrying forever (which would stop the agent on every partition it owns). Callers check sizes
    up front (:mod:`rebound.records`); this catches a broker whose limit is lower than the producer's.
    """
    value, headers = producible(key, value, headers)
    failures = 0
    while True:
        try:
            pending = await topic.send(key=key, value=value, headers=headers, partition=partition)
            return await pending
        except asyncio.CancelledError:
            raise
        except (AssertionError, TypeError) as exc:  # the client's own checks of the record: no resend can pass them
            raise UnsendableRecordError(f"record for {topic.get_topic_name()} refused by the client: {exc!r}") from exc
        except Exception as exc:
            if is_too_large(exc):
                raise RecordTooLargeError(
                    f"record for {topic.get_topic_name()} is too large to produce: {exc}"
                ) from exc
            failures += 1
            backoff = backoff_s(failures)
            log.warning("send to %s failed (%r); retrying in %.1fs", topic.get_topic_name(), exc, backoff)
            await asyncio.sleep(backoff)


async def emit_attempt(
    runtime: Runtime,
    *,
    key: bytes | None,
    provenance: Provenance,
    attempt: int,
    tier: str | None,
    outcome: Outcome,
    reason: str | None = None,
    error_class: str | None = None,
    error_message: str | None = None,
    due_at: int | None = None,
    next_tier: str | None = None,
) -> None:
    """Record an outcome on the attempts topic; buffered, and flushed before offsets are committed.

    The record is :meth:`AttemptEvent.to_json`'s bytes, built without the event: the same fields in the same order
    (tests/agents/test_attempt_encoding.py holds them to be identical), and no object per message on the healthy path.
    """
    runtime.counters[_COUNTER[outcome]] += 1
    runtime.metrics.attempt(provenance.topic, tier, _VALUE[outcome], reason, error_class)
    if outcome is Outcome.SUCCEEDED and attempt == 0 and runtime.settings.succeeded_events == "retries":
        return  # most of the traffic, and what a pipeline can most easily do without: one record fewer per message
    group = runtime.group
    identity = event_id(group, provenance.topic, provenance.partition, provenance.offset, attempt, outcome)
    try:
        partition, offset, first, now = (
            provenance.partition,
            provenance.offset,
            provenance.first_received_at_ms,
            runtime.clock(),
        )
        if (
            reason is None
            and error_class is None
            and error_message is None
            and due_at is None
            and next_tier is None
            and type(partition) is int
            and type(offset) is int
            and type(attempt) is int
            and type(first) is int
            and type(now) is int
        ):  # a success (most of the traffic): the names encoded once, the ints as they are, the rest null
            text = (
                f'{{"event_id":"{identity}","group":{_text(group)},"key":{_json(key_text(key))},'
                f'"original_topic":{_text(provenance.topic)},"original_partition":{partition},'
                f'"original_offset":{offset},"attempt":{attempt},"tier":{_text(tier)},'
                f'"outcome":{_OUTCOMES[outcome]},"reason":null,"error_class":null,"error_message":null,'
                f'"first_received_at":{first},"due_at":null,"event_time":{now},"next_tier":null}}'
            )
        else:  # AttemptEvent's fields, in its order, as ``_ENCODE`` writes their dict
            text = (
                f'{{"event_id":{_json(identity)},"group":{_json(group)},"key":{_json(key_text(key))},'
                f'"original_topic":{_json(provenance.topic)},"original_partition":{_json(partition)},'
                f'"original_offset":{_json(offset)},"attempt":{_json(attempt)},"tier":{_json(tier)},'
                f'"outcome":{_json(outcome.value)},"reason":{_json(reason)},"error_class":{_json(error_class)},'
                f'"error_message":{_json(error_message[:1024] if error_message else error_message)},'
                f'"first_received_at":{_json(first)},"due_at":{_json(due_at)},'
                f'"event_time":{_json(now)},"next_tier":{_json(next_tier)}}}'
            )
        record = text.encode("utf-8")  # (a lone surrogate in a message fails here, and is logged)
        producer = _aiokafka_producer(runtime)
        if producer is None:
            await runtime.attempts_topic.send(key=key, value=record, partition=provenance.partition)
        else:
            sent = await producer.send(
                runtime.attempts_topic.get_topic_name(), record, key=key, partition=provenance.partition
            )
            sent.add_done_callback(_attempt_sent)
    except asyncio.CancelledError:
        raise
    except Exception:  # analytics must never block or crash message handling
        log.exception("could not emit attempt event %s", identity)


def _aiokafka_producer(runtime: Runtime) -> Any:
    """:func:`direct_producer` for the attempts topic."""
    return direct_producer(runtime, runtime.attempts_topic)


def direct_producer(runtime: Runtime, topic: Any) -> Any:
    """The started aiokafka producer under the app's Faust producer, for a record of Rebound's own (an attempt event, a
    release request) to go straight into its buffer; None when ``topic`` is not a Faust topic (tests record it), the
    app uses transactions, or the producer is not started: then Faust's ``Topic.send`` takes it.

    Faust's send path around aiokafka's (its topic, channel, a ``FutureMessage`` and a ``PendingMessage`` per record,
    the send sensors and signals, the producer asked of the app) cost a healthy message about as much as aiokafka's
    own. Nothing of it applies to an attempt event (raw bytes, no headers, no attachment to the current event, no
    transaction); what the commit relies on stays: the consumer flushes the aiokafka producer before it commits
    offsets (``app/producer.py``, ``ReboundProducer.flush``), and that flush waits for every record in its buffer, these
    included.

    Ready is the app's public ``producer_ready`` where it has one (``ReboundApp``'s: started, and no start of its own
    under way), else the producer's ``started`` (a plain Faust app, as some tests build). Asked with ``getattr``:
    agents do not import ``app`` (the layers' contract) and know the app as a ``faust.App``, and a runtime-checked
    Protocol's ``isinstance`` would cost more per attempt event than the attribute read.
    """
    if not isinstance(topic, faust.Topic):
        return None
    app = runtime.app
    if app.in_transaction:
        return None
    producer: Any = app.producer  # (Faust's aiokafka driver: _ensure_producer is in tests/contract/inventory.py)
    if not getattr(app, "producer_ready", producer.started):
        return None
    return producer._ensure_producer()


def _attempt_sent(sent: asyncio.Future[Any]) -> None:
    """An attempt event's send ended: a failure is logged (analytics never block handling), and retrieved, so asyncio
    does not report it once more when the future is collected."""
    if not sent.cancelled() and (error := sent.exception()) is not None:
        log.error("could not emit an attempt event: %r", error)
