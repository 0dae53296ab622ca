"""Frozen, validated settings: what the ``REBOUND_*`` environment variables configure, one field each.

Pure: this module validates the values it is given and reads neither the environment nor a ``.env`` file;
``app/environment.py`` reads those where the worker starts and passes them to :func:`load_settings`. Validation
happens once, at start-up, so a bad value stops the worker with a message naming the variable instead of surfacing
later as a misrouted message (``faust -A app worker`` prints it on one line, without a traceback, and exits with
status 78: ``app/startup.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from rebound.breaker import BreakerConfig
from rebound.errors import ConfigurationError
from rebound.http_mapping import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_PERMANENT_STATUSES,
    DEFAULT_RETRYABLE_STATUSES,
    StatusMapping,
    check_handler_url,
    looks_like_url,
)
from rebound.limiter import LimitRange
from rebound.pacing import PacingConfig, default_burst, min_burst
from rebound.policy import RetryPolicy, parse_duration_ms, parse_sequence
from rebound.routing import Classification, ErrorClassifier

ENV_PREFIX = "REBOUND_"
HANDLER_CANCEL_GRACE_S = 1.0
"""How long a handler cancelled after its timeout is waited for before it is abandoned."""
SHUTDOWN_FINISH_S = 4.0
"""The end of ``REBOUND_SHUTDOWN_TIMEOUT`` kept for what follows the handler work at a stop: the last commit, the
tables' and the producer's flush, leaving the group, closing the event loop (about 2 s measured with a healthy
broker; mode alone sleeps up to 2 s closing its loop)."""
RELEASE_WINDOW_PER_CALL = 16
"""Default release requests in flight per partition, per handler call the worker may run at once."""
MAX_CONCURRENCY = 4096
DEFAULT_INITIAL_CONCURRENCY = 16
"""``REBOUND_CONCURRENCY=auto``'s limit after its first probe, unless set: small enough not to swamp a service that
turns out slow, and the limit's square-root growth reaches 64 from it in 8 windows (4 s with 10 ms calls)."""
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]+")
MAX_TOPIC_CHARS = 200  # Kafka allows 249; Rebound appends suffixes such as ".retry.30m" and ".failed"
MAX_APP_ID_CHARS = 200
HANDLER_FORM = "package.module:callable"
HANDLER_EXAMPLE = f"{ENV_PREFIX}HANDLER=myservice.handlers:handle"
HANDLER_PATTERN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""``REBOUND_HANDLER``'s form: a dotted module path of identifiers (no relative ``.mod``, no empty ``a..b``), ``:``,
and the function's name."""
STORE_SCHEMES = ("rocksdb", "memory")
"""The table stores Rebound's tables work with (``tables/``): RocksDB, and memory for tests."""


