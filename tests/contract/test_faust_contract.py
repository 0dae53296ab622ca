"""The contract with Faust, mode and aiokafka: every entry of ``inventory.py`` against the installed releases.

No broker: names are checked on the classes, behaviours on real objects of the three libraries (queues, the consumer
of an app that is built but not started). A failure names the name and who relies on it; docs/upgrading.md says
what to do about it.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import importlib
import inspect
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from functools import cache
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiokafka
import faust
import faust.channels
import mode
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.fetcher import READ_UNCOMMITTED, PartitionRecords
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.errors import CorruptRecordException
from aiokafka.record.memory_records import MemoryRecords
from faust.transport import conductor
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_driver
from faust.transport.producer import ProducerBuffer
from faust.types import TP
from faust.types.tuples import ConsumerMessage, FutureMessage, PendingMessage
from mode.utils.futures import StampedeWrapper, notify, stampede
from mode.utils.queues import FlowControlEvent, ThrowableQueue

from agents.runtime import Runtime
from app.consumer import _FAUST_MAYBE_START_PRODUCER, CountingFlowControl, ReboundApp, ReboundConsumer
from app.fetch_guard import LastBatchRecords
from app.producer import ReboundProducer
from tests.app_under_test import ITEMS_1, turns_taken
from tests.contract import inventory
from tests.contract.inventory import ATTRIBUTES, BEHAVIOURS, METHODS, MODULE_NAMES, Attribute, Method, ModuleName
from tests.raw_batches import batch, with_bad_crc

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = (faust, mode, aiokafka)
SCANNED = ("app", "agents", "tables")


def _versions() -> str:
    return ", ".join(f"{name} {version(name)}" for name in ("faust-streaming", "mode-streaming", "aiokafka"))


def _broken(what: str, why: str, detail: str) -> str:
    return f"{what} is gone or changed ({detail}) in {_versions()}: {why}. See docs/upgrading.md."


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@cache
def _class_sources(owner: str) -> tuple[str, ...]:
    """The source of every class of ``owner``'s MRO that belongs to Faust, mode or aiokafka, or to asyncio (mode's
    queues are asyncio's: ``_queue`` is assigned there)."""
    sources = []
    for klass in _resolve(owner).__mro__:
        if klass.__module__.split(".")[0] in ("faust", "mode", "aiokafka", "asyncio"):
            try:
                sources.append(inspect.getsource(klass))
            except (OSError, TypeError):  # a compiled class: checked by behaviour instead
                continue
    return tuple(sources)


@pytest.mark.parametrize("entry", METHODS, ids=lambda entry: f"{entry.owner}.{entry.name}")
def test_method(entry: Method) -> None:
    what = f"{entry.owner}.{entry.name}"
    method = getattr(_resolve(entry.owner), entry.name, None)
    assert callable(method), _broken(what, entry.why, "no such method")
    params = tuple(name for name in inspect.signature(method).parameters if name != "self")
    assert params == entry.params, _broken(what, entry.why, f"parameters {params}, expected {entry.params}")
    is_async = inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)
    assert is_async == entry.is_async, _broken(what, entry.why, f"async {is_async}, expected {entry.is_async}")


@pytest.mark.parametrize("entry", ATTRIBUTES, ids=lambda entry: f"{entry.owner}.{entry.name}")
def test_attribute(entry: Attribute) -> None:
    what = f"{entry.owner}.{entry.name}"
    if hasattr(_resolve(entry.owner), entry.name):
        return
    name = re.escape(entry.name)
    assigned = re.compile(rf"self\.{name}\s*(:[^=\n]*)?=|^\s+{name}\s*:", re.MULTILINE)
    assert any(assigned.search(source) for source in _class_sources(entry.owner)), _broken(
        what, entry.why, "no class of its MRO assigns or declares it"
    )


@pytest.mark.parametrize("entry", MODULE_NAMES, ids=lambda entry: f"{entry.module}.{entry.name}")
def test_module_name(entry: ModuleName) -> None:
    module = importlib.import_module(entry.module)
    assert hasattr(module, entry.name), _broken(f"{entry.module}.{entry.name}", entry.why, "not in the module")


@pytest.mark.parametrize("subclass", sorted(inventory.REBOUND_OVERRIDES))
def test_rebound_s_subclasses_override_exactly_the_inventoried_methods(subclass: str) -> None:
    """An override whose base method is gone is dead code; a base method a new release added under a name Rebound
    already uses would be replaced unseen. Both fail here."""
    klass = _resolve(subclass)
    base = klass.__mro__[1]
    defined = {name for name in vars(klass) if not name.startswith("__") and name not in ("logger", "_abc_impl")}
    overrides = {name for name in defined if hasattr(base, name)}
    expected = inventory.REBOUND_OVERRIDES[subclass]
    assert overrides == expected, (
        f"{subclass} now overrides {sorted(overrides - expected)} of {base.__module__}.{base.__qualname__} and no "
        f"longer {sorted(expected - overrides)} ({_versions()}): check each against the new release and update "
        "tests/contract/inventory.py. See docs/upgrading.md."
    )


