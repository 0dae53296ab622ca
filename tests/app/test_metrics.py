"""Prometheus metrics (``agents/metrics.py``): driven through the real agents, read back from a scrape of the runtime's
own registry, label sets and values exact."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from faust.types import TP
from prometheus_client.parser import text_string_to_metric_families

from agents.metrics import CONTENT_TYPE_LATEST, MAX_ERROR_CLASSES, OTHER, Metrics, handler_buckets
from agents.release import adopt_owned_partitions
from app.views import metrics_text
from rebound.breaker import BreakerState
from rebound.routing import Classification
from tests.agents.conftest import clock, eventually, make_runtime, nothing_waits, put_waits_for_the_dispatcher
from tests.agents.support import run_first_try, stale_lease, stop_during_each_send

__all__ = ["clock", "make_runtime", "put_waits_for_the_dispatcher"]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(runtime: Any) -> Samples:
    """Every sample of a scrape of the runtime's registry, by name and label set."""
    samples: Samples = {}
    for family in text_string_to_metric_families(metrics_text(runtime)):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def of(samples: Samples, name: str, **where: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples called ``name`` whose labels include ``where``, by label set."""
    return {
        labels: value
        for (sample, labels), value in samples.items()
        if sample == name and set(where.items()) <= set(labels)
    }


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset(values.items())


def attempt(tier: str, outcome: str, reason: str = "", error_class: str = "") -> frozenset[tuple[str, str]]:
    return labels(topic="items", tier=tier, outcome=outcome, reason=reason, error_class=error_class)


async def test_a_success_a_retry_a_dead_letter_and_a_release_through_the_agents(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    adopt_owned_partitions(runtime)
    async with (
        runtime.agents["main"].test_context() as main,
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await main.put(b'{"succeed_on": 0}', key=b"ok")
        await main.put(b'{"succeed_on": 1}', key=b"retry")
        await main.put(b'{"permanent": true}', key=b"perm")
        await main.put(b"\xff not json", key=b"garbage")
        [forwarded] = runtime.tier_topics["items.retry.1s"].sent
        await tier.put(forwarded.value, key=forwarded.key, headers=list(forwarded.headers.items()), partition=0)

        parked = scrape(runtime)
        assert of(parked, "rebound_tier_waiting") == {
            labels(topic="items", tier="1s"): 1.0,
            labels(topic="items", tier="2s"): 0.0,
        }
        assert of(parked, "rebound_tier_overdue", tier="1s") == {labels(topic="items", tier="1s"): 0.0}

        request = json.dumps({"origin": "items/0/1", "attempt": 1}).encode()
        await releaser.put(request, key=b"retry", partition=0)  # early: rescheduled, runs nothing
        clock.advance(1030)
        overdue = scrape(runtime)
        assert of(overdue, "rebound_tier_overdue", tier="1s") == {labels(topic="items", tier="1s"): 1.0}
        assert of(overdue, "rebound_tier_oldest_overdue_seconds", tier="1s") == {labels(topic="items", tier="1s"): 0.03}
        await releaser.put(request, key=b"retry", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"retry"))

    samples = scrape(runtime)
    assert of(samples, "rebound_attempts_total") == {
        attempt("main", "succeeded"): 1.0,
        attempt("main", "scheduled", error_class="rebound.errors.RetryableError"): 1.0,
        attempt("main", "dead", "permanent", "rebound.errors.PermanentError"): 1.0,
        attempt("main", "dead", "undecodable", "rebound.errors.UndecodableError"): 1.0,
        attempt("1s", "succeeded"): 1.0,
    }
    assert of(samples, "rebound_parked_total") == {
        labels(topic="items", tier="1s"): 1.0,
        labels(topic="items", tier="2s"): 0.0,
    }
    one_second = labels(topic="items", tier="1s")
    assert of(samples, "rebound_release_lateness_seconds_count") == {
        one_second: 1.0,
        labels(topic="items", tier="2s"): 0.0,
    }
    assert of(samples, "rebound_release_lateness_seconds_sum", tier="1s") == {one_second: 0.03}
    buckets = {
        dict(key)["le"]: value
        for key, value in of(samples, "rebound_release_lateness_seconds_bucket", tier="1s").items()
    }
    assert buckets == {
        **dict.fromkeys(("0.005", "0.01", "0.025"), 0.0),
        **dict.fromkeys(("0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf"), 1.0),
    }
    assert of(samples, "rebound_handler_duration_seconds_count") == {
        labels(topic="items", tier="main", result="ok"): 1.0,
        labels(topic="items", tier="main", result="error"): 3.0,
        labels(topic="items", tier="1s", result="ok"): 1.0,
    }
    assert of(samples, "rebound_release_skipped_total") == {
        labels(reason="stale"): 0.0,
        labels(reason="early"): 1.0,
        labels(reason="breaker-open"): 0.0,
        labels(reason="revoked"): 0.0,
        labels(reason="ended"): 0.0,
    }
    assert of(samples, "rebound_main_received_total") == {labels(): 4.0}
    assert of(samples, "rebound_tier_waiting", tier="1s") == {one_second: 0.0}
    # Off features and the old grab bag are not there.
    names = {name for name, _ in samples}
    assert not {name for name in names if name.startswith(("rebound_breaker_", "rebound_ordering_", "rebound_events"))}
    # The internal counters are unchanged: the tests and the benchmarks read them.
    assert runtime.counters["released"] == 1 and runtime.counters["release.lag_ms_total"] == 30


async def test_first_tries_refused_after_their_send_are_counted_apart(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first try whose retry was sent while the worker was stopped past its session timeout: its *forwarded* mark
    is not written (``main.revoked_after_send``), exported as ``when="after-send"`` beside the refusals before a
    send (``before-send``); only the latter reached ``/metrics`` before."""
    runtime = make_runtime()
    lease = stale_lease(runtime)
    stop_during_each_send(runtime.tier_topics["items.retry.1s"], monkeypatch, lease)
    _, acked = await run_first_try(runtime, monkeypatch, "fail")
    assert acked == [] and runtime.counters["main.revoked_after_send"] == 1
    assert of(scrape(runtime), "rebound_first_try_revoked_total") == {
        labels(when="before-send"): 0.0,
        labels(when="after-send"): 1.0,
    }


async def test_a_handler_timeout_is_observed_at_the_timeout(make_runtime: Any) -> None:
    runtime = make_runtime(handler_timeout="100ms")
    async with runtime.agents["main"].test_context() as main:
        await main.put(b'{"sleep": 5}', key=b"slow")
        await eventually(lambda: bool(runtime.tier_topics["items.retry.1s"].sent))
    samples = scrape(runtime)
    timeout = labels(topic="items", tier="main", result="timeout")
    assert of(samples, "rebound_handler_duration_seconds_count") == {timeout: 1.0}
    buckets = {dict(key)["le"]: v for key, v in of(samples, "rebound_handler_duration_seconds_bucket").items()}
    assert list(buckets) == ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "+Inf"]
    assert buckets["0.05"] == 0.0 and buckets["0.1"] == 1.0, "a timed-out call falls in the timeout's bucket"
    assert of(samples, "rebound_handler_duration_seconds_sum") == {timeout: 0.1}
    assert of(samples, "rebound_attempts_total") == {
        attempt("main", "scheduled", error_class="rebound.errors.HandlerTimeout"): 1.0
    }


