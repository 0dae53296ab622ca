"""The settings every baseline app shares, read from the environment the benchmark gives it."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import faust


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def app_id() -> str:
    return os.environ["BENCH_APP_ID"]


def fetch_wait_ms() -> int:
    """The consumer's fetch wait, Rebound's (``REBOUND_FETCH_MAX_WAIT_MS``; Faust's 1,500 ms when unset)."""
    return int(os.environ.get("REBOUND_FETCH_MAX_WAIT_MS", "1500"))


def settings(**overrides: Any) -> dict[str, Any]:
    """Faust settings with Rebound's consumer-group timing, producer acks and batch size, and no tables
    (``overrides``: other app settings, e.g. a ``store`` for a baseline that has a table; ``datadir`` None or unset is
    a new temporary directory)."""
    values: dict[str, Any] = {
        "broker": os.environ["BENCH_BROKER"],
        "store": "memory://",
        "autodiscover": False,
        "topic_partitions": int(os.environ.get("BENCH_PARTITIONS", "4")),
        "producer_acks": -1,
        "producer_max_batch_size": int(os.environ.get("REBOUND_PRODUCER_MAX_BATCH_BYTES", "16384")),
        "consumer_auto_offset_reset": "earliest",
        "broker_rebalance_timeout": env_float("REBOUND_REBALANCE_TIMEOUT", 60),
        "broker_session_timeout": env_float("REBOUND_SESSION_TIMEOUT", 60),
        "broker_heartbeat_interval": env_float("REBOUND_HEARTBEAT_INTERVAL", 3),
        "broker_commit_interval": env_float("REBOUND_COMMIT_INTERVAL", 2.8),
        "web_enabled": False,
        "stream_processing_timeout": 600.0,
    }
    values.update(overrides)
    if not values.get("datadir"):
        values["datadir"] = tempfile.mkdtemp(prefix="bench-baseline-")
    return values


def make_app(**overrides: Any) -> faust.App:
    """A Faust app on Rebound's app and consumer classes (``app.consumer.ReboundApp``) with :func:`settings` and
    Rebound's fetch wait (``overrides`` may also name ``ReboundApp``'s own arguments).

    The fetch wait matters most: the embedded broker answers a multi-partition fetch only when the long-poll wait is
    over, so a baseline left at Faust's 1.5 s would look slow for a reason that has nothing to do with retries. The
    consumer class carries Rebound's own changes to Faust's per-record path too (the hand-over without mode's
    ``wait_first``, ``maybe_start_producer`` without its ``stampede``): ``bench/baselines/stock.py`` makes a plain
    ``faust.App`` with the fetch wait alone.
    """
    from app.consumer import ReboundApp

    return ReboundApp(app_id(), **settings(**{"fetch_max_wait_ms": fetch_wait_ms(), **overrides}))


def raw_topic(app: faust.App, name: str) -> Any:
    return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
