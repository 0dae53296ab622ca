"""Agent unit tests: real Faust agents through ``agent.test_context()``, no broker.

Outgoing topics are replaced by recorders: the agents only ever call ``send`` and ``get_topic_name`` on them, and
the runtime is where they are injected, so no Faust internals are patched.

The main and release agents hand events to the dispatcher, which runs them in tasks of their own: ``put`` on a test
context returns once the agent took the event. Here ``put`` (patched on Faust's test wrapper) also waits
until the dispatcher (and a tier agent's lanes) has nothing running, which is what most of these tests mean by "processed".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from faust.agents.agent import AgentTestWrapper
from faust.exceptions import ProducerSendError
from faust.types import TP

from agents.runtime import Runtime
from app.factory import build
from rebound.settings import load_settings
from rebound.state import KeyState
from tests.scripted_handler import handle


@dataclass
class Sent:
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    partition: int | None


@dataclass
class RecordingTopic:
    """Records what the agents send, and refuses records the way the real stack does.

    ``max_request_bytes`` is the producer's own check: aiokafka raises ``MessageSizeTooLargeError`` inside
    ``send`` and Faust's driver re-raises it as ``ProducerSendError`` (the original as ``__cause__``).
    A record with neither key nor value fails aiokafka's own assertion, unwrapped. ``broker_max_value_bytes`` is a
    broker refusing the record: the send is accepted and the returned future fails
    with aiokafka's own error class. ``refused`` counts both.
    """

    name: str
    sent: list[Sent] = field(default_factory=list)
    max_request_bytes: int | None = None
    broker_max_value_bytes: int | None = None
    refused: int = 0

    def get_topic_name(self) -> str:
        return self.name

    async def send(self, *, key: Any = None, value: Any = None, headers: Any = None, partition: Any = None) -> Any:
        # aiokafka's first check in send(), not a KafkaError, so Faust's driver lets it through unwrapped.
        assert not (value is None and key is None), "Need at least one: key or value"
        pairs = list(headers or [])
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.max_request_bytes is not None:
            size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, pairs)
            if size > self.max_request_bytes:
                self.refused += 1
                try:
                    raise MessageSizeTooLargeError(f"The message is {size} bytes when serialized")
                except MessageSizeTooLargeError as exc:
                    raise ProducerSendError(f"Error while sending: {exc!r}") from exc
        if self.broker_max_value_bytes is not None and value is not None and len(value) > self.broker_max_value_bytes:
            self.refused += 1
            done.set_exception(MessageSizeTooLargeError(f"{len(value)} bytes"))
            return done
        self.sent.append(Sent(key, value, dict(pairs), partition))
        done.set_result(("ack", self.name, len(self.sent) - 1))
        return done


class FakeClock:
    def __init__(self, now_ms: int | None = None) -> None:
        # Starts at the real time: test_context stamps records with the wall clock, and tier validation compares.
        self.now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def put_waits_for_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """``put`` returns once the event's work is done, not only taken: the dispatcher runs it in a task of its own."""
    original = AgentTestWrapper.put

    async def put(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        dispatcher = getattr(self.app, "rebound_dispatcher", None)
        if dispatcher is not None:
            await dispatcher.wait_idle()
        lanes = getattr(self.fun, "rebound_lanes", None)  # a tier agent parks in its partitions' lanes
        if lanes is not None:
            await lanes.wait_idle()
        return result

    monkeypatch.setattr(AgentTestWrapper, "put", put)


@pytest.fixture
def make_runtime(tmp_path: Path, clock: FakeClock) -> Iterator[Callable[..., Runtime]]:
    def factory(**settings: Any) -> Runtime:
        values: dict[str, Any] = {
            "app_id": "agent-test",
            "main_topics": "items",
            "retry_sequence": "1s,1s,2s",
            "store": "memory://",
            "data_dir": str(tmp_path / "data"),
            "web_enabled": False,
            "provision_topics": False,
            "handler": "tests.scripted_handler:handle",
            **settings,
        }
        runtime = build(load_settings(**values), handler=handle, partitions=1)
        # test_context has no running producer, so changelog records are never acknowledged here; the integration
        # tests cover confirmation on the real broker.
        runtime.store.confirm_writes = False
        runtime.clock = clock
        runtime.tier_topics = {name: RecordingTopic(name) for name in runtime.tier_topics}  # type: ignore[misc]
        runtime.failed_topics = {main: RecordingTopic(f"{main}.failed") for main in runtime.failed_topics}
        runtime.attempts_topic = RecordingTopic("agent-test.attempts")
        runtime.release_topic = RecordingTopic("agent-test.release")
        runtime.main_topics = {name: RecordingTopic(name) for name in runtime.main_topics}
        # No group in test_context: this worker owns partition 0 of the release topic, as after an assignment.
        owned = {TP(runtime.release_topic.get_topic_name(), 0)}
        runtime.app.assignor.assigned_actives = lambda: owned  # type: ignore[method-assign]
        runtime.app.assignor.is_active = lambda tp: tp in owned  # type: ignore[method-assign]
        runtime.app.rebound_dispatcher = runtime.dispatcher  # type: ignore[attr-defined]
        return runtime

    yield factory


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a stream to finish an event: ``put`` returns once the event is taken, not once it is processed."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def nothing_waits(runtime: Runtime, key: bytes) -> bool:
    """Nothing of ``key`` is parked, held or blocking: its state record is gone, or only remembers ended messages
    and retries on their way (``rebound.state.Mark``), which a settle and a dead letter leave behind on purpose."""
    raw = runtime.table.get(key)
    if raw is None:
        return True
    state = KeyState.from_json(raw)
    return not state.parked and not state.held and state.blocked_by is None