async def test_breaker_gauges_and_counters(make_runtime: Any) -> None:
    runtime = make_runtime(breaker_enabled=True, breaker_window="10s", breaker_min_calls=2, breaker_failure_ratio=0.5)
    assert of(scrape(runtime), "rebound_breaker_state") == {labels(): 0.0}
    for _ in range(2):
        runtime.breaker_gate.record(Classification.RETRYABLE, probe=False)
    assert runtime.breaker_gate.breaker.state is BreakerState.OPEN
    runtime.clock.advance(2500)
    samples = scrape(runtime)
    assert of(samples, "rebound_breaker_state") == {labels(): 1.0}
    assert of(samples, "rebound_breaker_opens_total") == {labels(): 1.0}
    assert of(samples, "rebound_breaker_probes_total") == {labels(): 0.0}
    assert of(samples, "rebound_breaker_held_seconds_total") == {labels(): 2.5}
    assert of(samples, "rebound_breaker_waiting_calls") == {labels(): 0.0}


async def test_key_ordered_gauges(make_runtime: Any) -> None:
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with runtime.agents["main"].test_context() as main:
        await main.put(b'{"succeed_on": 1}', key=b"k")  # blocks the key
        await main.put(b'{"succeed_on": 0}', key=b"k")  # held
        await main.put(b'{"succeed_on": 0}', key=b"k")  # held
    samples = scrape(runtime)
    assert of(samples, "rebound_ordering_blocked_keys") == {labels(): 1.0}
    assert of(samples, "rebound_ordering_held_messages") == {labels(): 2.0}
    assert of(samples, "rebound_ordering_released_total") == {labels(): 0.0}
    assert of(samples, "rebound_attempts_total", outcome="held") == {attempt("main", "held"): 2.0}


