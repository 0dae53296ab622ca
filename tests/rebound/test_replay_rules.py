"""Replaying one dead letter (``rebound/replay.py``): the redrive job's header arithmetic and the refusal rules."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pipeline.jobs import redrive
from rebound import headers as h
from rebound.dead_letters import dead_letter_records
from rebound.records import producible
from rebound.replay import (
    DEFAULT_MAX_REDRIVES,
    NOT_A_DEAD_LETTER,
    OTHER_GROUP,
    REDRIVE_CAP,
    TOMBSTONE,
    VALUE_LEFT_OUT,
    ReplayPlan,
    ReplayRefused,
    outgoing_headers,
    parse_max_redrives,
    plan_replay,
    redrive_count,
)

PROVENANCE = h.Provenance(topic="items", partition=1, offset=42, timestamp_ms=1_000, first_received_at_ms=1_000)


def dead_letter(
    value: bytes | None = b'{"id": 1}',
    *,
    own: list[tuple[str, bytes]] | None = None,
    reason: str = "exhausted",
    limit: int = 1_048_576,
    key: bytes | None = b"item-1",
) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """A dead letter as Rebound writes it (the first candidate that fits ``limit``)."""
    record = dead_letter_records(
        key=key,
        value=value,
        own_headers=own or [],
        provenance=PROVENANCE,
        group="rebound",
        attempt=3,
        reason=reason,
        error_class="RetryableError",
        error_message="still down",
        trace=None,
        limit=limit,
    )[0].record
    return record.key, record.value, list(record.headers)


def plan(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], **kwargs: Any) -> ReplayPlan:
    return plan_replay(failed_topic="items.failed", main_topic="items", key=key, value=value, headers=headers, **kwargs)


def test_the_cap_is_the_redrive_job_s_default() -> None:
    parser = argparse.ArgumentParser()
    redrive.add_arguments(parser)
    assert parser.get_default("max_redrives") == DEFAULT_MAX_REDRIVES


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("trace-id", b"abc"), ("rebound.attempt", b"3"), ("tenant", b"t1")],
        [("rebound.redrive-count", b"2"), ("a", b""), ("rebound.reason", b"permanent")],
    ],
)
@pytest.mark.parametrize("previous", [0, 1, 2])
def test_outgoing_headers_are_the_redrive_job_s(headers: list[tuple[str, bytes]], previous: int) -> None:
    assert outgoing_headers(headers, previous) == redrive.outgoing_headers(headers, previous)


def test_a_dead_letter_goes_back_byte_exact_with_user_headers_and_the_next_redrive_count() -> None:
    key, value, headers = dead_letter(own=[("trace-id", b"abc"), ("rebound.redrive-count", b"1"), ("tenant", b"t1")])
    replay = plan(key, value, headers, partitions=4)
    assert replay.target_topic == "items"
    assert replay.target_partition == 1  # the original partition
    assert (replay.key, replay.value) == (b"item-1", b'{"id": 1}')
    assert replay.headers == [
        ("trace-id", b"abc"),
        ("tenant", b"t1"),
        ("rebound.redrive-count", b"2"),
    ]
    assert replay.redrive_count == 2
    assert replay.reason == "exhausted"
    assert replay.original["offset"] == 42


def test_an_original_partition_the_topic_does_not_have_is_left_to_the_partitioner() -> None:
    key, value, headers = dead_letter()
    assert plan(key, value, headers, partitions=1).target_partition is None
    assert plan(key, value, headers).target_partition is None


def test_redrive_count_reads_the_last_header_and_garbage_as_zero() -> None:
    assert redrive_count([]) == 0
    assert redrive_count([("rebound.redrive-count", b"2")]) == 2
    assert redrive_count([("rebound.redrive-count", b"1"), ("rebound.redrive-count", b"3")]) == 3
    assert redrive_count([("rebound.redrive-count", b"two")]) == 0
    assert redrive_count([("rebound.redrive-count", b"-1")]) == 0


def refusal(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], **kwargs: Any) -> str:
    with pytest.raises(ReplayRefused) as refused:
        plan(key, value, headers, **kwargs)
    assert refused.value.message
    return refused.value.code


def test_a_record_that_is_not_a_rebound_dead_letter_is_refused() -> None:
    assert refusal(b"k", b"v", []) == NOT_A_DEAD_LETTER
    assert refusal(b"k", b"v", [("rebound.reason", b"permanent")]) == NOT_A_DEAD_LETTER  # no original topic
    key, value, headers = dead_letter()
    assert refusal(key, value, [(n, v) for n, v in headers if n != h.REASON]) == NOT_A_DEAD_LETTER
    assert refusal(key, value, [*headers, (h.REASON, b"permanent")]) == NOT_A_DEAD_LETTER  # a repeated rebound.* header
    # a dead letter of another main topic (a shared failed topic, a forged header) never goes to this one
    other = [(n, b"payments" if n == h.ORIGINAL_TOPIC else v) for n, v in headers]
    assert refusal(key, value, other) == NOT_A_DEAD_LETTER


def test_a_dead_letter_whose_value_was_left_out_is_refused_with_where_the_original_is() -> None:
    key, value, headers = dead_letter(b"x" * 4000, limit=2048)
    assert value is None and dict(headers)[h.REASON] == b"too-large"
    with pytest.raises(ReplayRefused) as refused:
        plan(key, value, headers)
    assert refused.value.code == VALUE_LEFT_OUT
    assert "items partition 1 offset 42" in refused.value.message


def test_a_too_large_dead_letter_that_kept_its_value_may_be_replayed() -> None:
    key, value, headers = dead_letter(b"small", reason="too-large")
    assert plan(key, value, headers).value == b"small"


def test_a_tombstone_is_refused() -> None:
    key, _, headers = dead_letter(None, reason="permanent")
    assert refusal(key, None, headers) == TOMBSTONE
    # a record with neither key nor value is sent on as an empty value marked rebound.null-value (producible())
    _, empty, headers = dead_letter(None, reason="permanent", key=None)
    value, marked = producible(None, empty, headers)
    assert refusal(None, value, marked) == TOMBSTONE
    assert plan(b"k", b"", headers).value == b""  # an empty value without the marker is a value


def test_the_redrive_cap_holds_and_a_request_may_only_lower_it() -> None:
    key, value, headers = dead_letter(own=[("rebound.redrive-count", b"3")])
    assert refusal(key, value, headers) == REDRIVE_CAP
    key, value, headers = dead_letter(own=[("rebound.redrive-count", b"1")])
    assert refusal(key, value, headers, max_redrives=1) == REDRIVE_CAP
    assert plan(key, value, headers, max_redrives=2).redrive_count == 2
    assert parse_max_redrives(None) == parse_max_redrives("") == DEFAULT_MAX_REDRIVES
    assert parse_max_redrives("0") == 0
    for bad in ("4", "-1", "two"):
        with pytest.raises(ValueError):
            parse_max_redrives(bad)


def test_a_dead_letter_of_another_group_is_refused_unless_forced() -> None:
    key, value, headers = dead_letter()  # written by group "rebound"
    assert plan(key, value, headers, group="rebound").original["group"] == "rebound"
    with pytest.raises(ReplayRefused) as refused:
        plan(key, value, headers, group="billing")
    assert refused.value.code == OTHER_GROUP
    assert "'rebound'" in refused.value.message and "force_other_group" in refused.value.message
    assert plan(key, value, headers, group="billing", force_other_group=True).redrive_count == 1
    without = [(name, raw) for name, raw in headers if name != h.GROUP]
    assert plan(key, value, without, group="billing").redrive_count == 1  # no group header: nothing to compare
