"""A small synchronous facade over aiokafka, for code that Spark calls synchronously (planning and tasks).

aiokafka is asyncio-only; Spark's Python workers call ``read``/``write`` as plain functions and iterate generators,
so each facade owns a private event loop and runs one coroutine at a time on it. aiokafka is already a Rebound
dependency, so the source adds no new client library.

Latest offsets are taken from ListOffsets *and* confirmed by the high watermark of a one-record fetch, because some
Kafka-compatible brokers (the embedded Tansu broker among them) answer ListOffsets(latest) with the base offset of
the last record batch + 1 instead of the high watermark, which would silently drop the tail of every batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ssl
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from pipeline.kafka_source.options import KafkaOptionError, TopicPartition

_JAVA_ALIASES = {
    # Java client name -> aiokafka keyword, where the mechanical "dots to underscores" rule is not enough.
    "sasl.plain.username": "sasl_plain_username",
    "sasl.plain.password": "sasl_plain_password",
    "max.poll.records": "max_poll_records",
}
_SSL_KEYS = ("ssl.cafile", "ssl.certfile", "ssl.keyfile", "ssl.password", "ssl.check.hostname")
_OWNED = {
    "bootstrap_servers",
    "group_id",
    "enable_auto_commit",
    "auto_offset_reset",
    "key_deserializer",
    "value_deserializer",
    "key_serializer",
    "value_serializer",
    "acks",
    "loop",
}


def client_kwargs(config: Mapping[str, str], client_class: type) -> dict[str, Any]:
    """Translate ``kafka.*`` options (Java client names) into keyword arguments of an aiokafka client class.

    ``security.protocol`` becomes ``security_protocol`` and so on, typed after the keyword's default value;
    ``ssl.cafile``/``ssl.certfile``/``ssl.keyfile`` build the ``ssl_context`` aiokafka wants. A name the aiokafka
    class does not accept is an error rather than silently ignored, because a dropped security setting would only
    show up as a confusing connection failure.
    """
    params = inspect.signature(client_class).parameters  # the class's signature is __init__'s without self
    kwargs: dict[str, Any] = {}
    ssl_opts = {k: v for k, v in config.items() if k in _SSL_KEYS}
    for name, raw in config.items():
        if name in _SSL_KEYS:
            continue
        kw = _JAVA_ALIASES.get(name, name.replace(".", "_").replace("-", "_"))
        if kw in _OWNED or kw not in params:
            raise KafkaOptionError(
                f"Kafka option '{name}' is not supported by the pykafka source's client ({client_class.__name__}); "
                f"supported: {', '.join(sorted(k.replace('_', '.') for k in params if k not in _OWNED))}"
            )
        default = params[kw].default
        kwargs[kw] = _typed(raw, default, name)
    if ssl_opts:
        context = ssl.create_default_context(cafile=ssl_opts.get("ssl.cafile"))
        if "ssl.certfile" in ssl_opts:
            context.load_cert_chain(ssl_opts["ssl.certfile"], ssl_opts.get("ssl.keyfile"), ssl_opts.get("ssl.password"))
        if ssl_opts.get("ssl.check.hostname", "true").lower() == "false":
            context.check_hostname = False
        kwargs["ssl_context"] = context
    return kwargs


def _typed(raw: str, default: Any, name: str) -> Any:
    try:
        if isinstance(default, bool):
            return raw.strip().lower() == "true"
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise KafkaOptionError(f"Kafka option '{name}' must be a number, got {raw!r}") from None
    return raw


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a synchronous aiokafka method that must be called from inside the running loop."""

        async def inside() -> Any:
            return fn(*args)

        return self.run(inside())

    def close(self) -> None:
        self.loop.close()


