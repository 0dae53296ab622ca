"""Spring-Kafka-style retry: one tier topic per delay; a tier record not yet due pauses its partition until it is.

The design of Spring Kafka's non-blocking retries (``KafkaBackoffAwareMessageListenerAdapter`` with
``KafkaConsumerBackoffManager``): a retry topic's listener handed a record whose due time has not come throws
``KafkaBackoffException``; the container seeks the partition back to that record, pauses it, and resumes it when the
record is due, so the record is fetched again then. Nothing sleeps in the poll loop: the main topic, the other tier
topics and the tier's other partitions keep flowing, and with one topic per delay a record never waits behind one due
later (records of one tier partition arrive in due order). What the consumer does not have is a table and a timer:
a due record is fetched again only after its partition resumes, and every pause costs a seek and a fetch.

Here, in Faust (as the other baselines): the agent of a tier topic seeks with ``app.consumer.seek`` (the worker
consumer's read bookkeeping follows it, so the record is delivered again), pauses the partition in the aiokafka
consumer, and a loop timer at the due time resumes it there. Records of the paused partition that had already been handed
to the agent are skipped: they are fetched again after the seek, as Spring's seek drops the rest of a poll's records.

One difference from Spring: Faust acknowledges an event when the agent moves past it, so the committed offset can
run past a paused record, where Spring's seek keeps it at the record. It matters only on a crash or a rebalance,
which the scenarios using this baseline do not have.

Same environment as ``sleeper.py``: ``BENCH_TOPIC``, ``BENCH_DELAY`` or ``BENCH_RETRY_SEQUENCE`` (seconds), and
``BENCH_MAX_ATTEMPTS``; retry ``n`` goes to the tier topic ``<BENCH_TOPIC>.retry-<delay ms>ms`` of the ``n``-th delay
(the last one repeats), with headers ``attempt`` and ``due`` (epoch ms). The handler and its call log are
``bench.handlers.call``, as on every side.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiokafka import TopicPartition
from faust.types import TP

from bench.baselines._app import env_float, make_app, raw_topic
from bench.handlers import call

app = make_app()
TOPIC = os.environ["BENCH_TOPIC"]
source = raw_topic(app, TOPIC)
DELAY_MS = int(env_float("BENCH_DELAY", 5.0) * 1000)
MAX_ATTEMPTS = int(os.environ.get("BENCH_MAX_ATTEMPTS", "10"))
SEQUENCE_MS = [int(float(s) * 1000) for s in os.environ.get("BENCH_RETRY_SEQUENCE", "").split(",") if s.strip()]
TIERS = {ms: raw_topic(app, f"{TOPIC}.retry-{ms}ms") for ms in sorted(set(SEQUENCE_MS or [DELAY_MS]))}
# tier partition -> offset of the record it was paused for; what else that partition hands over meanwhile is stale
held: dict[TP, int] = {}
resuming: set[asyncio.Future[None]] = set()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def delay_ms(attempt: int) -> int:
    """The delay before retry ``attempt + 1``."""
    if not SEQUENCE_MS:
        return DELAY_MS
    return SEQUENCE_MS[min(attempt, len(SEQUENCE_MS) - 1)]


async def forward(event: Any, attempt: int) -> None:
    if attempt + 1 >= MAX_ATTEMPTS:
        return
    delay = delay_ms(attempt)
    headers = [("attempt", str(attempt + 1).encode()), ("due", str(now_ms() + delay).encode())]
    await TIERS[delay].send(key=event.key, value=event.value, headers=headers, partition=event.message.partition)


@app.agent(source)
async def main(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        if not call(event.key, event.value, 0):
            await forward(event, 0)


async def back_off(tp: TP, offset: int, wait_ms: int) -> None:
    """Spring's ``KafkaBackoffException`` path: seek the partition back to the record, pause it until it is due."""
    held[tp] = offset
    await app.consumer.seek(tp, offset)
    await client_call("pause", tp)
    asyncio.get_running_loop().call_later(wait_ms / 1000, resume, tp)


def resume(tp: TP) -> None:
    task = asyncio.ensure_future(client_call("resume", tp))
    resuming.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(resuming.discard)


async def client_call(method: str, tp: TP) -> None:
    """``pause`` or ``resume`` on the aiokafka consumer itself, in its thread (as the worker consumer's seeks are).

    Faust's own ``pause_partitions`` only stops handing a partition's records over: aiokafka keeps fetching it, and
    a fetched, unconsumed partition holds back every fetch to its broker for aiokafka's prefetch backoff (100 ms).
    Spring pauses the client (``KafkaConsumer.pause``), which stops fetching the partition.
    """
    thread: Any = app.consumer._thread  # type: ignore[attr-defined]  # the aiokafka driver's consumer thread
    client = thread._ensure_consumer()
    await thread.call_thread(getattr(client, method), TopicPartition(tp.topic, tp.partition))


async def tier_agent(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        message = event.message
        tp = TP(message.topic, message.partition)
        if tp in held:
            if message.offset != held[tp]:
                continue  # handed over before the seek: it is fetched again after the paused record
            del held[tp]
        headers = dict(event.headers or {})
        wait_ms = int(headers.get("due", b"0")) - now_ms()
        if wait_ms > 0:
            await back_off(tp, message.offset, wait_ms)
            continue
        attempt = int(headers.get("attempt", b"1"))
        if not call(event.key, event.value, attempt):
            await forward(event, attempt)


for _ms, _topic in TIERS.items():
    app.agent(_topic, name=f"spring-tier-{_ms}ms")(tier_agent)