def _names(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def reveal(secret: SecretStr | None) -> str:
    """A secret's text, or ``""`` when unset: read only where it is used (an HMAC), so settings never print it."""
    return secret.get_secret_value() if secret is not None else ""


class Settings(BaseModel):
    """Field ``x`` is ``REBOUND_X``; values arrive as the environment gives them (text) or already typed."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True)

    broker: str = Field("kafka://127.0.0.1:9092", description="Kafka bootstrap URL(s), comma-separated")
    app_id: str = Field("rebound", description="Faust app id, also the consumer group")
    main_topics: str = Field("items", description="comma-separated main topics")
    retry_sequence: str = Field("5m,5m,30m,30m,30m,1h", description="delays, units ms s m h d, or exp:1s..1h")
    max_retry_duration: str = Field("", description="total cap from first receipt; empty = none")
    handler: str | None = Field(
        None,
        description=(
            f"required by the worker, no default: the handler it calls with each event, as {HANDLER_FORM} (an async "
            "function taking one event, in a module the worker's Python imports: installed, or on PYTHONPATH), for "
            f"example {HANDLER_EXAMPLE}, or an http:// or https:// URL each event is POSTed to (docs/push-handlers.md); "
            "unset or unusable, the worker stops before connecting (exit status 78)"
        ),
    )
    handler_timeout: str = Field("30s", description="a handler running longer fails retryably")
    retry_after_max: str = Field(
        "1h",
        description=(
            "the longest Retry-After (RetryableError.retry_after_s) a retry waits for; a longer one is capped at "
            "this and retried as usual (raise it for longer maintenance windows). Tiers accept due times this far ahead"
        ),
    )
    http_token: SecretStr | None = Field(None, description="HTTP push handler: bearer token; unset or empty = none")
    http_ca_file: str = Field("", description="HTTP push handler: CA bundle (PEM) for https; empty = the system's")
    http_verify_tls: bool = Field(True, description="HTTP push handler: verify the service's TLS certificate")
    http_retryable_statuses: str = Field(
        DEFAULT_RETRYABLE_STATUSES, description="HTTP push handler: statuses retried (exact, or a class like 5xx)"
    )
    http_permanent_statuses: str = Field(
        DEFAULT_PERMANENT_STATUSES, description="HTTP push handler: statuses dead-lettered at once"
    )
    http_max_header_bytes: int = Field(
        DEFAULT_MAX_HEADER_BYTES,
        ge=1024,
        description="HTTP push handler: the largest request header section sent; a larger record is permanent",
    )
    permanent_errors: str = Field("", description="comma-separated exception class names treated as permanent")
    retryable_errors: str = Field("", description="comma-separated exception class names treated as retryable")
    unknown_errors: Literal["retryable", "permanent"] = Field("retryable", description="class of other exceptions")
    release_mode: Literal["in-place", "republish"] = Field("in-place", description="how a due message is retried")
    web_port: int = Field(6066, ge=1, le=65535)
    web_host: str = "127.0.0.1"
    web_enabled: bool = True
    data_dir: str = "./data"
    store: str = Field("rocksdb://", description="table store URL; memory:// only for tests")
    admin_token: SecretStr | None = Field(None, description="bearer token of the admin actions; unset: they are off")
    header_secret: SecretStr | None = Field(None, description="HMAC secret signing re-published retry headers")
    republish_ttl: str = Field("1d", description="how long a re-published record's signature is trusted")
    failed_retention: str = Field("30d", description="retention of the failed topics Rebound creates")
    attempts_retention: str = Field("7d", description="retention of the attempts topic Rebound creates")
    show_payloads: bool = False
    partitions: int | None = Field(None, ge=1, description="partitions of main topics created by Rebound")
    replication_factor: int = Field(1, ge=1, description="replication of the topics Rebound creates")
    provision_topics: bool = Field(True, description="create missing tier/failed/attempts topics at start-up")
    timer_interval: float = Field(0.2, gt=0, le=60, description="seconds between release ticks")
    release_linger_ms: int = Field(
        10,
        ge=0,
        le=1000,
        description=(
            "shortest time between two release ticks: messages that come due meanwhile go out together, one batch "
            "per partition instead of one each (a release is at most this much later; 0 ticks at every due time)"
        ),
    )
    release_batch: int = Field(
        64,
        ge=1,
        le=1000,
        description=(
            "release requests one record carries at most: a tick's due messages of one partition go out this many "
            "to a record, each released in its own key's lane, the record acknowledged once all are done; 1 = one "
            "record per release"
        ),
    )
    release_rate: str = Field(
        "",
        description=(
            "releases per second per worker (a number, e.g. 50 or 0.5), so a recovered dependency is not flooded when "
            "many retries come due at once; empty = unlimited. Pacing only delays: the release lateness shows it"
        ),
    )
    release_burst: int | None = Field(
        None,
        ge=1,
        description=(
            "with REBOUND_RELEASE_RATE: releases allowed at once after a quiet spell; default a tenth of a second's "
            "worth (or, if more, the least accepted: below), at least 1. Refused at start-up if "
            "smaller than what accrues between two release ticks, REBOUND_RELEASE_RATE x REBOUND_RELEASE_LINGER_MS, "
            "plus 1 (the fraction of a release a tick carries over): it would silently cap releases below the rate"
        ),
    )
    release_ramp: str = Field(
        "",
        description=(
            "with REBOUND_RELEASE_RATE: after the circuit breaker closes, the allowed rate climbs from a tenth of "
            "REBOUND_RELEASE_RATE to all of it over this duration (e.g. 1m); empty = no ramp"
        ),
    )
    rebalance_timeout: float = Field(60.0, gt=0)
    session_timeout: float = Field(60.0, gt=0)
    heartbeat_interval: float = Field(3.0, gt=0)
    commit_interval: float = Field(2.8, gt=0)
    fetch_max_wait_ms: int = Field(1500, ge=1, le=60_000, description="consumer fetch long-poll wait (Faust: 1500)")
    isolation_level: Literal["read_committed", "read_uncommitted"] = Field(
        "read_committed",
        description=(
            "what the worker reads of a topic written by transactional producers: read_committed (the records of "
            "committed transactions only, up to the last stable offset; an open transaction holds reading there) or "
            "read_uncommitted (every record, aborted ones included, up to the high watermark)"
        ),
    )
    succeeded_events: Literal["all", "retries"] = Field(
        "all", description="which successes get an attempt event: every one, or only those on a retry"
    )
    concurrency: int | Literal["auto"] = Field(
        64,
        description=(
            "handler calls in flight per worker; one key at a time, in offset order. auto: adaptive, between "
            "REBOUND_CONCURRENCY_MIN and _MAX from the calls' latency and drops (docs/design.md#adaptive-concurrency)"
        ),
    )
    concurrency_min: int = Field(
        2, ge=1, le=4096, description="with REBOUND_CONCURRENCY=auto: the lowest limit, and the one its probes run at"
    )
    concurrency_max: int = Field(
        256,
        ge=1,
        le=4096,
        description="with REBOUND_CONCURRENCY=auto: the highest limit (REBOUND_RELEASE_MAX_IN_FLIGHT's default is 16 x it)",
    )
    concurrency_initial: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="with REBOUND_CONCURRENCY=auto: the limit after the first probe; default 16, within the range",
    )
    partition_buffer: int = Field(
        512,
        ge=1,
        description=(
            "records one partition may have taken and not finished before it is paused (on the release topic, "
            "releases: a record of several counts each)"
        ),
    )
    release_max_in_flight: int | None = Field(
        None,
        ge=1,
        description=(
            "release requests of one partition sent and not yet confirmed; more due messages wait in memory until "
            "some are. Default 16 x REBOUND_CONCURRENCY (1024 with its default; 16 x REBOUND_CONCURRENCY_MAX with "
            "auto): at least the concurrency, so one "
            "partition alone keeps every handler busy, with room for the timer's refill and for a key's requests, "
            "which run one at a time; it also bounds what a partition re-sends when its requests look lost"
        ),
    )
    revoke_drain: float | None = Field(
        None,
        ge=0,
        description=(
            "seconds a revocation or shutdown keeps starting records already taken before dropping the rest (read "
            "again by the next owner); default a quarter of the rebalance timeout, within what the handler timeout "
            "leaves of it; 0 drops them at once. At a shutdown it also ends when REBOUND_SHUTDOWN_TIMEOUT cuts "
            "handler work short"
        ),
    )
    shutdown_timeout: float = Field(
        25.0,
        gt=0,
        description=(
            "the most a stop (SIGTERM, Ctrl-C) takes, signal to exit: handler work gets all but the last "
            f"{SHUTDOWN_FINISH_S:g} s, then queued records are dropped and running calls cut short, unacknowledged (they "
            "run again on the partition's next owner); commits and flushes use the rest, and a worker still there at "
            "the end exits at once. The default fits Kubernetes' 30 s grace period"
        ),
    )
    ordering: Literal["none", "key"] = Field(
        "none",
        description=(
            "key: a key's later messages wait, durably, behind its message waiting for a retry and run in order once "
            "it settles; none: they run at once (non-blocking retry)"
        ),
    )
    ordering_dead_letter_blocks: bool = Field(
        False,
        description="key-ordered mode: a dead-lettered message keeps blocking its key until an operator unblocks it",
    )
    breaker_enabled: bool = Field(False, description="pause consumption while most handler calls fail retryably")
    breaker_window: str = Field("30s", description="sliding window the breaker's failure ratio is measured over")
    breaker_min_calls: int = Field(20, ge=1, description="the breaker never opens on fewer calls in its window")
    breaker_failure_ratio: float = Field(0.5, gt=0, le=1, description="retryable failures / calls that open it")
    breaker_probe_interval: str = Field("5s", description="wait after opening before the first probe call")
    breaker_probe_max_interval: str = Field("5m", description="the probe interval doubles after each failed probe")
    max_pending_per_key: int = Field(
        100_000,
        ge=1,
        description=(
            "parked (or held) messages one key may have; more are dead-lettered (key-backlog-full). Each parked message"
            " is a record of its own, so this bounds one key's share of the backlog, not a cost"
        ),
    )
    max_held_per_key: int = Field(
        1000,
        ge=1,
        description=(
            "key-ordered mode: messages one key may hold behind its blocking one; more are dead-lettered "
            "(key-backlog-full). The key's index lists held origins, so holding one more rewrites that list"
        ),
    )
    ended_memory: str = Field(
        "1h",
        description=(
            "how long the state table remembers a retried message that ended (or whose retry is on its way to a "
            "tier), so a redelivered first try or a late duplicate tier record does not start it again; at least "
            "the longest time a main or tier record can stay uncommitted after it was handled (docs/guarantees.md)"
        ),
    )
    ended_memory_per_key: int = Field(
        64,
        ge=1,
        description="ended messages remembered per key at most (about 70 bytes each in the key's index record)",
    )
    producer_max_request_bytes: int = Field(
        1_048_576, ge=1024, description="largest record Rebound produces (Kafka's max.request.size default)"
    )
    producer_max_batch_bytes: int = Field(
        16384, ge=1, description="producer batch size; 1 on the embedded broker, whose ListOffsets counts batches"
    )
    rocksdb_write_buffer_mb: int = Field(8, ge=1)
    rocksdb_block_cache_mb: int = Field(
        32,
        ge=1,
        description=(
            "RocksDB block cache (data, index and filter blocks) of the whole worker: one cache shared by every "
            "partition database of both tables, no longer one per partition"
        ),
    )
    rocksdb_write_buffer_total_mb: int = Field(
        128,
        ge=1,
        description=(
            "memtables of all partition databases together; past it the database being written flushes. Charged to "
            "the shared cache, whose capacity is this plus REBOUND_ROCKSDB_BLOCK_CACHE_MB"
        ),
    )
    rocksdb_bloom_bits_per_key: int = Field(
        10, ge=0, le=32, description="whole-key Bloom filter bits per key (10: about 1% false positives); 0 = none"
    )
    rocksdb_compression: Literal["none", "snappy", "lz4", "zstd"] = Field(
        "lz4", description="compression of RocksDB blocks above the bottommost level"
    )
    rocksdb_bottommost_compression: Literal["none", "snappy", "lz4", "zstd"] = Field(
        "zstd", description="compression of the bottommost level, which holds most of the data"
    )
    rocksdb_max_open_files: int = Field(
        256, ge=20, le=1_000_000, description="SST files each partition database keeps open (Faust: 90% of the limit)"
    )

    @field_validator("concurrency", mode="before")
    @classmethod
    def _number_or_auto(cls, value: object) -> object:
        """``auto`` in any case, or a number of calls; checked here, so an error names the variable without the
        union's branches."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            number = int(str(value).strip())
        except ValueError:
            raise ValueError("must be a number of handler calls (1 to 4096) or auto") from None
        if number < 1:
            raise ValueError("must be greater than or equal to 1")
        if number > MAX_CONCURRENCY:
            raise ValueError(f"must be less than or equal to {MAX_CONCURRENCY}")
        return number

    @model_validator(mode="after")
    def _valid_concurrency_range(self) -> Settings:
        self.concurrency_range  # noqa: B018 - validates the combination once, at start-up
        return self

    @field_validator("retry_sequence")
    @classmethod
    def _valid_sequence(cls, value: str) -> str:
        parse_sequence(value)
        return value

    @field_validator(
        "max_retry_duration",
        "handler_timeout",
        "republish_ttl",
        "failed_retention",
        "attempts_retention",
        "ended_memory",
        "breaker_window",
        "breaker_probe_interval",
        "breaker_probe_max_interval",
        "release_ramp",
        "retry_after_max",
    )
    @classmethod
    def _valid_duration(cls, value: str, info: object) -> str:
        name = getattr(info, "field_name", "")
        if value.strip():
            parse_duration_ms(value, variable=f"{ENV_PREFIX}{name.upper()}")
        return value

    @field_validator("ended_memory")
    @classmethod
    def _ended_memory_given(cls, value: str) -> str:
        """Unlike the optional durations, this one has no "none": every settle reads it, so an empty or zero value
        would fail each release (repeated dead letters) or remember nothing; refused at start-up instead."""
        if not value.strip():
            raise ValueError(f"{ENV_PREFIX}ENDED_MEMORY must be a duration (for example 1h), not empty")
        if parse_duration_ms(value, variable=f"{ENV_PREFIX}ENDED_MEMORY") <= 0:
            raise ValueError(f"{ENV_PREFIX}ENDED_MEMORY must be longer than 0 (for example 1h)")
        return value

    @field_validator("release_rate")
    @classmethod
    def _valid_release_rate(cls, value: str) -> str:
        text = value.strip().lower()
        if text in ("", "unlimited"):
            return value
        try:
            rate = float(text)
        except ValueError:
            rate = math.nan
        if not math.isfinite(rate) or rate <= 0:
            raise ConfigurationError(
                f"{ENV_PREFIX}RELEASE_RATE: {value.strip()[:60]!r} must be a number of releases per second greater "
                "than 0 (e.g. 50 or 0.5), or empty for unlimited"
            )
        return value

    @field_validator("broker")
    @classmethod
    def _kafka_broker(cls, value: str) -> str:
        """Bootstrap servers as ``kafka://host:port`` (or ``aiokafka://``, or a bare ``host:port``), comma- or
        semicolon-separated: another scheme (``http://``) otherwise got as far as Faust's transport set-up. Given back
        without empty entries or spaces (``;``-separated): Faust's list makes an empty entry (a trailing comma)
        ``kafka:``, which aiokafka reads as ``localhost:9092``, another cluster than the one configured."""
        parts = [part.strip() for part in value.replace(";", ",").split(",") if part.strip()]
        if not parts:
            raise ConfigurationError(f"{ENV_PREFIX}BROKER: no bootstrap server (kafka://host:port)")
        for part in parts:
            scheme = part.split("://", 1)[0] if "://" in part else None
            if scheme is not None and scheme not in ("kafka", "aiokafka"):
                raise ConfigurationError(
                    f"{ENV_PREFIX}BROKER: {part[:80]!r} is not a Kafka URL (kafka://host:port, or host:port)"
                )
        return ";".join(parts)

    @field_validator("app_id")
    @classmethod
    def _valid_app_id(cls, value: str) -> str:
        """The app id names topics (``<app id>.attempts``) and goes into every retry header: it must be a topic name."""
        if not _TOPIC_NAME.fullmatch(value) or len(value) > MAX_APP_ID_CHARS:
            raise ConfigurationError(
                f"{ENV_PREFIX}APP_ID: {value[:60]!r} must be 1 to {MAX_APP_ID_CHARS} of the characters a Kafka topic "
                "name allows (letters, digits, '.', '_', '-')"
            )
        return value

    @field_validator("admin_token", "header_secret", "http_token")
    @classmethod
    def _utf8_secret(cls, value: SecretStr | None, info: object) -> SecretStr | None:
        """A secret read with undecodable bytes cannot be hashed: refuse it at start-up, not on the first record."""
        if value is not None:
            try:
                value.get_secret_value().encode("utf-8")
            except UnicodeEncodeError:
                name = getattr(info, "field_name", "")
                raise ConfigurationError(f"{ENV_PREFIX}{name.upper()} is not valid UTF-8") from None
        return value

    @field_validator("admin_token", "http_token", mode="before")
    @classmethod
    def _empty_token_is_off(cls, value: object) -> object:
        """An empty (or blank) token switches admin actions off, exactly like an unset one: never an empty secret."""
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(text, str) and not text.strip():
            return None
        return value

    @field_validator("main_topics")
    @classmethod
    def _valid_topics(cls, value: str) -> str:
        topics = [part.strip() for part in value.split(",") if part.strip()]
        if not topics:
            raise ConfigurationError(f"{ENV_PREFIX}MAIN_TOPICS is empty; name at least one topic")
        for topic in topics:
            if not _TOPIC_NAME.fullmatch(topic) or len(topic) > MAX_TOPIC_CHARS:
                raise ConfigurationError(f"{ENV_PREFIX}MAIN_TOPICS: {topic[:60]!r} is not a valid Kafka topic name")
            if ".retry." in topic or topic.endswith(".failed"):
                raise ConfigurationError(f"{ENV_PREFIX}MAIN_TOPICS: {topic!r} looks like a tier or failed topic")
        return value

    @field_validator("handler", mode="before")
    @classmethod
    def _empty_handler_is_unset(cls, value: object) -> object:
        """``REBOUND_HANDLER=`` (empty or blank) is no handler, reported as missing by the worker, never as a form."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("handler")
    @classmethod
    def _valid_handler(cls, value: str | None) -> str | None:
        if value is not None and looks_like_url(value):
            return check_handler_url(value, variable=f"{ENV_PREFIX}HANDLER")
        if value is not None and not HANDLER_PATTERN.fullmatch(value.strip()):
            raise ConfigurationError(
                f"{ENV_PREFIX}HANDLER={value[:80]!r} is not of the form {HANDLER_FORM} (or an http(s):// URL); set it "
                f"to the handler's module and function, for example {HANDLER_EXAMPLE}"
            )
        return value.strip() if value is not None else None

    @field_validator("retry_after_max")
    @classmethod
    def _retry_after_max_given(cls, value: str) -> str:
        """Every retry with a Retry-After reads it, and every tier record's due time is bounded by it: no "none"."""
        if not value.strip() or parse_duration_ms(value, variable=f"{ENV_PREFIX}RETRY_AFTER_MAX") <= 0:
            raise ValueError(f"{ENV_PREFIX}RETRY_AFTER_MAX must be a duration longer than 0 (for example 1h)")
        return value

    @model_validator(mode="after")
    def _valid_status_lists(self) -> Settings:
        self.http_status_mapping  # noqa: B018 - validates both lists and their overlap once, at start-up
        return self

    @field_validator("store")
    @classmethod
    def _valid_store(cls, value: str) -> str:
        scheme, separator, _ = value.strip().partition("://")
        if not separator or scheme.lower() not in STORE_SCHEMES:
            raise ConfigurationError(
                f"{ENV_PREFIX}STORE={value[:80]!r} is not a table store Rebound supports; set it to rocksdb:// (the "
                "default) or memory:// (tests only: tables kept in memory, rebuilt from their changelogs at each start)"
            )
        return value.strip()

    @model_validator(mode="after")
    def _republish_needs_secret(self) -> Settings:
        if self.release_mode == "republish" and not self.header_secret:
            raise ConfigurationError(f"{ENV_PREFIX}RELEASE_MODE=republish needs {ENV_PREFIX}HEADER_SECRET")
        return self

    @model_validator(mode="after")
    def _key_order_runs_in_place(self) -> Settings:
        """A re-published retry goes to the end of its partition, behind the key's later messages: order is lost."""
        if self.ordering == "key" and self.release_mode == "republish":
            raise ConfigurationError(
                f"{ENV_PREFIX}ORDERING=key needs {ENV_PREFIX}RELEASE_MODE=in-place (a re-published retry would land "
                "behind the key's later messages)"
            )
        return self

    @model_validator(mode="after")
    def _breaker_probe_intervals(self) -> Settings:
        if self.breaker_enabled:
            self.breaker_config  # noqa: B018 - validates the combination once, at start-up
        return self

    @model_validator(mode="after")
    def _release_pacing(self) -> Settings:
        """Validates the combination once, at start-up (a ramp or a burst without a rate, say)."""
        if not self.release_pacing.paced and self.release_burst is not None:
            raise ConfigurationError(f"{ENV_PREFIX}RELEASE_BURST needs {ENV_PREFIX}RELEASE_RATE")
        rate = self.release_pacing.rate
        if rate is not None and self.release_burst is not None:
            least = min_burst(rate, self.release_linger_ms)
            if self.release_burst < least:
                raise ConfigurationError(
                    f"{ENV_PREFIX}RELEASE_BURST={self.release_burst} is too small for {ENV_PREFIX}RELEASE_RATE="
                    f"{self.release_rate.strip()} with {ENV_PREFIX}RELEASE_LINGER_MS={self.release_linger_ms}: release "
                    f"ticks are that far apart, and a bucket smaller than what accrues between two of them (plus the "
                    f"fraction of a release a tick carries over) loses the rest, capping releases below the rate. Set "
                    f"it to at least {least}, lower {ENV_PREFIX}RELEASE_LINGER_MS, or leave it unset (a tenth of a "
                    f"second's worth, or a linger's if longer)"
                )
        return self

    @model_validator(mode="after")
    def _drain_within_the_rebalance(self) -> Settings:
        """The group waits for a member's revocation, and evicts one that takes longer than the rebalance timeout: a
        record started at the end of the drain may run for the handler timeout and its cancellation grace on top."""
        if self.revoke_drain and self.revoke_drain > self._revocation_budget_s:  # 0 (no drain) always fits
            raise ConfigurationError(
                f"{ENV_PREFIX}REVOKE_DRAIN ({self.revoke_drain:g}s) plus {ENV_PREFIX}HANDLER_TIMEOUT "
                f"({self.handler_timeout_s:g}s), the {HANDLER_CANCEL_GRACE_S:g}s cancellation grace and "
                f"{ENV_PREFIX}HEARTBEAT_INTERVAL ({self.heartbeat_interval:g}s) must stay under "
                f"{ENV_PREFIX}REBALANCE_TIMEOUT ({self.rebalance_timeout:g}s)"
            )
        return self

    @model_validator(mode="after")
    def _distinct_topic_names(self) -> Settings:
        from rebound.tiers import check_topic_names

        check_topic_names(self.topics, self.policy, self.app_id)
        return self

    @model_validator(mode="after")
    def _memtables_fit_their_budget(self) -> Settings:
        """Below one memtable, every memtable would be flushed before it is full: many tiny files, much compaction."""
        if self.rocksdb_write_buffer_total_mb < self.rocksdb_write_buffer_mb:
            raise ConfigurationError(
                f"{ENV_PREFIX}ROCKSDB_WRITE_BUFFER_TOTAL_MB ({self.rocksdb_write_buffer_total_mb}) must be at least "
                f"{ENV_PREFIX}ROCKSDB_WRITE_BUFFER_MB ({self.rocksdb_write_buffer_mb})"
            )
        return self

    @cached_property
    def topics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(part.strip() for part in self.main_topics.split(",") if part.strip()))

    @cached_property
    def policy(self) -> RetryPolicy:
        return RetryPolicy.parse(self.retry_sequence, self.max_retry_duration)

    @property
    def key_ordered(self) -> bool:
        return self.ordering == "key"

    @cached_property
    def breaker_config(self) -> BreakerConfig:
        def ms(name: str) -> int:
            return parse_duration_ms(getattr(self, name), variable=f"{ENV_PREFIX}{name.upper()}")

        return BreakerConfig(
            window_ms=ms("breaker_window"),
            min_calls=self.breaker_min_calls,
            failure_ratio=self.breaker_failure_ratio,
            probe_interval_ms=ms("breaker_probe_interval"),
            probe_max_interval_ms=ms("breaker_probe_max_interval"),
        )

    @cached_property
    def release_pacing(self) -> PacingConfig:
        text = self.release_rate.strip().lower()
        rate = None if text in ("", "unlimited") else float(text)
        burst = self.release_burst or (default_burst(rate, self.release_linger_ms) if rate is not None else 1)
        ramp = self.release_ramp
        ramp_ms = parse_duration_ms(ramp, variable=f"{ENV_PREFIX}RELEASE_RAMP") if ramp.strip() else 0
        return PacingConfig(rate=rate, burst=burst, ramp_ms=ramp_ms)

    @cached_property
    def failed_retention_ms(self) -> int:
        return parse_duration_ms(self.failed_retention, variable=f"{ENV_PREFIX}FAILED_RETENTION")

    @cached_property
    def attempts_retention_ms(self) -> int:
        return parse_duration_ms(self.attempts_retention, variable=f"{ENV_PREFIX}ATTEMPTS_RETENTION")

    @cached_property
    def ended_memory_ms(self) -> int:
        return parse_duration_ms(self.ended_memory, variable=f"{ENV_PREFIX}ENDED_MEMORY")

    @cached_property
    def republish_ttl_ms(self) -> int:
        return parse_duration_ms(self.republish_ttl, variable=f"{ENV_PREFIX}REPUBLISH_TTL")

    @property
    def revoke_drain_s(self) -> float:
        """By default a quarter of the rebalance timeout, less if the handler timeout leaves less (0: no drain)."""
        if self.revoke_drain is not None:
            return self.revoke_drain
        return max(0.0, min(self.rebalance_timeout / 4, self._revocation_budget_s))

    @property
    def shutdown_work_s(self) -> float:
        """How long a stop lets handler work go on (the drain included) before it cuts it short."""
        return max(0.0, self.shutdown_timeout - SHUTDOWN_FINISH_S)

    @cached_property
    def concurrency_range(self) -> LimitRange | None:
        """Adaptive concurrency's range (``REBOUND_CONCURRENCY=auto``), None for a fixed limit."""
        if self.concurrency != "auto":
            return None
        low, high = self.concurrency_min, self.concurrency_max
        if low > high:
            raise ConfigurationError(
                f"{ENV_PREFIX}CONCURRENCY_MIN={low} is above {ENV_PREFIX}CONCURRENCY_MAX={high}: the adaptive limit "
                "moves between them"
            )
        initial = self.concurrency_initial
        if initial is None:
            initial = max(low, min(high, DEFAULT_INITIAL_CONCURRENCY))
        elif not low <= initial <= high:
            raise ConfigurationError(
                f"{ENV_PREFIX}CONCURRENCY_INITIAL={initial} is not between {ENV_PREFIX}CONCURRENCY_MIN={low} and "
                f"{ENV_PREFIX}CONCURRENCY_MAX={high}"
            )
        return LimitRange(low, high, initial)

    @property
    def most_in_flight(self) -> int:
        """The most handler calls the worker may run at once: the fixed limit, or the adaptive one's maximum. What is
        sized from the concurrency is sized from this, so it holds whatever the adaptive limit does."""
        if self.concurrency == "auto":
            return self.concurrency_max
        return self.concurrency

    @property
    def release_window(self) -> int:
        """Requests in flight per release partition: REBOUND_RELEASE_MAX_IN_FLIGHT, by default relative to the
        concurrency (a fixed window would starve a worker whose concurrency was raised past it): its maximum under
        ``auto``, so one partition can keep every call the limit may reach busy."""
        if self.release_max_in_flight is not None:
            return self.release_max_in_flight
        return RELEASE_WINDOW_PER_CALL * self.most_in_flight

    @property
    def _revocation_budget_s(self) -> float:
        return self.rebalance_timeout - self.handler_timeout_s - HANDLER_CANCEL_GRACE_S - self.heartbeat_interval

    @cached_property
    def retry_after_max_ms(self) -> int:
        return parse_duration_ms(self.retry_after_max, variable=f"{ENV_PREFIX}RETRY_AFTER_MAX")

    @cached_property
    def http_status_mapping(self) -> StatusMapping:
        return StatusMapping.parse(self.http_retryable_statuses, self.http_permanent_statuses, prefix=ENV_PREFIX)

    @property
    def http_handler(self) -> bool:
        """Whether ``REBOUND_HANDLER`` is a URL: the HTTP push handler (``app/http_handler.py``)."""
        return self.handler is not None and looks_like_url(self.handler)

    @cached_property
    def handler_timeout_s(self) -> float:
        return parse_duration_ms(self.handler_timeout, variable=f"{ENV_PREFIX}HANDLER_TIMEOUT") / 1000

    @cached_property
    def classifier(self) -> ErrorClassifier:
        return ErrorClassifier(
            permanent_names=_names(self.permanent_errors),
            retryable_names=_names(self.retryable_errors),
            default=Classification(self.unknown_errors),
        )

    @property
    def bootstrap_servers(self) -> str:
        """``kafka://a:9092;b:9092`` as the plain ``a:9092,b:9092`` that Kafka clients take."""
        parts = (part.strip() for part in self.broker.replace(";", ",").split(","))
        return ",".join(part.split("://", 1)[-1] for part in parts if part)