class FakeThread:
    _consumer = object()  # started

    def __init__(self, positions: dict[TP, int | None]) -> None:
        self.positions = positions

    def _positions(self, partitions: list[TP]) -> dict[TP, int | None]:
        return {tp: self.positions[tp] for tp in partitions if tp in self.positions}


class FakeConsumer:
    """What the lag gauge reads of Faust's consumer: the fetcher's highwater, Faust's committed offsets."""

    def __init__(self, highwaters: dict[TP, int | None], committed: dict[TP, int | None], thread: FakeThread) -> None:
        self.highwaters, self._committed_offset, self._thread = highwaters, committed, thread

    def highwater(self, tp: TP) -> int | None:
        assert tp in self.highwaters, "Partition is not assigned"  # as aiokafka does
        return self.highwaters[tp]


async def test_consumer_lag_of_owned_main_topic_partitions(make_runtime: Any) -> None:
    runtime = make_runtime(main_topics="items,orders")
    assert of(scrape(runtime), "rebound_consumer_lag") == {}  # consumer not started: nothing, and no error
    items = [TP("items", p) for p in range(4)]
    orders0 = TP("orders", 0)
    owned = {*items[:3], orders0, TP("agent-test.release", 0), TP("items.retry.1s", 0)}
    runtime.app.assignor.assigned_actives = lambda: owned
    runtime.app.consumer = FakeConsumer(
        # items 2 was never fetched from (no highwater); items 3 is not owned; orders 0 was revoked meanwhile.
        highwaters={items[0]: 120, items[1]: 50, items[2]: None, items[3]: 9, TP("items.retry.1s", 0): 7},
        committed={items[0]: 100, items[1]: None, items[3]: 0},
        thread=FakeThread({items[1]: 45}),
    )
    assert of(scrape(runtime), "rebound_consumer_lag") == {
        labels(topic="items", partition="0"): 20.0,
        labels(topic="items", partition="1"): 5.0,  # nothing committed yet: from the fetch position
    }


async def test_records_read_again_and_not_run_again_per_topic(make_runtime: Any) -> None:
    runtime = make_runtime()
    assert of(scrape(runtime), "rebound_redelivery_skipped_total") == {}  # consumer not started: none, and no error
    runtime.app.consumer = SimpleNamespace(redeliveries_skipped={"items": 382, "agent-test.release": 4})
    assert of(scrape(runtime), "rebound_redelivery_skipped_total") == {
        labels(topic="items"): 382.0,
        labels(topic="agent-test.release"): 4.0,
    }


def test_error_class_labels_are_bounded() -> None:
    metrics = Metrics.__new__(Metrics)
    metrics._error_classes = set()
    assert metrics.error_class(None) == "" and metrics.error_class("") == ""
    assert metrics.error_class("ValueError") == "ValueError"
    assert metrics.error_class("pkg.mod.Error") == "pkg.mod.Error"
    assert metrics.error_class("not a class: the message") == OTHER
    for n in range(MAX_ERROR_CLASSES):
        metrics.error_class(f"E{n}")
    assert len(metrics._error_classes) == MAX_ERROR_CLASSES
    assert metrics.error_class("OneTooMany") == OTHER
    assert metrics.error_class("ValueError") == "ValueError"  # those seen keep their name


