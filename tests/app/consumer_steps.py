"""What the consumer tests drive a revocation and a join with: the consumer's revocation with Faust's part stubbed
(:func:`stub_revocation`, :func:`record_revocation_steps`), and aiokafka's coordinator reduced to the state its own
join steps read (:func:`joining_coordinator`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.protocol.commit import OffsetCommitRequest
from aiokafka.protocol.group import JoinGroupRequest
from faust.types import TP

from app.consumer import ReboundConsumer
from tests.app_under_test import ITEMS_1


async def _nothing(*args: Any) -> None:
    return None


def stub_revocation(
    consumer: ReboundConsumer,
    monkeypatch: pytest.MonkeyPatch,
    app_revocation: Callable[[set[TP]], Awaitable[None]],
    *,
    waited: Callable[[], Awaitable[None]] = _nothing,
    commit: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """The consumer's revocation with ``app_revocation`` for the app's (where Faust stops the flow, waits for the
    streams and commits), ``waited`` for the wait for a running commit (by default none) and ``commit`` for the
    commit (by default one that commits nothing, after a turn of the loop)."""
    monkeypatch.setattr(consumer, "_app_revocation", app_revocation)
    monkeypatch.setattr(consumer, "maybe_wait_for_commit_to_finish", waited)
    monkeypatch.setattr(consumer, "commit", commit or partial(asyncio.sleep, 0, False))


def record_revocation_steps(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The steps of each revocation from now on, in order: ``wait for commit``, ``commit``, ``app revocation``."""
    steps: list[str] = []

    async def waited() -> None:
        steps.append("wait for commit")

    async def committed() -> bool:
        steps.append("commit")
        return False

    async def app_revocation(revoked: set[TP]) -> None:
        steps.append("app revocation")

    stub_revocation(consumer, monkeypatch, app_revocation, waited=waited, commit=committed)
    return steps


def joining_coordinator(
    consumer: ReboundConsumer, *, generation_id: int, on_assignment: Callable[[], None] = lambda: None
) -> SimpleNamespace:
    """aiokafka's coordinator before its first join (member id and generation as ``GroupCoordinator.__init__`` sets
    them), reduced to the state its ``_on_join_prepare`` and ``_on_join_complete`` read: a listener that hands the
    revocation and the assignment (of ``generation_id``) over to ``consumer`` as Faust's does, and an assignor whose
    ``on_assignment`` calls ``on_assignment``. The subscription's assignment is always ``items``-1."""

    class Listener:
        def on_partitions_revoked(self, revoked: Any) -> Any:
            return consumer.on_partitions_revoked(set(revoked))

        async def on_partitions_assigned(self, assigned: Any) -> None:
            await consumer._thread.on_partitions_assigned(set(assigned), generation_id)

    class Assignor:
        name = "faust"

        def on_assignment(self, assignment: Any) -> None:
            on_assignment()

    subscription = SimpleNamespace(
        listener=Listener(),
        begin_reassignment=lambda: None,
        assign_from_subscribed=lambda partitions: None,
        subscription=SimpleNamespace(assignment=None),
        assigned_partitions=lambda: {ITEMS_1},
    )
    coordinator = SimpleNamespace(
        generation=OffsetCommitRequest.DEFAULT_GENERATION_ID,
        member_id=JoinGroupRequest.UNKNOWN_MEMBER_ID,
        _rejoin_needed_fut=asyncio.get_running_loop().create_future(),
        _subscription=subscription,
        _group_subscription=None,
        group_id="rebound",
        _maybe_do_last_autocommit=_nothing,
        _lookup_assignor=lambda name: Assignor(),
        _stop_commit_offsets_refresh_task=_nothing,
        start_commit_offsets_refresh_task=lambda assignment: None,
    )
    coordinator.request_rejoin = partial(GroupCoordinator.request_rejoin, coordinator)
    return coordinator