def test_rebound_s_consumer_attributes_do_not_clash_with_faust_s() -> None:
    """ReboundConsumer sets its own attributes before Faust's __init__ runs: one Faust also assigns would be lost."""
    tree = ast.parse(inspect.getsource(ReboundConsumer.__init__).strip())
    own = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node.ctx, ast.Store)
    } - {"_app_revocation", "_on_partitions_revoked"}
    faust_sources = "\n".join(_class_sources("faust.transport.drivers.aiokafka.Consumer"))
    clashes = sorted(name for name in own if re.search(rf"self\.{re.escape(name)}\b", faust_sources))
    assert not clashes, f"Faust's consumer now uses {clashes} too ({_versions()}): rename Rebound's"


@cache
def _library_names() -> frozenset[str]:
    """Every private name the three libraries define or use on an object (``def _x``, ``self._x``, ``._x``)."""
    names: set[str] = set()
    pattern = re.compile(r"(?:\.|def |class )(_[A-Za-z]\w*)|^\s+(_[A-Za-z]\w*)\s*[:=]", re.MULTILINE)
    for package in LIBRARIES:
        for path in Path(str(package.__file__)).parent.rglob("*.py*"):  # .py and Cython's .pyx
            if path.suffix in (".py", ".pyx"):
                for match in pattern.finditer(path.read_text(errors="replace")):
                    names.add(match.group(1) or match.group(2))
    return frozenset(names)


