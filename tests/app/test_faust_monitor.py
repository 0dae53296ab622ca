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
