"""Faust web views: health, readiness, backlog (cluster-wide), per-key state, failed topics, dashboard, metrics, admin.

Status views show counts and metadata, never payloads unless ``REBOUND_SHOW_PAYLOADS`` is on: a retry backlog is
full of customer data.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

from faust.exceptions import SameNode
from faust.web import Blueprint
from faust.web.exceptions import ServiceUnavailable
from yarl import URL

from agents.control import pause_state_known, pause_view
from agents.lifecycle import memory_of
from agents.metrics import undecodable_batches
from agents.ownership import owned_partitions
from agents.runtime import Runtime
from agents.status import breaker_snapshot, local_ordering, local_partition_tiers, status_board
from app.handlers import handler_readiness
from rebound.key_names import (
    KEY_ENCODING_PARAM,
    PARTITION_PARAM,
    KeyNameError,
    key_names,
    key_of_name,
    partition_of_param,
)
from rebound.state import escaped_key, on_their_way
from rebound.summary import (
    WorkerSummary,
    sum_ordering,
    worker_backlog,
)

log = logging.getLogger(__name__)


def backlog(runtime: Runtime) -> dict[str, Any]:
    """Per tier over this worker's owned partitions (``?scope=worker``): counted as messages park and settle."""
    owned = owned_partitions(runtime) | runtime.schedule.partitions
    tiers, ordering = local_partition_tiers(runtime), local_ordering(runtime)
    result = worker_backlog(tiers, now_ms=runtime.clock(), tier_names=runtime.tier_topics, owned=owned)
    result["ordering"] = {"mode": runtime.settings.ordering, **sum_ordering(ordering.values())}
    result["breaker"] = breaker_snapshot(runtime)
    result["concurrency"] = runtime.dispatcher.concurrency()
    result["paused"] = pause_view(runtime)
    return result


def cluster_backlog(runtime: Runtime) -> dict[str, Any]:
    """Per tier over every worker: the latest published summaries, this worker's own part computed now."""
    board = status_board(runtime)
    tiers, ordering = local_partition_tiers(runtime), local_ordering(runtime)
    board.record(
        WorkerSummary(
            worker=board.worker_id,
            url=board.url,
            at_ms=runtime.clock(),
            partitions=tiers,
            owned=tuple(sorted(owned_partitions(runtime))),
            ordering=ordering,
            breaker=breaker_snapshot(runtime),
            pause_state_known=pause_state_known(runtime),
            concurrency=runtime.dispatcher.concurrency(),
            settings=board.settings,
        )
    )
    result = board.cluster(runtime)
    result["ordering"] = {"mode": runtime.settings.ordering, **result["ordering"]}
    result["paused"] = pause_view(runtime)  # the operator's pause of the main topics: cluster-wide, who and when
    return result


def ready_answer(
    *,
    rebalancing: bool,
    has_partitions: bool,
    pause_state_known: bool,
    undecodable: Sequence[Mapping[str, Any]] = (),
    handler: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], int]:
    """``/ready``: 503 while rebalancing, before the worker owns partitions, before it has read whether the main
    topics are paused (it holds them until then: a worker that cannot read the control topic is not ready), while
    one of its partitions is stopped at a record batch it cannot decode (listed under ``undecodable``, with the
    offset the operator needs: docs/undecodable-batches.md), or while the HTTP push handler's service has been
    unreachable persistently (``handler``: every call and idle probe for 10 s failed to connect; docs/push-handlers.md).
    ``/health`` stays 200 then: restarting the worker cannot bring the service back, and its calls keep failing
    retryably until it is back."""
    reachable = True if handler is None else handler.get("reachable") is not False
    is_ready = not rebalancing and has_partitions and pause_state_known and not undecodable and reachable
    body: dict[str, Any] = {"ready": is_ready, "rebalancing": rebalancing, "pause_state_known": pause_state_known}
    if undecodable:
        body["undecodable"] = [dict(stuck) for stuck in undecodable]
    if handler is not None:
        body["handler"] = dict(handler)
    return body, 200 if is_ready else 503


def undecodable_now(app: Any) -> list[dict[str, object]]:
    """The partitions this worker's consumer is stopped on, as ``/ready`` lists them."""
    batches = undecodable_batches(app)
    return [stuck.as_dict() for stuck in batches.snapshot()] if batches is not None else []


ROUTING_RETRY_AFTER_S = 2
"""What a key view's 503 asks the client to wait: a worker's tables start, and its group forms, within seconds."""
Refusal = tuple[dict[str, Any], int, dict[str, str]]


