"""The main-topic agent: first tries. A failure leaves the partition at once (to a tier or the failed topic)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from functools import partial
from typing import Any

from agents.attempt import dead_letter, run_attempt
from agents.lifecycle import (
    announce_dead_letter,
    announce_retry,
    check_redelivery,
    refuses,
    remember_outcome,
    send_dead_letter_again,
    still_owned,
)
from agents.ordering import KeyOrder
from agents.records import first_provenance, header_pairs, lane_of
from agents.runtime import Runtime
from agents.topics import raw_topic
from rebound.attempts import Outcome
from rebound.headers import Header, Provenance, restore_null_value, without_rebound_headers
from rebound.routing import DeadLetter, Reason
from rebound.settings import reveal
from rebound.signing import SIGNATURE, verify_republished
from rebound.state import Known, record_digest, remembers_outcome, table_key
from rebound.topics import failed_topic

log = logging.getLogger(__name__)


def trusted_origin(
    runtime: Runtime, message: Any, headers: list[Header]
) -> tuple[Provenance, int, str | None, bytes | None]:
    """Provenance, attempt, tier and value of a main-topic record.

    Retry headers arriving on a main topic are not trusted: only a record this group re-published itself (release
    mode ``republish``, HMAC-signed, unexpired) keeps its attempt count; everything else is a first delivery. A
    signed record that fails verification is logged and counted: it restarts its retry policy.
    """
    if runtime.settings.release_mode == "republish":
        value = restore_null_value(message.value, headers)
        verified = verify_republished(
            headers,
            key=message.key,
            value=value,
            secret=reveal(runtime.settings.header_secret),
            main_topics=runtime.settings.topics,
            group=runtime.group,
            now_ms=runtime.clock(),
        )
        if verified is not None:
            return (*verified, value)
        if any(name == SIGNATURE for name, _ in headers):
            runtime.counters["main.signature_rejected"] += 1
            log.warning(
                "signed record %s[%d]@%d failed verification (tampered, expired or re-signed elsewhere); "
                "treating it as a first delivery",
                message.topic,
                message.partition,
                message.offset,
            )
    return first_provenance(message, runtime.clock()), 0, None, message.value


async def handle_main_event(runtime: Runtime, order: KeyOrder, event: Any) -> Awaitable[None] | None:
    """First try of one main-topic record: the handler, then the routing of its failure. Never raises (except on
    cancellation): the dispatcher acknowledges the offset once this returns, or once what it returns (the
    confirmation of its *forwarded* or ended mark: :func:`remember_outcome`) completes. In key-ordered mode,
    ``order`` takes the record once its redelivery is checked (:class:`agents.ordering.KeyOrder`)."""
    message = event.message
    headers = header_pairs(message.headers)
    provenance: Provenance | None = None
    attempt, tier, value = 0, None, message.value
    try:
        provenance, attempt, tier, value = trusted_origin(runtime, message, headers)
        own_headers = without_rebound_headers(headers)
        state_key = table_key(message.key, provenance)
        digest_of = partial(record_digest, message.key, value)  # a healthy message never needs it
        known = check_redelivery(runtime, state_key, provenance, attempt, digest_of)
        if refuses(known):
            return None
        maybe_sent = known is Known.SENDING
        if known is Known.DEAD_LETTERING:  # its dead letter may be out: the same again, not the handler
            outcome = await send_dead_letter_again(
                runtime,
                state_key,
                provenance,
                attempt,
                key=message.key,
                value=value,
                headers=own_headers,
                tier=tier,
                digest_of=digest_of,
            )
            if order.applies(message.key):
                await order.settle(state_key, provenance, outcome, maybe_sent=False, digest_of=digest_of)
                return None
            return await remember_outcome(runtime, state_key, provenance, attempt, outcome, digest=digest_of())
        if order.applies(message.key):
            await order.run(
                state_key,
                key=message.key,
                value=value,
                headers=own_headers,
                provenance=provenance,
                sending=maybe_sent,
                digest_of=digest_of,
            )
            return None
        outcome = await run_attempt(
            runtime,
            key=message.key,
            value=value,
            headers=own_headers,
            provenance=provenance,
            attempt=attempt,
            tier=tier,
            before_retry=announce_retry(runtime, state_key, provenance, attempt, digest_of),
            before_send=announce_dead_letter(runtime, state_key, provenance, attempt, digest_of, maybe_sent=maybe_sent),
        )
        if remembers_outcome(outcome, attempt, maybe_sent=maybe_sent):  # (a first try's success writes nothing)
            digest = digest_of()
            return await remember_outcome(
                runtime, state_key, provenance, attempt, outcome, maybe_sent=maybe_sent, digest=digest
            )
        return None
    except Exception as exc:  # a bug of ours: route the message rather than lose or wedge it
        log.exception("internal error on %s[%d]@%d", message.topic, message.partition, message.offset)
        if provenance is None:  # trusted_origin itself failed
            provenance = first_provenance(message, runtime.clock())
        # Not on a partition maybe another's: FirstTryRevokedError (a cancellation, past this catch-all) leaves the
        # record unacknowledged for the partition's next reader, rather than skip it.
        await still_owned(runtime, provenance, attempt)
        await dead_letter(
            runtime,
            DeadLetter(failed_topic(provenance.topic), Reason.INTERNAL_ERROR),
            key=message.key,
            value=value,
            headers=headers,
            provenance=provenance,
            attempt=attempt,
            tier=tier,
            error_class=type(exc).__name__,
            error_message=str(exc),
        )
        state_key = table_key(message.key, provenance)
        digest = record_digest(message.key, value)
        if order.applies(message.key):
            await order.ended_in_error(state_key, provenance, attempt, digest)
            return None
        # (a later attempt already parked is left alone: remember() never writes over it)
        return await remember_outcome(runtime, state_key, provenance, attempt, Outcome.DEAD, digest=digest)


def register_main_agent(runtime: Runtime) -> Any:
    topics = list(runtime.main_topics.values())
    channel = (
        topics[0]
        if len(topics) == 1
        else raw_topic(
            runtime.app,
            *[topic.get_topic_name() for topic in topics],
            maxsize=runtime.settings.partition_buffer,  # as each main topic's own (app/factory.py)
        )
    )
    dispatcher = runtime.dispatcher
    run = partial(handle_main_event, runtime, KeyOrder(runtime))

    async def main_agent(stream: Any) -> None:
        # One Faust actor, no automatic acks: the dispatcher runs keys concurrently and acknowledges offsets in order
        # (Faust's own concurrency=N commits past messages in flight, faust-streaming#606).
        async for event in stream.noack().events():
            runtime.counters["main.received"] += 1
            dispatcher.offer(event, lane_of(event.message), run)

    return runtime.app.agent(channel, name="rebound.main", concurrency=1)(main_agent)
