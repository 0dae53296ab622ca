"""Producing the plan at a steady pace, so that faults hit messages at every stage: new, parked, due and dying.

Every record's partition and offset come from the broker's acknowledgement (acks=all) and become the message's
provenance, the identity the checker uses. A message whose send was not acknowledged is not part of the produced
set: it was never promised to anyone. Its send is retried until acknowledged or the run gives up, which is reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from chaos.checker import Produced
from chaos.scenario import PlannedMessage

log = logging.getLogger(__name__)


async def produce_paced(
    bootstrap: str,
    topic: str,
    plan: Sequence[PlannedMessage],
    *,
    duration_s: float,
    chunk: int = 50,
    produced: list[Produced],
    unacknowledged: list[str],
) -> None:
    """Send ``plan`` spread over ``duration_s``; results are appended as they come, so a cancelled run keeps them.

    One record per batch: the embedded broker answers ``ListOffsets(latest)`` per batch, and the run must not lean
    on that quirk (the workers are configured the same way).
    """
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        max_batch_size=1,
        linger_ms=0,
        request_timeout_ms=120_000,
        enable_idempotence=False,
    )
    await producer.start()
    try:
        start = time.monotonic()
        chunks = [plan[index : index + chunk] for index in range(0, len(plan), chunk)]
        for number, part in enumerate(chunks):
            await asyncio.sleep(max(0.0, start + duration_s * number / max(1, len(chunks)) - time.monotonic()))
            futures: list[Any] = [await producer.send(topic, key=message.key, value=message.value) for message in part]
            results = await asyncio.gather(*futures, return_exceptions=True)
            for message, result in zip(part, results, strict=True):
                if isinstance(result, BaseException):
                    log.error("send of %s not acknowledged: %r", message.mid, result)
                    unacknowledged.append(message.mid)
                    continue
                produced.append(
                    Produced(
                        mid=message.mid,
                        origin=(topic, result.partition, result.offset),
                        key=message.key,
                        value=message.value,
                        kind=message.kind.value,
                        expected=message.expected,
                        expected_attempt=message.expected_attempt,
                    )
                )
    finally:
        await producer.stop()
