"""Where "owns nothing" starts and ends on the consumer (``ReboundConsumer.between_assignments``, read by
``agents/ownership.py``): from the end of the revocation callback, after its drain and commit, until aiokafka hands
over the next assignment (the listener's ``on_partitions_assigned``, called right after the assignor's
``on_assignment``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from faust.transport.drivers import aiokafka as driver
from faust.types import TP

from app.consumer import ReboundConsumer
from tests.app.consumer_steps import joining_coordinator, stub_revocation
from tests.app_under_test import ITEMS_1


async def test_the_window_starts_once_the_revocation_callback_has_drained_and_committed(
    consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    async def app_revocation(revoked: set[TP]) -> None:  # the dispatcher's drain and Faust's commit
        seen.append(consumer.between_assignments)

    stub_revocation(consumer, monkeypatch, app_revocation)
    assert consumer.between_assignments is False
    await consumer.on_partitions_revoked({ITEMS_1})
    assert seen == [False], "owned nothing during the revocation's own drain"
    assert consumer.between_assignments is True


async def test_a_revocation_callback_that_fails_still_opens_the_window(
    consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka logs a failed ``on_partitions_revoked`` and joins the group all the same."""

    async def app_revocation(revoked: set[TP]) -> None:
        raise RuntimeError("drain failed")

    stub_revocation(consumer, monkeypatch, app_revocation)
    with pytest.raises(RuntimeError):
        await consumer.on_partitions_revoked({ITEMS_1})
    assert consumer.between_assignments is True


async def test_the_window_ends_when_the_assignment_is_handed_over_before_faust_runs_its_callbacks(
    consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    async def faust_assigned(self: Any, assigned: set[TP], generation_id: int = 0) -> None:
        seen.append(consumer.between_assignments)

    monkeypatch.setattr(driver.AIOKafkaConsumerThread, "on_partitions_assigned", faust_assigned)
    consumer.between_assignments = True
    await consumer._thread.on_partitions_assigned({ITEMS_1}, 4)
    assert seen == [False] and consumer.between_assignments is False


async def test_through_aiokafka_s_own_join_steps_the_window_spans_the_join_and_closes_after_on_assignment(
    consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka's ``_on_join_prepare`` awaits the listener's revocation before the JoinGroup; its
    ``_on_join_complete`` calls the assignor's ``on_assignment``, then the listener's ``on_partitions_assigned``.
    Run on a coordinator reduced to the state those two steps read, with a listener handing over as Faust's does."""
    seen: dict[str, bool] = {}

    async def app_revocation(revoked: set[TP]) -> None:
        seen["drain"] = consumer.between_assignments

    async def faust_assigned(self: Any, assigned: set[TP], generation_id: int = 0) -> None:
        seen["assigned"] = consumer.between_assignments

    stub_revocation(consumer, monkeypatch, app_revocation)
    monkeypatch.setattr(driver.AIOKafkaConsumerThread, "on_partitions_assigned", faust_assigned)

    def on_assignment() -> None:
        seen["on_assignment"] = consumer.between_assignments

    coordinator = joining_coordinator(consumer, generation_id=4, on_assignment=on_assignment)
    await GroupCoordinator._on_join_prepare(coordinator, SimpleNamespace(tps={ITEMS_1}))
    assert seen == {"drain": False} and consumer.between_assignments is True, seen
    assignment = ConsumerProtocolMemberAssignment(0, [("items", [1])], b"").encode()
    await GroupCoordinator._on_join_complete(coordinator, 5, "rebound-1", "faust", assignment)
    assert seen == {"drain": False, "on_assignment": True, "assigned": False}, seen
    assert consumer.between_assignments is False
