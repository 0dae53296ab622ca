"""Stock Faust for a baseline: a plain ``faust.App`` with Faust's own consumer, consumer thread, producer and
``maybe_start_producer``, and one change the embedded broker needs, the fetch wait.

faust-streaming builds its worker's aiokafka consumer with ``fetch_max_wait_ms=1500`` written into
``AIOKafkaConsumerThread._create_worker_consumer`` (``faust/transport/drivers/aiokafka.py``); it is no setting. The
embedded broker answers a fetch of several partitions only when that wait is over, so a stock app would wait up to
1.5 s per fetch for a reason that says nothing about Faust's own cost. The override, the least that reaches that one
value: :class:`FetchWaitConsumerThread` calls Faust's ``_create_worker_consumer`` unchanged and then sets the aiokafka
consumer's ``_fetch_max_wait_ms`` (aiokafka reads it once, in ``start()``, where it makes its fetcher, which runs
after this). Faust picks its consumer thread in ``Consumer._new_consumer_thread`` and its consumer class from the
transport's ``Consumer``, so :class:`FetchWaitConsumer` and :class:`FetchWaitTransport` are one-line subclasses that
lead there, and :func:`make_stock_app` sets the app's (consumer) transport to the latter; the app's class, its
producer transport (``broker_producer`` resolved by Faust), the producer and every other method are Faust's.
Everything else stays as stock Faust has it, isolation level (``read_uncommitted``) and Faust's ``Monitor`` included.

Nothing here imports Rebound: :func:`path_in_use` names the classes a started app really runs, and :func:`check_path`
refuses a run on any of Rebound's (``noop-ratio`` reads the line the baseline prints from it; ``bare.py`` and
``bare_retry.py`` print it from :func:`watch_path`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import faust
from faust.transport.drivers import aiokafka as driver

from bench.baselines._app import app_id, fetch_wait_ms, settings

log = logging.getLogger(__name__)

PATH_LINE = "stock-faust path:"
"""How the baseline's line naming the classes in use starts, in its worker's log."""
REBOUND_MODULES = ("app", "app.consumer", "app.producer", "agents", "rebound", "tables")
"""Rebound's packages a baseline's line lists when its process imported them (the failure path's floor takes
Rebound's settings and RocksDB options from ``rebound`` and ``tables``, and its handler imports ``app.errors``)."""
FAUST_REPLACEMENTS = ("app.consumer", "app.producer")
"""Rebound's modules that replace Faust's classes: a stock baseline never imports them."""


class FetchWaitConsumerThread(driver.AIOKafkaConsumerThread):
    """Faust's consumer thread; the aiokafka consumer it makes waits ``fetch_max_wait_ms`` (the transport's) per fetch
    instead of Faust's hard-coded 1,500 ms."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = transport.fetch_max_wait_ms  # read when the consumer starts its fetcher
        return consumer


class FetchWaitConsumer(driver.Consumer):
    """Faust's aiokafka consumer, with :class:`FetchWaitConsumerThread` as its thread."""

    def _new_consumer_thread(self) -> FetchWaitConsumerThread:
        return FetchWaitConsumerThread(self, loop=self.loop, beacon=self.beacon)


class FetchWaitTransport(driver.Transport):
    """Faust's aiokafka transport, making :class:`FetchWaitConsumer`; its producer is Faust's."""

    Consumer = FetchWaitConsumer
    fetch_max_wait_ms = 1500


def make_stock_app(**overrides: Any) -> faust.App:
    """A ``faust.App`` with ``_app.py``'s settings (``overrides`` as in ``make_app``) whose consumer waits
    ``REBOUND_FETCH_MAX_WAIT_MS`` per fetch."""
    app = faust.App(app_id(), **settings(**overrides))
    transport = FetchWaitTransport(app.conf.broker_consumer, app)
    transport.fetch_max_wait_ms = fetch_wait_ms()
    app.transport = transport  # before anything asks for it (Faust makes it lazily)
    return app


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def defined_by(cls: type, name: str) -> str:
    """The class in ``cls``'s MRO whose body defines ``name``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return qualname(klass)
    return "?"


def path_in_use(app: faust.App) -> dict[str, Any]:
    """The classes a started app runs for the steps a healthy message takes, and the fetch wait its consumer has."""
    consumer = app.consumer
    thread = getattr(consumer, "_thread", None)
    aiokafka_consumer = getattr(thread, "_consumer", None)
    fetcher = getattr(aiokafka_consumer, "_fetcher", None)
    return {
        "app": qualname(type(app)),
        "maybe_start_producer": defined_by(type(app), "maybe_start_producer"),
        "consumer": qualname(type(consumer)),
        "hand_over": defined_by(type(consumer), "_drain_messages"),
        "consumer_thread": qualname(type(thread)),
        "producer": qualname(type(app.producer)),
        "fetch_max_wait_ms": getattr(fetcher, "_fetch_max_wait_ms", None),
        "isolation_level": getattr(aiokafka_consumer, "_isolation_level", None),
        "rebound_imported": sorted(name for name in REBOUND_MODULES if name in sys.modules),
    }


def check_path(path: dict[str, Any]) -> list[str]:
    """What in ``path`` (:func:`path_in_use`'s) is not stock Faust's; empty when the run is what it claims."""
    wrong = []
    if path["app"] != "faust.app.base.App":
        wrong.append(f"the app is {path['app']}")
    if path["maybe_start_producer"] != "faust.app.base.App":
        wrong.append(f"maybe_start_producer is {path['maybe_start_producer']}'s")
    if path["hand_over"] != "faust.transport.consumer.Consumer":
        wrong.append(f"the hand-over (_drain_messages) is {path['hand_over']}'s")
    if not path["producer"].startswith("faust."):
        wrong.append(f"the producer is {path['producer']}")
    replacing = sorted(set(path["rebound_imported"]) & set(FAUST_REPLACEMENTS))
    if replacing:
        wrong.append(f"Rebound's replacements of Faust's classes are imported: {replacing}")
    if path["fetch_max_wait_ms"] != fetch_wait_ms():
        wrong.append(f"the fetch wait is {path['fetch_max_wait_ms']}, not {fetch_wait_ms()}")
    return wrong


def report_path(app: faust.App) -> None:
    """Print :func:`path_in_use` on one line and stop the worker if it is not stock Faust's."""
    path = path_in_use(app)
    log.warning("%s %r", PATH_LINE, path)  # one line: Faust's worker sends a print's parts as separate records
    wrong = check_path(path)
    if wrong:
        log.error("stock-faust: not stock Faust (%s); stopping", "; ".join(wrong))
        logging.shutdown()
        os._exit(3)


def watch_path(app: faust.App, every_s: float = 0.5) -> None:
    """:func:`report_path` once, from a timer, as soon as the consumer's fetcher exists (its fetch wait is then set)."""
    reported: list[bool] = []

    @app.timer(every_s)
    async def report_stock_path() -> None:
        thread = getattr(app.consumer, "_thread", None)
        if reported or getattr(getattr(thread, "_consumer", None), "_fetcher", None) is None:
            return
        reported.append(True)
        report_path(app)