def test_handler_buckets_end_at_the_timeout() -> None:
    assert handler_buckets(30.0) == (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    assert handler_buckets(0.5) == (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
    assert handler_buckets(7.0)[-2:] == (5.0, 7.0)


def test_each_runtime_has_its_own_registry(make_runtime: Any) -> None:
    one, two = make_runtime(), make_runtime()
    one.metrics.attempt("items", None, "succeeded")
    assert of(scrape(one), "rebound_attempts_total") == {attempt("main", "succeeded"): 1.0}
    assert of(scrape(two), "rebound_attempts_total") == {}
    body, content_type = one.metrics.exposition()
    assert content_type == CONTENT_TYPE_LATEST and body.decode() == metrics_text(one)


def test_a_failing_part_leaves_the_rest_of_the_scrape(make_runtime: Any) -> None:
    runtime = make_runtime()

    def broken() -> Any:
        raise RuntimeError("store closed")

    runtime.schedule = SimpleNamespace(partitions=frozenset(), tier_stats=broken)
    samples = scrape(runtime)
    assert of(samples, "rebound_tier_waiting") == {}
    assert of(samples, "rebound_main_received_total") == {labels(): 0.0}


async def test_the_operator_pause_is_a_gauge(make_runtime: Any) -> None:
    from agents.control import control_board
    from rebound.pause import PauseState

    runtime = make_runtime()
    assert of(scrape(runtime), "rebound_main_paused") == {labels(): 0.0}  # nothing read yet: not paused
    assert of(scrape(runtime), "rebound_pause_state_known") == {labels(): 0.0}  # ... and first tries held for it
    control_board(runtime).apply(PauseState(paused=True, by="ops@host", at_ms=1))
    assert of(scrape(runtime), "rebound_main_paused") == {labels(): 1.0}
    assert of(scrape(runtime), "rebound_pause_state_known") == {labels(): 1.0}
    control_board(runtime).apply(PauseState(paused=False, by="ops@host", at_ms=2))
    assert of(scrape(runtime), "rebound_main_paused") == {labels(): 0.0}


def test_no_created_series_and_the_switch_a_handler_s_metrics_use_is_left_alone(make_runtime: Any) -> None:
    """``*_created`` samples are left out of Rebound's scrape only: a handler's own prometheus_client metrics keep
    them (the process-wide ``disable_created_metrics`` is not called)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    runtime = make_runtime()
    runtime.metrics.attempt("items", None, "succeeded")
    runtime.metrics.handler_called("items", None, 0.002, None)
    text = metrics_text(runtime)
    assert "_created" not in text
    assert "rebound_attempts_total" in text and "rebound_handler_duration_seconds_count" in text
    theirs = CollectorRegistry()
    Counter("handler_orders", "A handler's own counter.", registry=theirs).inc()
    assert b"handler_orders_created" in generate_latest(theirs)


def test_the_writer_epoch_fence_counts_of_each_table(make_runtime: Any) -> None:
    runtime = make_runtime()
    state, payloads = runtime.fences
    state.records_skipped, state.records_deferred, state.records_fetched_before = 3, 2, 1
    payloads.records_before_the_marker, payloads.keys_written_over_the_span = 5, 4
    samples = scrape(runtime)
    assert of(samples, "rebound_fence_records_total") == {
        labels(table="retry_state", kind="skipped"): 3.0,
        labels(table="retry_state", kind="deferred"): 2.0,
        labels(table="retry_state", kind="fetched-before"): 1.0,
        labels(table="retry_state", kind="before-the-marker"): 0.0,
        labels(table="retry_payloads", kind="skipped"): 0.0,
        labels(table="retry_payloads", kind="deferred"): 0.0,
        labels(table="retry_payloads", kind="fetched-before"): 0.0,
        labels(table="retry_payloads", kind="before-the-marker"): 5.0,
    }
    assert of(samples, "rebound_fence_keys_written_over_total") == {
        labels(table="retry_state"): 0.0,
        labels(table="retry_payloads"): 4.0,
    }