class KafkaReader:
    """Metadata, offsets and range reads for one bootstrap address (a consumer without a group)."""

    def __init__(self, bootstrap: str, config: Mapping[str, str] | None = None) -> None:
        from aiokafka import AIOKafkaConsumer

        self._loop = _Loop()
        kwargs = client_kwargs(config or {}, AIOKafkaConsumer)

        async def make() -> Any:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=bootstrap,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                **kwargs,
            )
            await consumer.start()
            return consumer

        self._consumer = self._loop.run(make())

    def __enter__(self) -> KafkaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._loop.run(self._consumer.stop())
        finally:
            self._loop.close()

    def topics(self) -> set[str]:
        return set(self._loop.run(self._consumer.topics()))

    def partitions(self, topics: Iterable[str]) -> list[TopicPartition]:
        existing = self.topics()
        out: list[TopicPartition] = []
        for topic in topics:
            if topic in existing:
                out.extend((topic, p) for p in sorted(self._consumer.partitions_for_topic(topic) or ()))
        return out

    def earliest(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        from aiokafka import TopicPartition as TP

        tps = list(tps)
        if not tps:
            return {}
        found = self._loop.run(self._consumer.beginning_offsets([TP(t, p) for t, p in tps]))
        return {(tp.topic, tp.partition): int(off) for tp, off in found.items()}

    def latest(self, tps: Iterable[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        """End offsets (the high watermark), confirmed by a fetch; see the module docstring for why."""
        from aiokafka import TopicPartition as TP

        tps = list(tps)
        if not tps:
            return {}
        listed = self._loop.run(self._consumer.end_offsets([TP(t, p) for t, p in tps]))
        ends = {(tp.topic, tp.partition): int(off) for tp, off in listed.items()}
        begins = self.earliest(tps)
        probe = [TP(t, p) for (t, p), end in ends.items() if end > begins.get((t, p), 0)]
        if not probe:
            return ends
        consumer = self._consumer
        self._loop.call(consumer.assign, probe)
        for tp in probe:
            self._loop.call(consumer.seek, tp, ends[(tp.topic, tp.partition)] - 1)
        deadline = time.monotonic() + timeout_s
        pending = set(probe)
        while pending and time.monotonic() < deadline:
            self._loop.run(consumer.getmany(*pending, timeout_ms=200))
            for tp in list(pending):
                hw = consumer.highwater(tp)
                if hw is not None:
                    ends[(tp.topic, tp.partition)] = max(ends[(tp.topic, tp.partition)], int(hw))
                    pending.discard(tp)
        self._loop.call(consumer.unsubscribe)
        return ends

    def read_range(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        *,
        poll_timeout_ms: int,
        fail_on_data_loss: bool,
        max_records: int = 2000,
    ) -> Iterator[list[Any]]:
        """Yield lists of aiokafka ``ConsumerRecord`` with ``start <= offset < end``, in offset order.

        Progress is measured with the consumer position, not with record counts, so gaps in the offsets
        (transaction markers, compaction) do not make the read wait for records that will never come.
        """
        from aiokafka import TopicPartition as TP

        from pipeline.kafka_source.planning import DATA_LOSS_HINT, DataLossError

        tp = TP(topic, partition)
        first = self.earliest([(topic, partition)]).get((topic, partition), 0)
        if start < first:
            message = f"{topic}-{partition}: offsets {start}..{first - 1} are no longer in Kafka. {DATA_LOSS_HINT}"
            if fail_on_data_loss:
                raise DataLossError(message)
            start = first
        if start >= end:
            return
        consumer = self._consumer
        self._loop.call(consumer.assign, [tp])
        self._loop.call(consumer.seek, tp, start)
        position = start
        last_progress = time.monotonic()
        while position < end:
            got = self._loop.run(consumer.getmany(tp, timeout_ms=500, max_records=max_records))
            records = [r for r in got.get(tp, []) if start <= r.offset < end]
            position = max(position, self._loop.run(consumer.position(tp)))
            if records:
                last_progress = time.monotonic()
                yield records
            elif (time.monotonic() - last_progress) * 1000 > poll_timeout_ms:
                message = (
                    f"{topic}-{partition}: no record between offset {position} and {end} arrived within "
                    f"kafkaConsumer.pollTimeoutMs={poll_timeout_ms}. {DATA_LOSS_HINT}"
                )
                if fail_on_data_loss:
                    raise DataLossError(message)
                return


class KafkaWriter:
    """An ``acks=all`` producer; :meth:`flush` raises the first send error so the task fails.

    Idempotence is off by default because not every Kafka-compatible broker implements InitProducerId (Tansu does
    not); turn it on with ``kafka.enable.idempotence=true`` against a real Kafka cluster.
    """

    def __init__(self, bootstrap: str, config: Mapping[str, str] | None = None) -> None:
        from aiokafka import AIOKafkaProducer

        self._loop = _Loop()
        kwargs = client_kwargs(config or {}, AIOKafkaProducer)

        async def make() -> Any:
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **kwargs)
            await producer.start()
            return producer

        self._producer = self._loop.run(make())
        self._pending: list[Any] = []
        self.sent = 0

    def __enter__(self) -> KafkaWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes | None]] | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        future = self._loop.run(
            self._producer.send(
                topic,
                value=value,
                key=key,
                partition=partition,
                headers=list(headers) if headers else None,
                timestamp_ms=timestamp_ms,
            )
        )
        self._pending.append(future)
        if len(self._pending) >= 1000:
            self.flush()

    def flush(self) -> list[Any]:
        """Wait for every pending send; raise if any failed (after all have settled)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        results = self._loop.run(asyncio.gather(*pending, return_exceptions=True))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(results)} Kafka sends failed; first: {errors[0]!r}") from errors[
                0
            ]
        self.sent += len(results)
        return list(results)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            try:
                self._loop.run(self._producer.stop())
            finally:
                self._loop.close()


def create_topics(bootstrap: str, topics: Mapping[str, int], config: Mapping[str, str] | None = None) -> None:
    """Create topics with explicit partition counts (existing ones are left alone)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    async def run() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **client_kwargs(config or {}, AIOKafkaAdminClient))
        await admin.start()
        try:
            for name, partitions in topics.items():
                with contextlib.suppress(TopicAlreadyExistsError):
                    await admin.create_topics([NewTopic(name, partitions, 1)])
        finally:
            await admin.close()

    asyncio.run(run())