def not_routable(reason: str) -> Refusal:
    """A key view's 503 while the key cannot be routed yet: a JSON body saying why, and ``Retry-After``."""
    body = {"error": reason, "retry_after_s": ROUTING_RETRY_AFTER_S}
    return body, 503, {"Retry-After": str(ROUTING_RETRY_AFTER_S)}


TABLES_STARTING = "this worker's tables are still starting; retry shortly"
NO_OWNER_YET = "no worker owns this key's partition yet (the group is forming or rebalancing); retry shortly"


def tables_started(app: Any) -> bool:
    """Whether Faust has started every table, which declares (creates) its changelog topic with the table's partition
    count. Its table manager starts the recovery service right after that (``TableManager.on_start``)."""
    return bool(app.tables.recovery.started)


async def ensure_routable(runtime: Runtime) -> Refusal | None:
    """:func:`route_by_key` hashes the key with the producer's metadata of the changelog topic, which a worker that
    never wrote to it may not have yet; fetch it first (a 500 otherwise). Not before the tables have started: a broker
    that creates topics on a metadata request (Tansu; Kafka's default) would create the changelog with its default
    partition count before Faust declares it, and every later table write would fail (``PartitionsMismatch``)."""
    if not tables_started(runtime.app):
        return not_routable(TABLES_STARTING)
    try:
        topic = runtime.table.changelog_topic.get_topic_name()
        producer = runtime.app.producer._ensure_producer()  # type: ignore[attr-defined]
        if producer.client.cluster.partitions_for_topic(topic) is None:
            await producer.client._wait_on_metadata(topic)
    except Exception:
        log.debug("could not fetch changelog metadata for routing", exc_info=True)
    return None


def named_key(request: Any, key: str) -> bytes:
    """The bytes of the key a key view or admin action names: the path's ``key`` as text, or, with
    ``?key_encoding=base64``, the bytes it is the base64 of (``rebound/key_names.py``); :class:`KeyNameError` else."""
    return key_of_name(key, request.query.get(KEY_ENCODING_PARAM))


def named_partition(runtime: Runtime, request: Any) -> int | None:
    """The main topics' partition ``?partition=N`` names (None: not given); :class:`KeyNameError` for anything but an
    integer ``0 <= N <`` their partition count."""
    return partition_of_param(request.query.get(PARTITION_PARAM), runtime.partitions)


async def route_key(
    runtime: Runtime,
    key: bytes,
    partition: int | None,
    view: Any,
    request: Any,
    local: Callable[[], Awaitable[Any]],
) -> Any:
    """:func:`route_to_partition` when the request names the partition, else :func:`route_by_key`."""
    if partition is None:
        return await route_by_key(runtime, key, view, request, local)
    return await route_to_partition(runtime, partition, view, request, local)


def bad_key_name(view: Any, key: str, error: KeyNameError, **fields: Any) -> Any:
    """The 400 of a key name that names no key, the same on every worker (nothing is routed)."""
    return view.json({**fields, "key": key, "error": str(error)}, status=400)


async def route_by_key(
    runtime: Runtime, key: bytes, view: Any, request: Any, local: Callable[[], Awaitable[Any]]
) -> Any:
    """The answer of the worker owning ``key``'s partition: ``local()`` here, else the request forwarded there.

    Faust's ``app.table_route(match_info=...)`` routes by the path's text, so a key named in base64 would be hashed
    as its name: this asks Faust's router with the key's bytes, which it serializes with the table's raw key
    serializer (bytes as they are) and hashes with the producer's partitioner, as a producer partitioned the
    original record. The forwarded request is the same URL (path and ``key_encoding``) on the owner, which names the
    same key and answers ``local()`` itself (``SameNode``). ``ServiceUnavailable`` (no owner yet) propagates to
    :func:`routed_answer`. Faust's contract: ``router_routes_a_table_key_by_its_bytes`` in tests/contract."""
    try:
        return await runtime.app.router.route_req(runtime.table.name, key, view.web, request)
    except SameNode:
        return await local()


