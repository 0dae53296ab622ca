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
import functools
import inspect
import logging
import ssl
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import errors as aiokafka_errors

from pipeline.kafka_source.options import KafkaOptionError, TopicPartition

log = logging.getLogger(__name__)

IDEMPOTENCE_UNAVAILABLE: tuple[type[BaseException], ...] = (
    aiokafka_errors.UnknownError,
    aiokafka_errors.UnsupportedVersionError,
    aiokafka_errors.ClusterAuthorizationFailedError,
)
"""What starting an idempotent producer raises when the broker cannot, or may not, hand out producer ids."""

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
    ``ssl.cafile``/``ssl.certfile``/``ssl.keyfile`` build the ``ssl_context`` aiokafka wants. A name no aiokafka
    client accepts is an error rather than silently ignored, because a dropped security setting would only show up
    as a confusing connection failure. A name that belongs to another client (``linger.ms`` given to a consumer) is
    skipped, as the Java clients do, because the jobs hand one set of common settings to consumers and producers.
    """
    params = inspect.signature(client_class).parameters  # the class's signature is __init__'s without self
    kwargs: dict[str, Any] = {}
    ssl_opts = {k: v for k, v in config.items() if k in _SSL_KEYS}
    for name, raw in config.items():
        if name in _SSL_KEYS:
            continue
        kw = _JAVA_ALIASES.get(name, name.replace(".", "_").replace("-", "_"))
        if kw not in _OWNED and kw not in params and kw in _other_clients_params():
            log.debug("Kafka option %r is a setting of another client than %s; skipped", name, client_class.__name__)
            continue
        if kw in _OWNED or kw not in params:
            raise KafkaOptionError(
                f"Kafka option '{name}' is not supported by the pykafka source's client ({client_class.__name__}); "
                f"supported: {', '.join(sorted(k.replace('_', '.') for k in params if k not in _OWNED))}"
            )
        default = params[kw].default
        kwargs[kw] = _typed(raw, default, name)
    # A TLS protocol without any ssl.* setting means "trust the system's CAs" (managed clusters with public
    # certificates), as for the Java client; aiokafka would instead refuse to start without an explicit context.
    if ssl_opts or str(kwargs.get("security_protocol", "")).upper() in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=ssl_opts.get("ssl.cafile"))
        if "ssl.certfile" in ssl_opts:
            context.load_cert_chain(ssl_opts["ssl.certfile"], ssl_opts.get("ssl.keyfile"), ssl_opts.get("ssl.password"))
        if ssl_opts.get("ssl.check.hostname", "true").lower() == "false":
            context.check_hostname = False
        kwargs["ssl_context"] = context
    return kwargs


@functools.cache
def _other_clients_params() -> frozenset[str]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    return frozenset(
        name
        for cls in (AIOKafkaConsumer, AIOKafkaProducer, AIOKafkaAdminClient)
        for name in inspect.signature(cls).parameters
    )


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


STALL_BACKOFF_S = 0.2
"""Pause between re-checks of a stalled read, so a broker that keeps failing is not asked in a tight loop."""

TRUNCATION_CONFIRM_S = 3.0
"""How long ListOffsets and the high watermark must both stay at or below a read's position before the offsets
after it are declared lost (capped by ``kafkaConsumer.pollTimeoutMs``): a new leader's end can briefly lag."""


class KafkaReadTimeoutError(TimeoutError):
    """Offsets Kafka still has did not arrive within ``kafkaConsumer.pollTimeoutMs``: an outage, not data loss."""


@dataclass
class _Stall:
    """A read that got no record at ``position``, and since when its log end has looked at or below it."""

    topic: str
    partition: int
    position: int
    end: int
    poll_timeout_ms: int
    waited_ms: float
    below_end_since: float | None


def _read_timeout(stall: _Stall, bounds: tuple[int, int] | None) -> KafkaReadTimeoutError:
    known = (
        f"Kafka still has offsets {bounds[0]}..{bounds[1] - 1}"
        if bounds is not None
        else "Kafka did not answer ListOffsets either"
    )
    return KafkaReadTimeoutError(
        f"{stall.topic}-{stall.partition}: no record between offset {stall.position} and {stall.end} arrived within "
        f"kafkaConsumer.pollTimeoutMs={stall.poll_timeout_ms}, and {known}: the broker is slow or unreachable, no data was "
        "lost, so failOnDataLoss does not apply. Raise the source option kafkaConsumer.pollTimeoutMs if the broker "
        "is just slow."
    )