def load_settings(**values: object) -> Settings:
    """Validate ``values`` (field names, the defaults for the rest); any problem becomes one
    :class:`ConfigurationError` naming the variable. Reads nothing: ``app.environment.settings_from_environment``
    gathers the ``REBOUND_*`` variables and the ``.env`` file's and calls :func:`settings_from`."""
    return settings_from(values)


def settings_from(values: Mapping[str, object], *, origins: Mapping[str, str] | None = None) -> Settings:
    """:func:`load_settings` of ``values``; ``origins`` says where a field's value was read, by field name (``in
    /srv/app/.env``), and a problem naming its variable says it too: ``REBOUND_CONCURRENCY='-3': must be ... (REBOUND_
    CONCURRENCY is set in /srv/app/.env)``."""
    origins = origins or {}
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigurationError("; ".join(_with_origins(_problem(e), origins) for e in exc.errors())) from None
    except ConfigurationError as exc:  # (a validator of Rebound's own, raised as it is: one problem)
        if not origins:
            raise
        raise ConfigurationError(_with_origins(str(exc), origins)) from exc.__cause__


_SECRET_FIELDS = frozenset(
    name for name, field in Settings.model_fields.items() if "SecretStr" in str(field.annotation)
)


def _with_origins(text: str, origins: Mapping[str, str]) -> str:
    """A problem's ``text``, then where each variable it names was read, when ``origins`` says."""
    said = [
        f"{ENV_PREFIX}{field.upper()} is set {origin}"
        for field, origin in origins.items()
        if re.search(rf"(?<![A-Z0-9_]){ENV_PREFIX}{field.upper()}(?![A-Z0-9_])", text)
    ]
    return f"{text} ({'; '.join(said)})" if said else text


def _problem(error: ErrorDetails) -> str:
    """One of pydantic's errors as ``REBOUND_CONCURRENCY='-3': must be greater than or equal to 1``: the variable,
    the value given (never a secret's) and what it must be. Rebound's own validators' messages are kept as written."""
    field = ".".join(str(part) for part in error["loc"])
    message = str(error.get("ctx", {}).get("error", error["msg"]))
    if message.startswith(ENV_PREFIX):
        return message
    variable = f"{ENV_PREFIX}{field.upper()}"
    if message.startswith("Input should"):
        message = "must" + message.removeprefix("Input should")
    if error["type"] == "missing" or field in _SECRET_FIELDS:
        return f"{variable}: {message}"
    return f"{variable}={str(error['input'])[:80]!r}: {message}"