async def route_to_partition(
    runtime: Runtime, partition: int, view: Any, request: Any, local: Callable[[], Awaitable[Any]]
) -> Any:
    """The answer of the worker actively owning ``partition`` of the state table (the main topics' partition of that
    number: they are co-partitioned), whatever the key hashes to: for a key its producer placed with another
    partitioner (librdkafka's default, ``consistent_random``, is CRC32).

    The owner is taken from Faust's assignor (``app.router.table_metadata``: each worker's URL with the changelog
    partitions it actively owns) and the request forwarded there by Faust's ``Router._route_req``, the same URL (path,
    ``key_encoding`` and ``partition``), or ``local()`` here (``SameNode``). No owner: ``ServiceUnavailable`` for
    :func:`routed_answer`. The partition only routes: the owner reads the key's state by key (:func:`key_answer`,
    Faust's store looks in each partition it holds). Faust's contract:
    ``router_forwards_to_the_active_owner_of_a_table_partition`` in tests/contract."""
    changelog = runtime.table.changelog_topic.get_topic_name()
    metadata = runtime.app.router.table_metadata(runtime.table.name)
    owners = sorted(url for url, topics in metadata.items() if partition in topics.get(changelog, ()))
    if not owners:
        raise ServiceUnavailable()
    try:
        return await runtime.app.router._route_req(URL(owners[0]), view.web, request)  # type: ignore[attr-defined]
    except SameNode:
        return await local()


async def key_answer(runtime: Runtime, view: Any, key: bytes) -> Any:
    """``GET /retry/keys/{key}`` on the worker owning the key: its state, named back both ways (:func:`key_names`),
    and its messages whose retry is on its way to a tier (:func:`on_their_way`, from the index the same read loads):
    found while anything of it is parked or on its way."""
    show = runtime.settings.show_payloads
    state = runtime.store.load(runtime.store.existing_key(escaped_key(key)), entries=True, with_payloads=show)
    names, worker = key_names(key), status_board(runtime).worker_id
    moving = on_their_way(state, now_ms=runtime.clock(), memory=memory_of(runtime))
    if not state.pending and not moving:
        return view.json({**names, "found": False, "worker": worker}, status=404)
    summary = state.summary(show_payloads=show)
    return view.json({**names, "found": True, "worker": worker, **summary, "on_its_way": moving})


async def routed_answer(runtime: Runtime, view: Any, route: Callable[[], Awaitable[Any]]) -> Any:
    """A key view's answer through ``route`` (:func:`route_by_key`), or a 503 with ``Retry-After`` while the worker
    cannot route keys yet (:func:`ensure_routable`; Faust's own 503 before any worker owns the key's partition)."""
    refusal = await ensure_routable(runtime)
    if refusal is None:
        try:
            return await route()
        except ServiceUnavailable:
            refusal = not_routable(NO_OWNER_YET)
    body, status, headers = refusal
    return view.json(body, status=status, headers=headers)


def metrics_text(runtime: Runtime) -> str:
    """The Prometheus text exposition of this worker (``agents/metrics.py``), as ``GET /metrics`` serves it."""
    return runtime.metrics.exposition()[0].decode()


def register_views(runtime: Runtime) -> None:
    from app.web.admin import register_admin_views
    from app.web.dashboard import register_dashboard_views

    app = runtime.app
    # Every view in one Blueprint, registered with the app once they are all declared (Faust's extension point).
    blueprint = Blueprint("rebound")

    @blueprint.route("/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"status": "ok"})

    @blueprint.route("/ready")
    async def ready(web: Any, request: Any) -> Any:
        body, status = ready_answer(
            rebalancing=bool(app.rebalancing),
            has_partitions=bool(runtime.schedule.partitions or not runtime.partitions),
            pause_state_known=pause_state_known(runtime),
            undecodable=undecodable_now(app),
            handler=handler_readiness(runtime.handler),
        )
        return web.json(body, status=status)

    @blueprint.route("/retry/backlog")
    async def retry_backlog(web: Any, request: Any) -> Any:
        if request.query.get("scope") == "worker":
            return web.json(backlog(runtime))
        return web.json(cluster_backlog(runtime))

    @blueprint.route("/retry/keys/{key}")
    async def retry_key(web: Any, request: Any, key: str) -> Any:
        try:
            named, partition = named_key(request, key), named_partition(runtime, request)
        except KeyNameError as exc:
            return bad_key_name(web, key, exc, found=False)
        local = partial(key_answer, runtime, web, named)
        return await routed_answer(runtime, web, lambda: route_key(runtime, named, partition, web, request, local))

    register_dashboard_views(runtime, blueprint)  # /dashboard/, /retry/history, /retry/failed (app/web/dashboard.py)

    @blueprint.route("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        body, content_type = runtime.metrics.exposition()
        return web.bytes(body, headers={"Content-Type": content_type})

    register_admin_views(runtime, blueprint, partial(routed_answer, runtime))
    blueprint.register(app)
