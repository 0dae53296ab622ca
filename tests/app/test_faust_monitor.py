"""Rebound's app takes Faust's ``Monitor`` out of the per-event sensors: nothing reads its figures, and it cost every
healthy message a few µs (``app/consumer.py`` ``ReboundApp.drop_per_event_monitor``)."""

from __future__ import annotations


def test_rebounds_app_takes_fausts_monitor_out_of_the_per_event_sensors() -> None:
    from app.factory import create_faust_app
    from rebound.settings import Settings

    app = create_faust_app(Settings(data_dir="/tmp/rebound-monitor-test"), 4)
    list(app.on_init_dependencies())  # (what the app's start does first: the monitor joins the sensors)
    assert app.monitor in set(app.sensors)
    app.drop_per_event_monitor()  # type: ignore[attr-defined]  # (the app's on_start does it)
    assert app.monitor not in set(app.sensors)
    assert app.per_event_monitor is False  # type: ignore[attr-defined]


def test_fausts_livelock_detector_still_sees_the_streams_take_events() -> None:
    """Faust's livelock detector (``AIOKafkaConsumerThread.verify_event_path``, run every 2.5 commit intervals; this
    consumer's ``verify_event_path`` calls it) reads ``app.monitor.stream_inbound_time``, which only the monitor's
    per-event ``on_stream_event_in`` writes: without it, a partition that lags (highwater above the fetch position)
    and whose stream processes events is reported "Stream has not started processing" once the worker is up
    ``stream_processing_timeout``, and its commit checks are never reached."""
    import time
    from types import SimpleNamespace
    from typing import Any

    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
    from faust.types import TP

    from app.factory import create_faust_app
    from rebound.settings import Settings

    app: Any = create_faust_app(Settings(data_dir="/tmp/rebound-monitor-test"), 4)
    list(app.on_init_dependencies())
    if not app.per_event_monitor:
        app.drop_per_event_monitor()  # (what the app's on_start does)
    tp = TP("orders", 0)

    class Weak:  # (the monitor keeps the stream and the task reading it weakly)
        task_owner: Any = None

    stream = Weak()
    stream.task_owner = Weak()
    app.sensors.on_stream_event_in(tp, 41, stream, SimpleNamespace())  # the agent's stream takes offset 41, now

    logged: list[str] = []
    now = time.monotonic()
    state = SimpleNamespace(highwater=100, position=50, timestamp=None)  # lagging: 50 records not fetched yet
    aiokafka_consumer = SimpleNamespace(
        _fetcher=SimpleNamespace(
            _subscriptions=SimpleNamespace(
                subscription=SimpleNamespace(assignment=SimpleNamespace(state_value=lambda aiotp: state))
            )
        )
    )
    thread: Any = SimpleNamespace(
        _verify_aiokafka_event_path=lambda now, tp: False,  # (fetching fine)
        consumer=SimpleNamespace(
            app=SimpleNamespace(monitor=app.monitor, topics=SimpleNamespace(acks_enabled_for=lambda topic: True))
        ),
        _ensure_consumer=lambda: aiokafka_consumer,
        time_started=now - 3600.0,  # up an hour
        tp_stream_timeout_secs=app.conf.stream_processing_timeout,
        tp_commit_timeout_secs=app.conf.broker_commit_livelock_soft_timeout,
        tp_last_committed_at={tp: now - 1.0},  # committed a second ago
        _log_slow_processing_stream=lambda msg, *args: logged.append(msg % args),
        _log_slow_processing_commit=lambda msg, *args: logged.append(msg % args),
    )
    AIOKafkaConsumerThread.verify_event_path(thread, now, tp)
    assert logged == []