class KafkaReader:
    """Metadata, offsets and range reads for one bootstrap address (a consumer without a group)."""

    def __init__(self, bootstrap: str, config: Mapping[str, str] | None = None) -> None:
        from aiokafka import AIOKafkaConsumer

        kwargs = client_kwargs(config or {}, AIOKafkaConsumer)
        self._loop = _Loop()
        self.read_committed = kwargs.get("isolation_level") == "read_committed"

        async def make() -> Any:
            # No automatic offset reset: a silent jump to the log start would skip records without anyone noticing;
            # read_range turns the out-of-range error into a data-loss decision (failOnDataLoss).
            consumer = AIOKafkaConsumer(
                bootstrap_servers=bootstrap,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="none",
                **kwargs,
            )
            try:
                await consumer.start()
            except BaseException:
                await consumer.stop()
                raise
            return consumer

        try:
            self._consumer = self._loop.run(make())
        except BaseException:
            self._loop.close()
            raise

    def __enter__(self) -> KafkaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the consumer; aiokafka's ``stop`` can raise ``CancelledError`` when a fetch was still pending (the
        fetch task it cancels), which is the consumer stopping as asked, not an error of the read."""
        try:
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run(self._consumer.stop())
        finally:
            self._loop.close()

    def topics(self) -> set[str]:
        return set(self._cluster().topics())

    def partitions(self, topics: Iterable[str]) -> list[TopicPartition]:
        cluster = self._cluster()
        existing = cluster.topics()
        out: list[TopicPartition] = []
        for topic in topics:
            if topic in existing:
                out.extend((topic, p) for p in sorted(cluster.partitions_for_topic(topic) or ()))
        return out

    def _cluster(self) -> Any:
        """Fresh metadata of every topic. ``consumer.partitions_for_topic`` reads the client's cached metadata, which
        holds only the topics the client asked about: on the librdkafka mock cluster it knew no partition of an
        existing topic, so a read found nothing to read (aiokafka has no public call that returns the fetched
        metadata, hence the private ``_client``)."""
        return self._loop.run(self._consumer._client.fetch_all_metadata())

    def earliest(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        from aiokafka import TopicPartition as TP

        tps = list(tps)
        if not tps:
            return {}
        found = self._loop.run(self._consumer.beginning_offsets([TP(t, p) for t, p in tps]))
        return {(tp.topic, tp.partition): int(off) for tp, off in found.items()}

    def latest(self, tps: Iterable[TopicPartition], timeout_s: float = 10.0) -> dict[TopicPartition, int]:
        """End offsets, confirmed by a fetch; see the module docstring for why.

        The end is the high watermark, or with ``kafka.isolation.level=read_committed`` the last stable offset: the
        records of a transaction still open are not readable yet, so a batch must end before them (as Spark's
        connector does) instead of waiting for them until ``kafkaConsumer.pollTimeoutMs``.
        """
        from aiokafka import TopicPartition as TP
        from aiokafka.errors import OffsetOutOfRangeError

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
            try:
                self._loop.run(consumer.getmany(*pending, timeout_ms=200))
            except OffsetOutOfRangeError as exc:
                # The last record aged out meanwhile: keep the listed end, which is then the log end.
                pending.difference_update(exc.args[0] if exc.args and isinstance(exc.args[0], dict) else pending)
                continue
            for tp in list(pending):
                key = (tp.topic, tp.partition)
                end = confirmed_end(
                    ends[key],
                    consumer.highwater(tp),
                    consumer.last_stable_offset(tp),
                    read_committed=self.read_committed,
                )
                if end is not None:
                    ends[key] = end
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

        Records that vanish under the read are data loss, decided by ``fail_on_data_loss`` like Spark's
        KafkaDataConsumer: the log start moved past the position (retention or deleted records), or the log end fell
        to or below it (a recreated topic, a truncated log). With ``false`` the lost offsets are logged and the read
        goes on from the log start, or stops when nothing of the range is left. Like Spark, a stall is checked
        against ListOffsets: a position Kafka still has is never data loss, so a slow or unreachable broker raises
        :class:`KafkaReadTimeoutError` after ``kafkaConsumer.pollTimeoutMs`` whatever ``failOnDataLoss`` says. A log
        end at or below the position is only believed when ListOffsets and the fetch's high watermark agree for
        :data:`TRUNCATION_CONFIRM_S`, because right after a clean leader change the new leader's high watermark can
        lag the old one's for a moment.
        """
        from aiokafka import TopicPartition as TP
        from aiokafka.errors import OffsetOutOfRangeError

        tp = TP(topic, partition)
        consumer = self._consumer
        self._loop.call(consumer.assign, [tp])
        position = start
        self._loop.call(consumer.seek, tp, position)
        last_progress = time.monotonic()
        below_end_since: float | None = None
        while position < end:
            out_of_range = False
            try:
                got = self._loop.run(consumer.getmany(tp, timeout_ms=500, max_records=max_records))
            except OffsetOutOfRangeError:
                got, out_of_range = {}, True
            records = [r for r in got.get(tp, []) if position <= r.offset < end]
            if records and records[0].offset > position:
                # A gap is normal (compaction, transaction markers) unless the log start moved past the position.
                log_start = self.earliest([(topic, partition)]).get((topic, partition), 0)
                if log_start > position:
                    recover_lost_offsets(
                        topic,
                        partition,
                        position,
                        end,
                        log_start,
                        None,
                        fail_on_data_loss=fail_on_data_loss,
                        first_record=records[0].offset,
                    )
            if not out_of_range:
                moved = max(position, self._loop.run(consumer.position(tp)))
                if records or moved > position:
                    position, last_progress, below_end_since = moved, time.monotonic(), None
                    if records:
                        yield records
                    continue
            high_watermark = None if out_of_range else consumer.highwater(tp)
            stalled = out_of_range or (high_watermark is not None and int(high_watermark) <= position)
            waited_ms = (time.monotonic() - last_progress) * 1000
            if not stalled and waited_ms <= poll_timeout_ms:
                continue
            stall = _Stall(topic, partition, position, end, poll_timeout_ms, waited_ms, below_end_since)
            resume = self._resolve_stall(tp, stall, high_watermark, fail_on_data_loss=fail_on_data_loss)
            below_end_since = stall.below_end_since
            if resume is not None:  # data loss handled: go on from there (or stop at the end)
                position = resume
                if position < end:
                    self._loop.call(consumer.seek, tp, position)
                    last_progress = time.monotonic()
                continue
            # Kafka still has the position (or its end may yet catch up): wait a little and fetch it again, without
            # counting this as progress, so a broker that keeps failing still ends at kafkaConsumer.pollTimeoutMs.
            time.sleep(STALL_BACKOFF_S)
            if out_of_range:
                self._loop.call(consumer.seek, tp, position)

    def _resolve_stall(
        self, tp: Any, stall: _Stall, high_watermark: int | None, *, fail_on_data_loss: bool
    ) -> int | None:
        """Where a read that got no record goes on after data loss, ``None`` to fetch again at the same position;
        raises :class:`KafkaReadTimeoutError` once ``kafkaConsumer.pollTimeoutMs`` passed with nothing lost."""
        timed_out = stall.waited_ms > stall.poll_timeout_ms
        bounds = self._log_bounds_within(tp, max(1.0, stall.poll_timeout_ms / 1000))
        if bounds is None:  # ListOffsets does not answer either: the broker is unreachable, nothing is known lost
            if timed_out:
                raise _read_timeout(stall, None)
            return None
        log_start, listed_end = bounds
        log_end = listed_end if high_watermark is None else max(listed_end, int(high_watermark))
        now = time.monotonic()
        if log_start <= stall.position < log_end:
            stall.below_end_since = None
            if timed_out:
                raise _read_timeout(stall, (log_start, log_end))
            return None
        if stall.position >= log_end:
            if stall.below_end_since is None:
                stall.below_end_since = now
            if now - stall.below_end_since < min(TRUNCATION_CONFIRM_S, stall.poll_timeout_ms / 1000):
                return None
        stall.below_end_since = None
        return recover_lost_offsets(
            stall.topic,
            stall.partition,
            stall.position,
            stall.end,
            log_start,
            log_end,
            fail_on_data_loss=fail_on_data_loss,
        )

    def release(self) -> None:
        """Drop the assignment (and the records prefetched for it) so a pooled reader idles without buffers."""
        self._loop.call(self._consumer.unsubscribe)

    def _log_bounds_within(self, tp: Any, timeout_s: float) -> tuple[int, int] | None:
        """The log start and end of one partition from ListOffsets, to decide whether a stalled read lost records;
        ``None`` when the broker does not answer in time (an outage tells nothing about data loss)."""

        async def bounds() -> tuple[int, int]:
            found = await self._consumer.beginning_offsets([tp])
            ends = await self._consumer.end_offsets([tp])
            return int(found[tp]), int(ends[tp])

        try:
            result: tuple[int, int] = self._loop.run(asyncio.wait_for(bounds(), timeout_s))
        except (TimeoutError, aiokafka_errors.KafkaError) as exc:
            log.debug("ListOffsets for %s failed: %r", tp, exc)
            return None
        return result

    def offsets_for_times(
        self,
        times: Mapping[TopicPartition, int],
        earliest: Mapping[TopicPartition, int],
        latest: Mapping[TopicPartition, int],
        *,
        timeout_s: float = 10.0,
    ) -> dict[TopicPartition, int | None]:
        """The first offset whose record timestamp is at or after each partition's time (``None``: no such record).

        The broker's ListOffsets answer is checked against the records and replaced by a binary search when it does
        not hold (see :mod:`pipeline.kafka_source.timestamps`); ``latest`` must be the confirmed end offsets.
        """
        from aiokafka import TopicPartition as TP

        from pipeline.kafka_source.timestamps import offset_for_time

        if not times:
            return {}
        broker_error: str | None = None
        answers: dict[TopicPartition, int | None] = {}
        try:
            found = self._loop.run(
                asyncio.wait_for(
                    self._consumer.offsets_for_times({TP(t, p): ts for (t, p), ts in times.items()}), timeout_s
                )
            )
            answers = {
                (tp.topic, tp.partition): (None if got is None else int(got.offset)) for tp, got in found.items()
            }
        except Exception as exc:  # an unsupported or failing ListOffsets: the search answers alone
            broker_error = repr(exc)
        resolved: dict[TopicPartition, int | None] = {}
        corrected = []
        try:
            for tp, target in sorted(times.items()):
                first, end = earliest[tp], latest[tp]

                def fetch(offset: int, tp: TopicPartition = tp, end: int = end) -> Any:
                    return self.first_record_at(tp, offset, end, timeout_s=timeout_s)

                def fetch_past_end(offset: int, tp: TopicPartition = tp) -> Any:
                    # The broker's answer past the snapshot: a record that arrived since, or a wrong offset past
                    # the log end that no fetch will ever answer (hence the short wait).
                    try:
                        return self.first_record_at(tp, offset, offset + 1, timeout_s=min(timeout_s, 2.0))
                    except TimeoutError:
                        return None

                lookup = offset_for_time(target, answers.get(tp), first, end, fetch, fetch_past_end)
                resolved[tp] = lookup.offset
                if lookup.corrected and broker_error is None:
                    corrected.append(f"{tp[0]}-{tp[1]}@{target}: broker {answers.get(tp)}, records {lookup.offset}")
        finally:
            self._loop.call(self._consumer.unsubscribe)
        if broker_error is not None:
            log.warning("offsets-for-times failed on the broker (%s); found the offsets from the records", broker_error)
        elif corrected:
            log.warning(
                "The broker's offsets-for-times answer did not match the record timestamps and was corrected: %s",
                "; ".join(corrected),
            )
        return resolved

    def first_record_at(self, tp: TopicPartition, offset: int, end: int, *, timeout_s: float = 10.0) -> Any:
        """The offset and timestamp of the first record at or after ``offset`` and below ``end`` (``None``: none).

        One fetch of one record; gaps (transaction markers, compacted records) are skipped by following the
        consumer position, as in :meth:`read_range`.
        """
        from aiokafka import TopicPartition as TP
        from aiokafka.errors import OffsetOutOfRangeError

        from pipeline.kafka_source.timestamps import Stamp

        if offset >= end:
            return None
        part = TP(*tp)
        consumer = self._consumer
        self._loop.call(consumer.assign, [part])
        self._loop.call(consumer.seek, part, offset)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                got = self._loop.run(consumer.getmany(part, timeout_ms=200, max_records=1))
            except OffsetOutOfRangeError:
                # Retention moved the log start past the offset during the search: the first record at or after
                # it is now the first of the log (a time option's search tolerates that; nothing is read here).
                log_start = self.earliest([tp]).get(tp, offset)
                if log_start <= offset:  # not the log start, then: past the end, so nothing below ``end``
                    return None
                offset = log_start
                if offset >= end:
                    return None
                self._loop.call(consumer.seek, part, offset)
                continue
            records = [r for r in got.get(part, []) if offset <= r.offset < end]
            if records:
                return Stamp(int(records[0].offset), int(records[0].timestamp))
            if self._loop.run(consumer.position(part)) >= end:
                return None
        raise TimeoutError(
            f"{tp[0]}-{tp[1]}: no record at or after offset {offset} (below {end}) arrived within {timeout_s}s "
            "while finding an offset for a time option"
        )


