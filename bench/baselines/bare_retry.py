"""The failure path's floor: the least bare Faust does to forward, park and release a failed message on the fixed
outside surface (a retry tier topic, a changelog-backed table holding the parked message, a timer that cannot
change the table and so sends release requests to an agent), with no Rebound code on the path.

A FLOOR, NOT A PRODUCT: none of Rebound's guarantees. No *sending* or *forwarded* marks, no confirmation of a table
write before its offset is committed (Faust's own commit flushes its producer first, no more), no writer epochs, no
per-key order or lanes, no dead letters, no retry policy beyond one retry, no header validation, no payload table
apart from the state, no adoption of parked entries after a rebalance (the due-time heap lives only in the worker
that parked them), no lateness histogram, no breaker, no pacing. The one confirmation kept: a failed message's offset
is acknowledged only once its tier record is acknowledged (``acks=all``), as the surface needs.

What it does, per message (``failure-path``'s ``bare-faust`` variant runs it):

- the main agent (``BENCH_TOPIC``) calls the handler (``BENCH_HANDLER``, ``module:callable``, the same one Rebound's
  worker gets: ``bench.scenarios.failure_path:fail_once``) at attempt 0; on success it counts and acknowledges; on any
  exception it sends the record's key, value and two headers (``rebound.attempt``, ``rebound.due-at``) to the tier
  topic ``<BENCH_TOPIC>.retry.<delay>s`` on the same partition and moves on, the offset acknowledged from the send's
  callback (pipelined: forwards do not wait on each other);
- the tier agent writes the record into a RocksDB table (``rocksdb://``, Rebound's store options, one table, one
  changelog record) under the message key and puts (due, key) on its partition's heap in memory;
- a timer every ``BENCH_RELEASE_TICK_MS`` (10, Rebound's ``REBOUND_RELEASE_LINGER_MS``) pops what is due on the
  partitions this worker actively owns and sends release requests to ``<BENCH_TOPIC>.release`` (co-partitioned), up to
  ``BENCH_RELEASE_BATCH`` (64, as ``REBOUND_RELEASE_BATCH``) keys to a record;
- the release agent reads each key's entry, calls the handler at attempt 1 and deletes the entry (one changelog
  tombstone).

With ``BENCH_ATTEMPT_EVENTS=1`` (the default) every attempt also produces one small record to
``<BENCH_TOPIC>.attempts``, not awaited, as Rebound emits an attempt event per attempt (and ``bare.py`` one output per
input): the surface has them. ``0`` leaves them out.

``GET /metrics`` serves the counters ``failure-path`` reads, named as Rebound's (``rebound_attempts_total{tier,
outcome}``, ``rebound_parked_total``), and ``GET /ready`` answers 200 once the tables are recovered and every
partition of the main topic is actively assigned. The app is ``bench/baselines/_app.py``'s (Rebound's consumer
class, fetch wait, ``acks=all`` and batch size, as every baseline), with Faust's per-event monitor off as in
Rebound's worker; with ``BENCH_STOCK_FAUST=1`` (``failure-path``'s ``stock-faust``) it is stock Faust's
(``stock.py``: a plain ``faust.App``, Faust's consumer and producer path and its monitor, only the fetch wait set, the
same settings), which logs the classes it runs and stops if any is Rebound's.
"""

from __future__ import annotations

import heapq
import importlib
import os
import time
from collections import Counter
from functools import partial
from typing import Any

from faust.types import TP

from bench.baselines._app import make_app, raw_topic
from bench.baselines.retry_records import batches, decode_entry, decode_keys, encode_entry, encode_keys
from bench.baselines.stock import make_stock_app, watch_path
from rebound.settings import Settings
from tables.rocksdb_tuning import install as install_rocksdb_options

TOPIC = os.environ["BENCH_TOPIC"]
PARTITIONS = int(os.environ.get("BENCH_PARTITIONS", "4"))
DELAY_MS = int(float(os.environ.get("BENCH_RETRY_DELAY_S", "20")) * 1000)
RELEASE_TICK_S = float(os.environ.get("BENCH_RELEASE_TICK_MS", "10")) / 1000
RELEASE_BATCH = int(os.environ.get("BENCH_RELEASE_BATCH", "64"))
ATTEMPT_EVENTS = os.environ.get("BENCH_ATTEMPT_EVENTS", "1") != "0"
TIER = f"{DELAY_MS // 1000}s"

