"""Build the Faust app: settings, topics (provisioned with one partition count), the state table, agents, views."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, cast

import faust

from agents.dispatcher import Dispatcher
from agents.readers import groupless_consumer
from agents.runtime import Runtime
from agents.topics import raw_topic
from app.consumer import ReboundApp, ReboundConsumer
from app.environment import settings_from_environment
from app.handlers import attach_handler, load_handler
from app.provisioning import provision
from app.shutdown import WORKER_CLASS, bound_shutdown
from rebound.breaker import CircuitBreaker
from rebound.event import Handler
from rebound.limiter import AdaptiveLimit
from rebound.schedule import ReleaseSchedule
from rebound.settings import HANDLER_CANCEL_GRACE_S, Settings
from rebound.tiers import Tiers
from rebound.topics import attempts_topic, failed_topic, release_topic
from tables.fencing import TableFence
from tables.retry_state import RetryStore, create_payload_table, create_state_table

log = logging.getLogger(__name__)


def create_faust_app(settings: Settings, partitions: int) -> faust.App:
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    return ReboundApp(
        settings.app_id,
        # Faust reads unprefixed variables (PRODUCER_ACKS, APP_WEB_TABLES_ENABLED, TOPIC_PARTITIONS...) and lets them
        # win over these arguments: one stray variable would drop acks=all or serve table contents. REBOUND_* only.
        env={},
        per_event_monitor=False,
        broker=settings.broker,
        store=settings.store,
        datadir=settings.data_dir,
        autodiscover=False,
        topic_partitions=partitions,
        topic_replication_factor=settings.replication_factor,
        producer_acks=-1,
        producer_max_batch_size=settings.producer_max_batch_bytes,
        producer_max_request_size=settings.producer_max_request_bytes,
        # Faust's default lets one send wait 20 minutes before it fails and is written again; agents wait on sends.
        producer_request_timeout=60.0,
        consumer_auto_offset_reset="earliest",
        broker_rebalance_timeout=settings.rebalance_timeout,
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=settings.heartbeat_interval,
        broker_commit_interval=settings.commit_interval,
        table_standby_replicas=0,
        topic_allow_declare=settings.provision_topics,
        web_enabled=settings.web_enabled,
        # Faust's generic views would answer table contents (payloads) and the cluster layout without a token; Rebound
        # serves its own views only (the production index left is a static {"status": "OK"}).
        web_router_enabled=False,
        web_tables_enabled=False,
        web_graph_enabled=False,
        web_stats_enabled=False,
        web_metrics_enabled=False,
        web_host=settings.web_host,
        web_port=settings.web_port,
        # The handler has its own timeout; this only controls Faust's "slow event" warning.
        stream_processing_timeout=max(60.0, 2 * settings.handler_timeout_s),
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        Worker=WORKER_CLASS,  # its stop takes at most REBOUND_SHUTDOWN_TIMEOUT (app/shutdown.py)
        isolation_level=settings.isolation_level,
    )


def build(
    settings: Settings | None = None, *, handler: Handler | None = None, partitions: int | None = None
) -> Runtime:
    """Build the whole application; ``partitions`` given skips talking to the broker (agent unit tests).

    ``settings`` not given are read from the environment (``app/environment.py``). The settings and the handler are
    checked first: a configuration mistake (an unknown handler among them) stops the worker before it connects
    anywhere.
    """
    settings = settings or settings_from_environment()
    handler = handler or load_handler(settings.handler, settings)
    draining: tuple[str, ...] = ()
    if partitions is None:
        provisioned = provision(settings, create=settings.provision_topics)
        partitions, draining = provisioned.partitions, provisioned.draining_tiers
    tiers = Tiers.build(settings.topics, settings.policy, draining)
    app = create_faust_app(settings, partitions)
    attach_handler(app, handler)
    bound_shutdown(app, settings.shutdown_timeout)
    state_table = create_state_table(app, settings, partitions)
    payload_table = create_payload_table(app, settings, partitions)

    def member_id() -> str | None:  # late: Faust makes the consumer when the worker starts
        return cast(ReboundConsumer, app.consumer).member_id()

    def changelog_reader() -> Any:  # what a claim reads between its recovery's high watermark and its marker
        return groupless_consumer(
            settings.bootstrap_servers,
            auto_offset_reset="earliest",  # a span retention cut short starts at the log's start: gone for all
            fetch_max_wait_ms=min(settings.fetch_max_wait_ms, 500),
            isolation_level=settings.isolation_level,  # what the recovery itself reads
        )

    fences = [
        TableFence(table, member_id=member_id, changelog_reader=changelog_reader)
        for table in (state_table, payload_table)
    ]
    store = RetryStore(state_table, payload_table, max_record_bytes=settings.producer_max_request_bytes)
    bounds = settings.concurrency_range
    dispatcher = Dispatcher(
        app,
        limit=settings.most_in_flight,
        limiter=None if bounds is None else AdaptiveLimit(bounds, clock=time.monotonic),
        partition_buffer=settings.partition_buffer,
        revoke_drain_s=settings.revoke_drain_s,
        drain_hold_back_s=settings.handler_timeout_s + HANDLER_CANCEL_GRACE_S,  # what a record started may take
        shutdown_work_s=settings.shutdown_work_s,
    )
    cast(ReboundApp, app).flow_stopped_callbacks.append(dispatcher.revoke)
    runtime = Runtime(
        app=app,
        settings=settings,
        handler=handler,
        partitions=partitions,
        table=state_table,
        store=store,
        fences=tuple(fences),
        # Back-pressure counts what the dispatcher took; what the fetch loop handed over ahead of it sits in the
        # stream queue of the main and release agents, 4096 records by Faust's default: sized from the buffer
        # instead (docs/back-pressure.md). Every other agent keeps Faust's default, and a fetch is not capped: a
        # capped fetch is drained before the next one is sent, which cut healthy throughput to a quarter.
        main_topics={
            name: raw_topic(app, name, partitions=partitions, maxsize=settings.partition_buffer)
            for name in settings.topics
        },
        tiers=tiers,
        tier_topics={name: raw_topic(app, name, partitions=partitions) for name in tiers},
        failed_topics={main: raw_topic(app, failed_topic(main), partitions=partitions) for main in settings.topics},
        attempts_topic=raw_topic(app, attempts_topic(settings.app_id), partitions=partitions),
        release_topic=raw_topic(
            app, release_topic(settings.app_id), partitions=partitions, maxsize=settings.partition_buffer
        ),
        dispatcher=dispatcher,
        schedule=ReleaseSchedule(
            max_in_flight=settings.release_window,
            # Lost requests are what a silent partition means; a handler hanging until its timeout is not silence.
            resend_after_ms=max(30_000, int(settings.handler_timeout_s * 1000) + 10_000),
        ),
    )
    # A confirm that opens a full window wakes the release timer, which sleeps through full windows.
    runtime.schedule.on_space = runtime.release_wakeup.set
    if settings.breaker_enabled:
        from agents.breaker import BreakerGate

        runtime.breaker_gate = BreakerGate(runtime, CircuitBreaker(settings.breaker_config))
        cast(ReboundApp, app).flow_stopped_callbacks.append(runtime.breaker_gate.flow_stopped)
    from agents import register_agents
    from app.views import register_views

    register_agents(runtime)
    register_views(runtime)
    log.info(
        "rebound: topics %s, policy %s, %d partitions, release %s, concurrency %s, ordering %s, breaker %s",
        ",".join(settings.topics),
        settings.policy.describe(),
        partitions,
        settings.release_mode,
        settings.concurrency if bounds is None else f"auto ({bounds.minimum} to {bounds.maximum})",
        settings.ordering,
        "on" if settings.breaker_enabled else "off",
    )
    return runtime