def _python_files(*paths: str) -> Iterator[Path]:
    for relative in paths:
        path = ROOT / relative
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _private_names_used(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
                names.add(name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("faust", "mode", "aiokafka"):
            names.update(alias.name for alias in node.names if alias.name.startswith("_"))
    return names


def _defined_by_rebound() -> set[str]:
    """Private names Rebound defines (methods, ``self._x`` assignments, class attributes). In its subclasses of Faust's
    classes these are checked by the two tests above (overrides, clashes); elsewhere they are Rebound's own."""
    names: set[str] = set()
    for path in _python_files("app", "agents", "tables", "rebound"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for statement in node.body:
                    target = statement.target if isinstance(statement, ast.AnnAssign) else None
                    if isinstance(target, ast.Name):
                        names.add(target.id)
    return {name for name in names if name.startswith("_")}


def test_every_private_name_used_is_in_the_inventory() -> None:
    """A private name of Faust, mode or aiokafka used in the consumer layer, the tables or the agents must be listed
    (with who relies on it) so that its check runs."""
    listed = inventory.all_names() | _defined_by_rebound()
    library = _library_names()
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _python_files(*SCANNED)
        for name in _private_names_used(path)
        if name in library and name not in listed
    }
    assert not missing, (
        f"private names of Faust, mode or aiokafka used but not in tests/contract/inventory.py: {sorted(missing)}"
    )


def test_every_behaviour_has_its_test() -> None:
    tests = {name for name in globals() if name.startswith("test_behaviour_")}
    tests |= {f"test_behaviour_{key}" for key in _behaviours_tested_elsewhere()}
    missing = [entry.key for entry in BEHAVIOURS if f"test_behaviour_{entry.key}" not in tests]
    assert not missing, f"behaviours in tests/contract/inventory.py without a test_behaviour_<key>: {missing}"


def _behaviours_tested_elsewhere() -> set[str]:
    suspicions = (Path(__file__).parent / "test_suspicions.py").read_text()
    return set(re.findall(r"def test_behaviour_(\w+)\(", suspicions))


def _why(key: str) -> str:
    return next(entry.why for entry in BEHAVIOURS if entry.key == key)


# -- behaviours on real objects


async def test_behaviour_throwable_queue_clear_cancels_putters() -> None:
    queue: ThrowableQueue[int] = ThrowableQueue(maxsize=1, flow_control=FlowControlEvent(initially_suspended=False))
    queue.put_nowait(1)
    putter = asyncio.ensure_future(queue.put(2))
    await asyncio.sleep(0)
    queue.clear()
    await asyncio.gather(putter, return_exceptions=True)
    assert putter.cancelled(), _broken(
        "mode.utils.queues.ThrowableQueue.clear",
        _why("throwable_queue_clear_cancels_putters"),
        "a waiting put was not cancelled",
    )


async def test_behaviour_conductor_put_swallows_cancellation() -> None:
    source = inspect.getsource(conductor.ConductorCompiler.build)
    assert "await asyncio.wait(" in source and "asyncio.ensure_future(dest_chan.put(dest_event))" in source, _broken(
        "faust.transport.conductor.ConductorCompiler.build",
        _why("conductor_put_swallows_cancellation"),
        "the put to a full queue is no longer wrapped in asyncio.wait",
    )
    queue: ThrowableQueue[int] = ThrowableQueue(maxsize=1, flow_control=FlowControlEvent(initially_suspended=False))
    queue.put_nowait(1)

    async def hand_over() -> str:  # the conductor's wait, as it is written there
        await asyncio.wait([asyncio.ensure_future(queue.put(2))], return_when=asyncio.ALL_COMPLETED)
        return "returned"

    waiting = asyncio.ensure_future(hand_over())
    await asyncio.sleep(0.01)
    queue.clear()
    assert await asyncio.wait_for(waiting, 1) == "returned"
    assert queue.empty()  # the record reached no queue, yet the hand-over returned normally


async def test_behaviour_flow_control_resume_clears_stream_queues() -> None:
    flow_control = FlowControlEvent()
    queue: ThrowableQueue[int] = ThrowableQueue(maxsize=4, flow_control=flow_control, clear_on_resume=True)
    queue.put_nowait(1)
    flow_control.suspend()
    flow_control.resume()
    assert queue.empty(), _broken(
        "mode.utils.queues.FlowControlEvent.resume",
        _why("flow_control_resume_clears_stream_queues"),
        "a queue made with clear_on_resume kept its items",
    )
    assert "clear_on_resume=True" in inspect.getsource(faust.channels.Channel), _broken(
        "faust.channels.Channel.queue", _why("flow_control_resume_clears_stream_queues"), "no clear_on_resume"
    )


def _calls_in_order(function: Any, calls: list[str]) -> list[int]:
    source = inspect.getsource(function)
    return [source.find(call) for call in calls]


@pytest.mark.parametrize("method", ["on_recovery_completed", "_resume_streams"])
def test_behaviour_recovery_resumes_flow_control_before_consumer_flow(method: str) -> None:
    from faust.tables.recovery import Recovery

    calls = [
        "consumer.resume_partitions(",
        "consumer.perform_seek()",
        "flow_control.resume()",
        "consumer.resume_flow()",
    ]
    positions = _calls_in_order(getattr(Recovery, method), calls)
    assert -1 not in positions and positions == sorted(positions), _broken(
        f"faust.tables.recovery.Recovery.{method}",
        _why("recovery_resumes_flow_control_before_consumer_flow"),
        f"calls {dict(zip(calls, positions, strict=True))} (source positions) are no longer in that order",
    )


def test_behaviour_recovery_gathers_table_completions_with_asyncio_wait() -> None:
    from faust.tables.recovery import Recovery

    source = inspect.getsource(Recovery.on_recovery_completed)
    assert "table.on_recovery_completed(" in source and "await asyncio.wait(callback_coros)" in source, _broken(
        "faust.tables.recovery.Recovery.on_recovery_completed",
        _why("recovery_gathers_table_completions_with_asyncio_wait"),
        "the tables' completions are no longer awaited with asyncio.wait",
    )


async def test_behaviour_recovery_highwaters_are_last_offsets(runtime: Runtime) -> None:
    recovery = runtime.app.tables.recovery
    written, empty = TP("changelog", 0), TP("changelog", 1)

    class Ends:
        async def highwaters(self, *partitions: TP) -> dict[TP, int]:
            return {written: 10, empty: 0}  # the offsets the next records will take

    kept: Counter[TP] = Counter()
    await recovery._build_highwaters(Ends(), {written, empty}, kept, "active")
    source = inspect.getsource(faust_driver.AIOKafkaConsumerThread._highwaters)
    assert dict(kept) == {written: 9, empty: -1} and "consumer.end_offsets(" in source, _broken(
        "faust.tables.recovery.Recovery._build_highwaters",
        _why("recovery_highwaters_are_last_offsets"),
        f"end offsets 10 and 0 kept as {dict(kept)}; end_offsets in the driver's _highwaters: {'end_offsets' in source}",
    )


def test_behaviour_revocation_forgets_acknowledgements_before_the_app_callback() -> None:
    calls = [
        "self._gap.pop(tp, None)",
        "self._acked.pop(tp, None)",
        "self._acked_index.pop(tp, None)",
        "self._committed_offset.pop(tp, None)",
        "self._on_partitions_revoked",
    ]
    positions = _calls_in_order(faust_consumer.Consumer.on_partitions_revoked, calls)
    assert -1 not in positions and positions[-1] == max(positions), _broken(
        "faust.transport.consumer.Consumer.on_partitions_revoked",
        _why("revocation_forgets_acknowledgements_before_the_app_callback"),
        f"source positions {dict(zip(calls, positions, strict=True))}",
    )


@pytest.mark.parametrize("assigned", [True, False], ids=["assignment", "no assignment"])
async def test_behaviour_app_revocation_stops_the_flow_only_with_an_assignment(
    runtime: Runtime, consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch, assigned: bool
) -> None:
    """Faust's own revocation (the base class's, not ReboundApp's), with aiokafka's consumer (never started) assigned
    items-1, or resubscribed since."""
    kafka = AIOKafkaConsumer(group_id="contract", bootstrap_servers="127.0.0.1:1")
    kafka.subscribe(topics=["items"])
    kafka._subscription.assign_from_subscribed({aiokafka.TopicPartition("items", 1)})
    if not assigned:
        kafka.subscribe(topics=["items", "other"])
    consumer._thread._consumer = kafka
    monkeypatch.setattr(consumer, "commit", _no_commit)
    try:
        await faust.App._on_partitions_revoked(runtime.app, {ITEMS_1})
    finally:
        kafka._closed = True
    assert runtime.app.crash_reason is None, f"Faust's revocation crashed the app: {runtime.app.crash_reason!r}"
    assert consumer.flow_active is not assigned, _broken(
        "faust.app.base.App._on_partitions_revoked",
        _why("app_revocation_stops_the_flow_only_with_an_assignment"),
        f"with{'' if assigned else ' no'} assignment the flow is {'active' if consumer.flow_active else 'stopped'}",
    )


async def _nothing(*args: Any) -> None:
    return None


async def _no_commit(*args: Any, **kwargs: Any) -> bool:
    """Faust's ``commit``, committing nothing (``wait_empty`` ends with ``commit(start_new_transaction=False)``)."""
    return False


async def test_behaviour_a_resubscription_s_revocation_reads_no_assignment() -> None:
    """aiokafka's own ``_on_join_prepare`` run on its real subscription state, its coordinator reduced to what that
    step reads: the listener is handed the previous assignment while the consumer's assignment reads empty."""
    kafka = AIOKafkaConsumer(group_id="contract", bootstrap_servers="127.0.0.1:1")
    seen: list[tuple[set[Any], set[Any]]] = []

    class Listener(aiokafka.ConsumerRebalanceListener):  # type: ignore[misc]
        def on_partitions_revoked(self, revoked: Any) -> None:
            seen.append((set(revoked), set(kafka.assignment())))

        def on_partitions_assigned(self, assigned: Any) -> None:
            pass

    items_1 = aiokafka.TopicPartition("items", 1)
    try:
        kafka.subscribe(topics=["items"], listener=Listener())
        kafka._subscription.assign_from_subscribed({items_1})
        previous = kafka._subscription.subscription.assignment
        kafka.subscribe(topics=["items", "other"], listener=Listener())
        coordinator = SimpleNamespace(
            _subscription=kafka._subscription,
            _group_subscription=None,
            group_id="contract",
            _maybe_do_last_autocommit=_nothing,
        )
        await GroupCoordinator._on_join_prepare(coordinator, previous)
    finally:
        kafka._closed = True
    assert seen == [({items_1}, set())], _broken(
        "aiokafka.consumer.group_coordinator.GroupCoordinator._on_join_prepare",
        _why("a_resubscription_s_revocation_reads_no_assignment"),
        f"(revoked, assignment) seen by the listener: {seen}",
    )


async def test_behaviour_flow_control_resume_goes_through_clear() -> None:
    counting = CountingFlowControl()
    queue: ThrowableQueue[int] = ThrowableQueue(maxsize=2, flow_control=counting, clear_on_resume=True)
    queue.put_nowait(1)
    counting.suspend()
    counting.resume()
    assert counting.clears == 1 and queue.empty(), _broken(
        "mode.utils.queues.FlowControlEvent.resume",
        _why("flow_control_resume_goes_through_clear"),
        f"resume() emptied the queues without self.clear() (clears counted: {counting.clears})",
    )
    assert counting.queued(1) is False  # queued() walks _queues and each queue's _queue without failing


async def test_behaviour_stream_queues_obey_the_app_s_flow_control(runtime: Runtime) -> None:
    app = runtime.app
    assert isinstance(app, ReboundApp) and isinstance(app.flow_control, CountingFlowControl)
    queue = app.FlowControlQueue(maxsize=4, clear_on_resume=True)
    assert queue._flow_control is app.flow_control, _broken(
        "faust.app.base.App.FlowControlQueue",
        _why("stream_queues_obey_the_app_s_flow_control"),
        "the queue is not managed by app.flow_control",
    )
    channel_queue = app.topic("items").clone(is_iterator=True).queue  # what an agent's stream reads
    event = type("Event", (), {"message": object()})()
    channel_queue.put_nowait(event)
    assert app.flow_control.queued(event.message), _broken(
        "faust.channels.Channel.queue",
        _why("stream_queues_obey_the_app_s_flow_control"),
        "a stream's queue is not among the queues app.flow_control manages",
    )
    before = app.flow_control.clears
    app.flow_control.resume()
    assert channel_queue.empty() and app.flow_control.clears == before + 1


def test_behaviour_topic_maxsize_sizes_its_streams_queue() -> None:
    why = _why("topic_maxsize_sizes_its_streams_queue")
    from agents.topics import raw_topic

    app = faust.App("contract-maxsize", broker="kafka://127.0.0.1:1", stream_buffer_maxsize=4096)
    topic = raw_topic(app, "items", maxsize=37)
    stream_channel = topic.clone(is_iterator=True)  # what an agent iterating the topic reads from
    assert stream_channel.maxsize == 37, _broken("faust.topics.Topic._clone_args", why, "a clone lost maxsize")
    assert stream_channel.queue.maxsize == 37, _broken(
        "faust.channels.Channel.queue", why, f"the stream's queue holds {stream_channel.queue.maxsize}"
    )


def _message(offset: int) -> ConsumerMessage:
    message = ConsumerMessage("items", 1, offset, 0.0, 0, [], b"k", b"v", None, tp=ITEMS_1)
    message.tracked = True  # as a stream marks it before its agent sees it
    return message


async def test_behaviour_consumer_ack_bookkeeping(consumer: ReboundConsumer) -> None:
    why = _why("consumer_ack_bookkeeping")
    consumer._committed_offset[ITEMS_1] = 5
    below, at = _message(4), _message(7)
    consumer._unacked_messages.add(below)
    consumer._unacked_messages.add(at)
    assert faust_consumer.Consumer.ack(consumer, below) is False, _broken("Consumer.ack", why, "took an old offset")
    assert faust_consumer.Consumer.ack(consumer, at) is True, _broken("Consumer.ack", why, "refused a new offset")
    assert (list(consumer._acked[ITEMS_1]), consumer._acked_index[ITEMS_1], consumer._n_acked) == ([7], {7}, 1), (
        _broken("Consumer.ack", why, "_acked, _acked_index or _n_acked not filled as before")
    )
    assert at not in consumer._unacked_messages, _broken("Consumer.ack", why, "_unacked_messages kept the message")


async def test_behaviour_faust_new_offset_commits_over_a_missing_head(consumer: ReboundConsumer) -> None:
    consumer._committed_offset[ITEMS_1] = 95
    consumer._acked[ITEMS_1] = [96, 97]
    consumer._acked_index[ITEMS_1] = {96, 97}
    assert faust_driver.Consumer._new_offset(consumer, ITEMS_1) == 98, (
        f"Faust's Consumer._new_offset no longer commits over a missing head offset ({_versions()}): "
        f"{_why('faust_new_offset_commits_over_a_missing_head')}. See docs/upgrading.md."
    )


async def test_behaviour_notify_tolerates_none() -> None:
    notify(None)
    future = asyncio.get_running_loop().create_future()
    notify(future)
    notify(future)  # already done: no InvalidStateError
    assert future.done()


def test_behaviour_fetch_max_wait_read_when_the_fetcher_starts() -> None:
    source = inspect.getsource(AIOKafkaConsumer.start)
    assert "fetch_max_wait_ms=self._fetch_max_wait_ms" in source, _broken(
        "aiokafka.AIOKafkaConsumer._fetch_max_wait_ms",
        _why("fetch_max_wait_read_when_the_fetcher_starts"),
        "start() no longer hands it to the fetcher",
    )
    created = inspect.getsource(faust_driver.AIOKafkaConsumerThread._create_worker_consumer)
    assert "fetch_max_wait_ms=1500" in created, (
        f"faust's _create_worker_consumer no longer hard-codes fetch_max_wait_ms=1500 ({_versions()}): "
        "app/consumer.py's override may be unnecessary now; check it."
    )


async def test_behaviour_partition_records_take_batches_from_the_record_set_lazily() -> None:
    good = bytearray(batch([(b"a", b"1"), (b"b", b"2")]))
    bad = bytearray(with_bad_crc(batch([(b"c", b"3")])))
    bad[0:8] = (2).to_bytes(8, "big")  # base offset 2, outside the CRC
    records = PartitionRecords(
        TP("items", 0), MemoryRecords(bytes(good + bad)), [], 0, None, None, True, READ_UNCOMMITTED
    )
    swapped = LastBatchRecords(records._records)  # after the object is made, before its first step
    records._records = swapped
    keys = [next(records).key, next(records).key]
    assert keys == [b"a", b"b"] and swapped.last_batch is not None, _broken(
        "aiokafka.consumer.fetcher.PartitionRecords._records",
        _why("partition_records_take_batches_from_the_record_set_lazily"),
        "the records were not taken through the record set swapped in before the first step",
    )
    with pytest.raises(CorruptRecordException):
        next(records)
    failed = (swapped.last_batch.base_offset, swapped.last_batch.next_offset)
    assert failed == (2, 3), _broken(
        "aiokafka.consumer.fetcher.PartitionRecords._unpack_records",
        _why("partition_records_take_batches_from_the_record_set_lazily"),
        f"the last batch handed out before the decode error spans {failed}, not the failing batch (2, 3)",
    )


async def test_behaviour_every_publish_asks_the_app_for_its_producer(runtime: Runtime) -> None:
    why = _why("every_publish_asks_the_app_for_its_producer")
    app: Any = runtime.app
    sent: list[tuple[str, Any]] = []

    class Producer:
        async def send(self, topic: str, key: Any, value: Any, **_: Any) -> Any:
            sent.append((topic, key))
            future = asyncio.get_running_loop().create_future()
            return future

    asked: list[str] = []

    async def maybe_start_producer() -> Any:
        asked.append("asked")
        return Producer()

    app.maybe_start_producer = maybe_start_producer  # on the instance: what every publish reaches
    changelog: Any = runtime.store.states.changelog_topic
    for topic in (changelog, runtime.attempts_topic):
        await topic.publish_message(topic.as_future_message(key=b"k", value=b"v"), wait=False)
    assert asked == ["asked", "asked"] and [key for _, key in sent] == [b"k", b"k"], _broken(
        "faust.topics.Topic.publish_message", why, f"asked the app {len(asked)} times for {len(sent)} records sent"
    )


async def test_behaviour_faust_maybe_start_producer_is_a_stampede_around_producer_maybe_start(
    runtime: Runtime,
) -> None:
    why = _why("faust_maybe_start_producer_is_a_stampede_around_producer_maybe_start")
    what = "faust.app.base.App.maybe_start_producer"
    declared = faust.App.__dict__.get("maybe_start_producer")
    assert isinstance(declared, stampede), _broken(what, why, f"it is {declared!r}, not a stampede")
    assert declared.__wrapped__ is _FAUST_MAYBE_START_PRODUCER, _broken(what, why, "__wrapped__ is not its body")
    assert inspect.iscoroutinefunction(_FAUST_MAYBE_START_PRODUCER), _broken(what, why, "its body is not async")
    app: Any = runtime.app
    starts: list[str] = []

    async def maybe_start() -> bool:
        starts.append("maybe_start")
        return False

    producer = app.producer
    producer.maybe_start = maybe_start
    assert await _FAUST_MAYBE_START_PRODUCER(app) is producer and starts == ["maybe_start"], _broken(
        what, why, "its body no longer returns app.producer after its maybe_start()"
    )
    got, turns = await turns_taken(declared.__get__(app, type(app))())
    assert got is producer, _broken(what, why, "the stampede returned something else")
    assert turns >= 3, (
        f"Faust's App.maybe_start_producer now gives the event loop away {turns} times per call ({_versions()}): "
        "ReboundApp.maybe_start_producer (app/consumer.py) may not be needed any more."
    )
    assert isinstance(app.__dict__.get("maybe_start_producer"), StampedeWrapper), _broken(
        what, why, "the stampede no longer caches its wrapper in the instance's __dict__ (ReboundApp may simplify)"
    )
    app.in_transaction = True
    assert await _FAUST_MAYBE_START_PRODUCER(app) is app.consumer.transactions, _broken(
        what, why, "in a transaction it no longer gives the consumer's transaction manager"
    )


async def test_behaviour_a_started_service_s_maybe_start_returns_at_once() -> None:
    why = _why("a_started_service_s_maybe_start_returns_at_once")
    seen: list[bool] = []

    class Connecting(mode.Service):
        async def on_start(self) -> None:
            seen.append(self.started)  # already marked started while it starts
            await asyncio.sleep(0.01)

    service = Connecting()
    starting = asyncio.ensure_future(service.maybe_start())
    while not seen:
        await asyncio.sleep(0)
    assert seen == [True], _broken("mode.services.Service.start", why, "not marked started before on_start")
    assert await asyncio.wait_for(service.maybe_start(), 0.005) is False, _broken(
        "mode.services.Service.maybe_start", why, "a started service's maybe_start() waited or started it again"
    )
    await starting
    await service.stop()


def test_behaviour_faust_app_stop_flushes_the_producer_after_the_streams() -> None:
    from faust.app.base import App

    stop_calls = ["await self._stop_consumer()", "await self._producer_flush("]
    flush_calls = ["await self._producer.flush()"]
    positions = _calls_in_order(App.on_stop, stop_calls) + _calls_in_order(App._producer_flush, flush_calls)
    assert -1 not in positions and positions[:2] == sorted(positions[:2]), _broken(
        "faust.app.base.App.on_stop / App._producer_flush",
        _why("faust_app_stop_flushes_the_producer_after_the_streams"),
        f"calls {dict(zip(stop_calls + flush_calls, positions, strict=True))} (source positions) changed",
    )


def test_behaviour_faust_commit_flushes_the_producer_then_commits() -> None:
    calls = ["if self.in_transaction:", "await self.app.producer.flush()", "await self._commit("]
    positions = _calls_in_order(faust_consumer.Consumer._commit_offsets, calls)
    assert -1 not in positions and positions == sorted(positions), _broken(
        "faust.transport.consumer.Consumer._commit_offsets",
        _why("faust_commit_flushes_the_producer_then_commits"),
        f"source positions {dict(zip(calls, positions, strict=True))}",
    )


class _RecordingChannel:
    """What the producer buffer's task calls for each record: records the order, and holds a record on request."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.published: list[Any] = []
        self.hold: dict[Any, asyncio.Event] = {}

    async def publish_message(self, fut: FutureMessage, wait: bool = False) -> FutureMessage:
        assert wait is False
        key = fut.message.key
        self.started.append(key)
        if key in self.hold:
            await self.hold[key].wait()
        await asyncio.sleep(0)  # aiokafka's send takes a turn or more
        self.published.append(key)
        fut.set_result(None)  # type: ignore[arg-type]
        return fut

    def record(self, key: Any) -> FutureMessage:
        return FutureMessage(PendingMessage(self, key, None, None, None, None, None, None, None))  # type: ignore[arg-type]


async def _running_buffer(runtime: Runtime) -> ProducerBuffer:
    buffer = ProducerBuffer()
    buffer.app = runtime.app
    await buffer.start()
    return buffer


async def test_behaviour_the_app_s_producer_comes_from_its_transport(runtime: Runtime) -> None:
    app = runtime.app
    assert type(app.transport).Producer is ReboundProducer and type(app.producer) is ReboundProducer, _broken(
        "faust.app.base.App._new_producer",
        _why("the_app_s_producer_comes_from_its_transport"),
        f"the app's producer is a {type(app.producer).__qualname__}",
    )


async def test_behaviour_producer_buffer_hands_over_one_at_a_time_in_order(runtime: Runtime) -> None:
    why = _why("producer_buffer_hands_over_one_at_a_time_in_order")
    channel = _RecordingChannel()
    channel.hold["a"] = asyncio.Event()
    buffer = await _running_buffer(runtime)
    try:
        for key in ("a", "b", "c"):
            buffer.put(channel.record(key))
        for _ in range(20):
            await asyncio.sleep(0)
        assert channel.started == ["a"] and list(buffer.pending._queue) and buffer.size == 2, _broken(
            "faust.transport.producer.ProducerBuffer._handle_pending",
            why,
            f"with the first record's publish held, publishes started {channel.started}, {buffer.size} queued",
        )
        channel.hold["a"].set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert channel.published == ["a", "b", "c"] and buffer.size == 0, _broken(
            "faust.transport.producer.ProducerBuffer._handle_pending", why, f"published {channel.published}"
        )
    finally:
        await buffer.stop()


async def test_behaviour_producer_buffer_flush_waits_for_an_empty_buffer(runtime: Runtime) -> None:
    """Two records written for every one the buffer hands over: Faust's flush does not end while they keep coming."""
    channel = _RecordingChannel()
    buffer = await _running_buffer(runtime)
    written = 0

    def write() -> None:
        nonlocal written
        buffer.put(channel.record(written))
        written += 1

    try:
        for _ in range(10):
            write()
        flush = asyncio.ensure_future(buffer.flush())
        while written < 300 and not flush.done():
            write()
            write()
            for _ in range(3):
                await asyncio.sleep(0)
        assert not flush.done(), (
            f"Faust's ProducerBuffer.flush ended with records still being written ({_versions()}): app/producer.py's "
            "ReboundProducer may not be needed any more. See docs/upgrading.md."
        )
        await flush  # the writes have stopped: it ends once the buffer is empty
        assert buffer.size == 0 and channel.published == list(range(written)), _broken(
            "faust.transport.producer.ProducerBuffer.flush",
            _why("producer_buffer_flush_waits_for_an_empty_buffer"),
            f"{buffer.size} records left after the flush",
        )
    finally:
        await buffer.stop()


@contextlib.asynccontextmanager
async def other_worker() -> AsyncIterator[tuple[str, list[tuple[str, str, str | None]]]]:
    """A stand-in for another worker's web server on loopback: its URL, and each request forwarded to it (method, raw
    path with its query, Authorization), answered 202 ``{"answered_by": "other"}``."""
    from aiohttp import web as aiohttp_web
    from aiohttp.test_utils import TestServer

    forwarded: list[tuple[str, str, str | None]] = []

    async def answer(request: aiohttp_web.Request) -> aiohttp_web.Response:
        forwarded.append((request.method, request.raw_path, request.headers.get("Authorization")))
        return aiohttp_web.json_response({"answered_by": "other"}, status=202)

    other_app = aiohttp_web.Application()
    other_app.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(other_app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), forwarded
    finally:
        await server.close()


KAFKA_MURMUR2 = {b"21": -973932308, b"foobar": -790332482}
"""Test vectors of Kafka's own ``Utils.murmur2`` (its UtilsTest), the hash of the Java producer's default partitioner
(``toPositive(murmur2(key)) % partitions``)."""


async def test_behaviour_router_routes_a_table_key_by_its_bytes(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokafka.partitioner import murmur2
    from faust.exceptions import SameNode
    from yarl import URL

    why = _why("router_routes_a_table_key_by_its_bytes")
    app, table = runtime.app, runtime.table
    changelog = table.changelog_topic.get_topic_name()
    for key, java in KAFKA_MURMUR2.items():  # aiokafka's murmur2 is Kafka's (unsigned here)
        assert murmur2(key) == java & 0xFFFFFFFF, _broken("aiokafka.partitioner.murmur2", why, f"murmur2({key!r})")

    def java_partition(key: bytes, partitions: int = 2) -> int:
        return (murmur2(key) & 0x7FFFFFFF) % partitions

    # The worker's producer, made but not connected, told the changelog topic has two partitions (the runtime's).
    producer = app.producer
    producer._producer = producer._new_producer()  # type: ignore[attr-defined]
    metadata = producer._producer._metadata  # type: ignore[attr-defined]
    monkeypatch.setattr(metadata, "partitions_for_topic", lambda topic: {0, 1} if topic == changelog else None)
    monkeypatch.setattr(metadata, "available_partitions_for_topic", lambda topic: {0, 1})
    async with other_worker() as (other_url, forwarded):
        keys = [b"retry-\xff\xfe", b"\x00\x00\x00\x00\x07\x10\xff\xfeitem", b"plain", b"\xff", b"\x00\x01"]
        theirs = {java_partition(key) for key in keys}
        assert theirs == {0, 1}  # keys on both partitions
        app.assignor.changelog_distribution = {
            str(app.conf.canonical_url): {changelog: [0]},
            other_url: {changelog: [1]},
        }

        class Request:
            method = "POST"
            headers = {"Authorization": "Bearer t"}

            def __init__(self, path_qs: str) -> None:
                self.url = URL(f"{app.conf.canonical_url}{path_qs}", encoded=True)

        for key in keys:
            path_qs = f"/retry/admin/keys/{base64.urlsafe_b64encode(key).decode()}/retry-now?key_encoding=base64"
            if java_partition(key) == 0:
                with pytest.raises(SameNode):
                    await app.router.route_req(table.name, key, app.web, Request(path_qs))
                continue
            response = await app.router.route_req(table.name, key, app.web, Request(path_qs))
            assert response.status == 202 and forwarded[-1] == ("POST", path_qs, "Bearer t"), _broken(
                "faust.app.router.Router.route_req", why, f"key {key!r}: {response.status}, forwarded {forwarded}"
            )
        assert len(forwarded) == sum(java_partition(key) == 1 for key in keys)
        if app._http_client is not None:  # type: ignore[attr-defined]
            await app._http_client.close()  # type: ignore[attr-defined]
        producer._producer = None  # type: ignore[attr-defined]


async def test_behaviour_router_forwards_to_the_active_owner_of_a_table_partition(runtime: Runtime) -> None:
    from faust.exceptions import SameNode
    from yarl import URL

    why = _why("router_forwards_to_the_active_owner_of_a_table_partition")
    app, table = runtime.app, runtime.table
    changelog = table.changelog_topic.get_topic_name()
    async with other_worker() as (other_url, forwarded):
        try:
            here = str(app.conf.canonical_url)
            app.assignor.changelog_distribution = {
                here: {changelog: [0], "other-changelog": [1]},
                other_url: {changelog: [1]},
            }
            metadata = app.router.table_metadata(table.name)
            assert metadata == {here: {changelog: [0]}, other_url: {changelog: [1]}}, _broken(
                "faust.app.router.Router.table_metadata", why, f"{metadata}"
            )

            class Request:
                method = "POST"
                headers = {"Authorization": "Bearer t"}
                url = URL(f"{here}/retry/admin/keys/AA%3D%3D/retry-now?key_encoding=base64&partition=1", encoded=True)

            with pytest.raises(SameNode):
                await app.router._route_req(URL(here), app.web, Request())  # type: ignore[attr-defined]
            response = await app.router._route_req(URL(other_url), app.web, Request())  # type: ignore[attr-defined]
            expected = ("POST", "/retry/admin/keys/AA%3D%3D/retry-now?key_encoding=base64&partition=1", "Bearer t")
            assert response.status == 202 and forwarded == [expected], _broken(
                "faust.app.router.Router._route_req", why, f"{response.status}, forwarded {forwarded}"
            )
            assert json.loads(response.body) == {"answered_by": "other"}
        finally:
            if app._http_client is not None:  # type: ignore[attr-defined]
                await app._http_client.close()  # type: ignore[attr-defined]


def test_behaviour_livelock_detector_times_a_stream_from_stream_inbound_time() -> None:
    """Faust's detector on a stand-in consumer thread (the real method, the aiokafka state it reads faked): a lagging
    partition is reported once its stream's inbound time is ``stream_processing_timeout`` old, and not when it is now."""
    import time
    from types import SimpleNamespace

    why = _why("livelock_detector_times_a_stream_from_stream_inbound_time")
    tp = TP("items", 0)
    monitor = SimpleNamespace(stream_inbound_time={})
    state = SimpleNamespace(highwater=100, position=50, timestamp=None)  # lagging: 50 records not fetched yet
    subscription = SimpleNamespace(assignment=SimpleNamespace(state_value=lambda aiotp: state))
    aiokafka_consumer = SimpleNamespace(
        _fetcher=SimpleNamespace(_subscriptions=SimpleNamespace(subscription=subscription))
    )
    logged: list[str] = []
    now = time.monotonic()
    thread: Any = SimpleNamespace(
        _verify_aiokafka_event_path=lambda now, tp: False,  # (fetching fine)
        consumer=SimpleNamespace(
            app=SimpleNamespace(monitor=monitor, topics=SimpleNamespace(acks_enabled_for=lambda topic: True))
        ),
        _ensure_consumer=lambda: aiokafka_consumer,
        time_started=now - 3600.0,
        tp_stream_timeout_secs=60.0,
        tp_commit_timeout_secs=300.0,
        tp_last_committed_at={tp: now - 1.0},
        _log_slow_processing_stream=lambda msg, *args: logged.append(msg % args),
        _log_slow_processing_commit=lambda msg, *args: logged.append(msg % args),
    )
    monitor.stream_inbound_time[tp] = now - 61.0
    faust_driver.AIOKafkaConsumerThread.verify_event_path(thread, now, tp)
    assert len(logged) == 1 and logged[0].startswith("Stream stopped processing, or is slow"), _broken(
        "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread.verify_event_path", why, f"logged {logged}"
    )
    logged.clear()
    monitor.stream_inbound_time[tp] = now  # (what agents/livelock.py writes as a hold ends)
    faust_driver.AIOKafkaConsumerThread.verify_event_path(thread, now + 59.0, tp)
    assert logged == [], _broken(
        "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread.verify_event_path", why, f"logged {logged}"
    )
