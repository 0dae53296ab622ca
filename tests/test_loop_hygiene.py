"""The test-suite's own hygiene: building Faust apps in a test process must not leak descriptors (tests/loop_hygiene.py)."""

from __future__ import annotations

from pathlib import Path

from tests.loop_hygiene import close_idle_thread_loops, install, open_descriptors


def _build_app_with_consumer(tmp_path: Path) -> object:
    from app.factory import build
    from rebound.settings import load_settings

    runtime = build(
        load_settings(
            handler="tests.scripted_handler:handle", data_dir=str(tmp_path), provision_topics=False, store="memory://"
        ),
        partitions=1,
    )
    return runtime.app.consumer  # builds the consumer, whose ServiceThread opens its thread's loop


def test_unstarted_consumer_threads_leave_no_descriptors_open(tmp_path: Path) -> None:
    install()
    _build_app_with_consumer(tmp_path / "warm-up")  # the first app also sets the main thread's loop, once per process
    close_idle_thread_loops()
    before = open_descriptors()
    consumers = [_build_app_with_consumer(tmp_path / str(n)) for n in range(5)]
    grown = open_descriptors() - before
    assert grown >= 5 * 3, f"each consumer's thread loop holds an epoll descriptor and a socket pair ({grown})"
    assert close_idle_thread_loops() == 5
    assert open_descriptors() - before <= 1, "the thread loops' descriptors are closed"
    del consumers