STOCK = os.environ.get("BENCH_STOCK_FAUST") == "1"
app = (make_stock_app if STOCK else partial(make_app, per_event_monitor=False))(
    store="rocksdb://",
    datadir=os.environ.get("BENCH_DATA_DIR") or None,
    table_standby_replicas=0,
    web_enabled=True,
    web_host="127.0.0.1",
    web_port=int(os.environ.get("BENCH_WEB_PORT", "6066")),
    web_router_enabled=False,
    web_tables_enabled=False,
    web_graph_enabled=False,
    web_stats_enabled=False,
    web_metrics_enabled=False,
)
source = raw_topic(app, TOPIC)
tier = raw_topic(app, f"{TOPIC}.retry.{TIER}")
release = raw_topic(app, f"{TOPIC}.release")
attempts = raw_topic(app, f"{TOPIC}.attempts")
RELEASE_NAME = release.get_topic_name()
parked = app.Table(
    "parked",
    default=None,
    partitions=PARTITIONS,
    key_type=bytes,
    value_type=bytes,
)
install_rocksdb_options(parked, Settings())

module_name, _, attribute = os.environ["BENCH_HANDLER"].partition(":")
handler = getattr(importlib.import_module(module_name), attribute)

counts: Counter[tuple[str, str]] = Counter()
parks = 0
due_heaps: dict[int, list[tuple[int, bytes]]] = {}


class Attempt:
    """What the handler is given (the fields of Rebound's ``RetryEvent`` that a handler reads)."""

    __slots__ = ("attempt", "headers", "key", "offset", "partition", "topic", "value")

    def __init__(
        self,
        key: bytes | None,
        value: bytes | None,
        headers: dict[str, bytes],
        partition: int,
        offset: int,
        attempt: int,
    ) -> None:
        self.key, self.value, self.headers = key, value, headers
        self.topic, self.partition, self.offset, self.attempt = TOPIC, partition, offset, attempt


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def attempted(key: bytes | None, tier_label: str, outcome: str, partition: int) -> None:
    counts[tier_label, outcome] += 1
    if ATTEMPT_EVENTS:
        await attempts.send(key=key, value=outcome.encode(), partition=partition)


def forwarded(event: Any, sent: Any) -> None:
    """The tier record's send ended: acknowledge the failed message's offset if it is in the tier."""
    if not sent.cancelled() and sent.exception() is None:
        event.ack()


@app.agent(source)
async def main(stream):  # type: ignore[no-untyped-def]
    async for event in stream.noack().events():
        message = event.message
        try:
            await handler(Attempt(message.key, message.value, {}, message.partition, message.offset, 0))
        except Exception:
            headers = [("rebound.attempt", b"1"), ("rebound.due-at", str(now_ms() + DELAY_MS).encode())]
            sent = await tier.send(key=message.key, value=message.value, headers=headers, partition=message.partition)
            sent.add_done_callback(partial(forwarded, event))
            await attempted(message.key, "main", "scheduled", message.partition)
            continue
        event.ack()
        await attempted(message.key, "main", "succeeded", message.partition)


@app.agent(tier)
async def park(stream):  # type: ignore[no-untyped-def]
    global parks  # noqa: PLW0603 - one worker process, one counter
    async for event in stream.events():
        message = event.message
        headers = list(message.headers or ())
        due_ms = int(dict(headers)["rebound.due-at"])
        parked[message.key] = encode_entry(due_ms, message.value, headers)
        heapq.heappush(due_heaps.setdefault(message.partition, []), (due_ms, message.key))
        parks += 1


@app.timer(RELEASE_TICK_S)
async def release_due() -> None:
    now = now_ms()
    owned: set[int] | None = None
    for partition, heap in due_heaps.items():
        if not heap or heap[0][0] > now:
            continue
        if owned is None:
            owned = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == RELEASE_NAME}
        if partition not in owned:
            continue
        keys = []
        while heap and heap[0][0] <= now:
            keys.append(heapq.heappop(heap)[1])
        for batch in batches(keys, RELEASE_BATCH):
            await release.send(key=batch[0], value=encode_keys(batch), partition=partition)


@app.agent(release)
async def release_requested(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        message = event.message
        for key in decode_keys(message.value):
            entry = parked.get(key)
            if entry is None:
                continue
            _, value, headers = decode_entry(entry)
            try:
                await handler(Attempt(key, value, dict(headers), message.partition, -1, 1))
                outcome = "succeeded"
            except Exception:
                outcome = "failed"
            del parked[key]
            await attempted(key, TIER, outcome, message.partition)


@app.page("/metrics")
async def metrics(web, request):  # type: ignore[no-untyped-def]
    lines = [
        f'rebound_attempts_total{{tier="{tier_label}",outcome="{outcome}"}} {value}'
        for (tier_label, outcome), value in sorted(counts.items())
    ]
    lines.append(f"rebound_parked_total {parks}")
    return web.text("\n".join(lines) + "\n", content_type="text/plain")


@app.page("/ready")
async def ready(web, request):  # type: ignore[no-untyped-def]
    wanted = {TP(TOPIC, partition) for partition in range(PARTITIONS)}
    recovered = app.tables.recovery.completed.is_set()
    ok = recovered and wanted <= set(app.assignor.assigned_actives()) and not app.rebalancing
    return web.text("ready\n" if ok else "not ready\n", status=200 if ok else 503)


if STOCK:
    watch_path(app)