def confirmed_end(
    listed: int, high_watermark: int | None, last_stable: int | None, *, read_committed: bool
) -> int | None:
    """The end offset of a partition from ListOffsets and a fetch response (``None``: the fetch has not answered).

    The larger of the two wins because some brokers (Tansu) under-report ListOffsets(latest). Under read_committed
    the fetch's value is the last stable offset, never the high watermark, which would put the records of a
    transaction still open into the batch.
    """
    fetched = last_stable if read_committed else high_watermark
    if fetched is None:
        return None
    return max(listed, int(fetched))


def _data_loss_hint() -> str:
    from pipeline.kafka_source.planning import DATA_LOSS_HINT

    return DATA_LOSS_HINT


def _data_loss_error(message: str) -> Exception:
    from pipeline.kafka_source.planning import DataLossError

    return DataLossError(message)


def recover_lost_offsets(
    topic: str,
    partition: int,
    position: int,
    end: int,
    log_start: int,
    log_end: int | None,
    *,
    fail_on_data_loss: bool,
    first_record: int | None = None,
) -> int:
    """Decide what a read at ``position`` (planned up to ``end``) lost, and where it goes on; ``end`` means stop.

    Raises :class:`~pipeline.kafka_source.planning.DataLossError` with ``fail_on_data_loss``; otherwise logs the
    topic-partition and the skipped offsets, as Spark's KafkaDataConsumer does with ``failOnDataLoss=false``.
    """
    if position < log_start:
        resume = min(log_start, end)
        message = (
            f"{topic}-{partition}: offsets {position}..{resume - 1} are no longer in Kafka (the log now starts at "
            f"{log_start}; aged out by retention or deleted)."
        )
        if first_record is not None:
            message += f" The first record returned has offset {first_record}."
    elif log_end is not None and log_end <= position:
        resume = end
        message = (
            f"{topic}-{partition}: offset {position} is past the end of the log ({log_end}), so offsets "
            f"{position}..{end - 1} are gone (was the topic deleted and recreated, or its log truncated?)."
        )
    else:
        return position
    if fail_on_data_loss:
        raise _data_loss_error(f"{message} {_data_loss_hint()}")
    log.warning("%s Skipping offsets %d..%d because failOnDataLoss is false.", message, position, resume - 1)
    return resume


class _DropInitProducerIdErrors(logging.Filter):
    """aiokafka logs a refused InitProducerId at ERROR before raising it; while the writer only probes for
    idempotence, that refusal is expected and reported by the writer's own warning instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "InitProducerId" not in record.getMessage()


class KafkaWriter:
    """An ``acks=all``, idempotent producer; :meth:`flush` raises the first send error so the task fails.

    Idempotence (the broker drops a batch the producer retried after a lost acknowledgement) is on unless the
    settings say ``enable.idempotence=false``. When it was not asked for explicitly and the broker cannot start an
    idempotent producer — InitProducerId unsupported or failing, as on the embedded Tansu broker (0.6.0), which
    answers it with an unknown error — the writer says so in a warning and falls back to a plain ``acks=all``
    producer: a retried batch may then be written twice. ``enable.idempotence=true`` makes that failure fatal.
    """

    def __init__(self, bootstrap: str, config: Mapping[str, str] | None = None) -> None:
        from aiokafka import AIOKafkaProducer

        self._loop = _Loop()
        kwargs = client_kwargs(config or {}, AIOKafkaProducer)
        explicit = "enable_idempotence" in kwargs
        kwargs.setdefault("enable_idempotence", True)

        async def make(options: dict[str, Any]) -> Any:
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **options)
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            return producer

        self.idempotent = bool(kwargs["enable_idempotence"])
        sender_log = logging.getLogger("aiokafka.producer.sender")
        probing = _DropInitProducerIdErrors() if not explicit else None
        if probing:  # the warning below reports a refusal once, in words an operator can act on
            sender_log.addFilter(probing)
        try:
            self._producer = self._loop.run(make(kwargs))
        except IDEMPOTENCE_UNAVAILABLE as exc:
            if explicit:
                self._loop.close()
                raise
            log.warning(
                "Kafka at %s cannot start an idempotent producer (%s: %s); writing without idempotence, so a batch "
                "retried after a lost acknowledgement may be written twice. Set enable.idempotence=false to silence "
                "this, or =true to fail instead.",
                bootstrap,
                type(exc).__name__,
                exc,
            )
            self.idempotent = False
            self._producer = self._loop.run(make({**kwargs, "enable_idempotence": False}))
        finally:
            if probing:
                sender_log.removeFilter(probing)
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

    def settle(self) -> list[Any]:
        """Wait for every pending send and return, in send order, each one's record metadata or its exception, so a
        caller that records what was delivered can record the successes even when some sends failed."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        results = list(self._loop.run(asyncio.gather(*pending, return_exceptions=True)))
        self.sent += sum(not isinstance(r, BaseException) for r in results)
        return results

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
