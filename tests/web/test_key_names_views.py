"""Keys that are not UTF-8 in the key view and the admin actions on a key: named by their bytes
(``?key_encoding=base64``), routed by their bytes, and named back both ways. The worker's own web app over HTTP
(aiohttp's test server), its tables in memory, the admin agent through ``test_context``; no broker.

Faust's router is asked for the owner of the key's bytes (``key_store``: the producer's partitioner over the
changelog topic) and here answers "this worker"; what it does with another owner is the contract test
``test_behaviour_router_routes_a_table_key_by_its_bytes``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web as aiohttp_web
from aiohttp.test_utils import TestClient, TestServer

from agents.control import Written
from app import views
from app.web import admin as admin_views
from rebound.commands import AdminCommand
from rebound.key_names import base64_of_key
from rebound.pause import PauseState
from tests.agents.conftest import eventually
from tests.agents.support import tier_headers

TOKEN = "s3cret"
SCHEMA_REGISTRY_KEY = b"\x00\x00\x00\x00\x07\x10\xff\xfeitem"
"""Magic byte 0, schema id 7, then the encoded key: not UTF-8 (the escaped table key starts with 0x01 0x00)."""
REPORTED_KEY = b"retry-\xff\xfe"


class Worker:
    def __init__(self, runtime: Any, client: TestClient, routed: list[bytes]) -> None:
        self.runtime, self.client, self.routed = runtime, client, routed

    async def get(self, path: str) -> tuple[int, Any]:
        response = await self.client.get(path)
        return response.status, await response.json()

    async def post(self, path: str) -> tuple[int, Any]:
        response = await self.client.post(path, headers={"Authorization": f"Bearer {TOKEN}"})
        return response.status, await response.json()


@pytest.fixture
async def worker(make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Worker]:
    runtime = make_runtime(admin_token=TOKEN)
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        for offset, key in enumerate((SCHEMA_REGISTRY_KEY, REPORTED_KEY, b"plain")):
            headers = dict(tier_headers(clock))
            headers["rebound.original-offset"] = str(offset).encode()
            await tier.put(b"value", key=key, headers=list(headers.items()), partition=0)
    assert runtime.schedule.waiting() == 3
    monkeypatch.setattr(views, "tables_started", lambda app: True)
    monkeypatch.setattr(runtime.app.producer, "_ensure_producer", lambda: None)  # no metadata to fetch: logged
    routed: list[bytes] = []

    def key_store(table_name: str, key: Any) -> Any:
        assert table_name == runtime.table.name
        routed.append(key)
        return runtime.app.conf.canonical_url  # this worker owns it: Faust's router raises SameNode

    monkeypatch.setattr(runtime.app.router, "key_store", key_store)
    async with TestClient(TestServer(runtime.app.web.web_app)) as client:
        yield Worker(runtime, client, routed)


@pytest.mark.parametrize("key", [SCHEMA_REGISTRY_KEY, REPORTED_KEY])
async def test_a_key_that_is_not_utf8_is_found_by_its_base64_and_routed_by_its_bytes(
    worker: Worker, key: bytes
) -> None:
    status, body = await worker.get(f"/retry/keys/{base64_of_key(key)}?key_encoding=base64")
    assert status == 200 and body["found"] is True, body
    assert body["key"] == key.decode("utf-8", errors="backslashreplace")
    assert body["key_base64"] == base64_of_key(key)  # to copy into the next call
    assert [entry["origin"] for entry in body["pending"]] == [f"items/0/{0 if key == SCHEMA_REGISTRY_KEY else 1}"]
    assert worker.routed == [key]  # the owner asked for the key's bytes, not for its name


async def test_the_standard_alphabet_unpadded_names_the_same_key(worker: Worker) -> None:
    assert base64_of_key(REPORTED_KEY) == "cmV0cnkt__4="
    status, body = await worker.get("/retry/keys/cmV0cnkt%2F%2F4?key_encoding=base64")
    assert status == 200 and body["found"] is True and body["key_base64"] == "cmV0cnkt__4="
    assert worker.routed == [REPORTED_KEY]


async def test_the_reported_lookups_by_text_still_find_nothing_and_text_keys_answer_as_before(worker: Worker) -> None:
    for path in ("/retry/keys/retry-%FF%FE", "/retry/keys/retry-%5Cxff%5Cxfe"):
        status, body = await worker.get(path)
        assert status == 404 and body["found"] is False and "key_base64" not in body
    status, body = await worker.get("/retry/keys/plain")
    assert status == 200 and body["key"] == "plain" and "key_base64" not in body
    assert worker.routed[-1] == b"plain"


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/retry/keys/not$base64?key_encoding=base64", "not a base64 character"),
        ("/retry/keys/QR%3D%3D?key_encoding=base64", "stray trailing bits"),
        ("/retry/keys/abc?key_encoding=hex", "key_encoding must be one of text, base64"),
    ],
)
async def test_a_name_that_names_no_key_answers_400_without_routing(worker: Worker, path: str, says: str) -> None:
    status, body = await worker.get(path)
    assert status == 400 and says in body["error"] and body["found"] is False
    status, body = await worker.post(path.replace("/retry/keys/", "/retry/admin/keys/").replace("?", "/retry-now?"))
    assert status == 400 and says in body["error"] and body["action"] == "retry-now"
    assert worker.routed == []


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("key=abc&key_encoding=hex", "key_encoding must be one of text, base64"),
        ("reason=exhausted&key_encoding=hex", "key_encoding must be one of text, base64"),
        ("key=not$base64&key_encoding=base64", "not a base64 character"),
    ],
)
async def test_the_failed_record_browser_refuses_a_key_name_as_the_key_view_does(
    worker: Worker, query: str, says: str
) -> None:
    """Reported: ``key_encoding`` was ignored by the browser's key filter (the base64 text was searched for)."""
    status, body = await worker.get(f"/retry/failed?{query}")
    assert status == 400 and says in body["error"], body


async def test_admin_actions_reach_a_key_named_by_its_base64(worker: Worker, clock: Any) -> None:
    runtime = worker.runtime
    channel = runtime.admin_channel
    submitted: list[tuple[str, bytes, int]] = []

    async def submit(action: str, key: bytes, partition: int, **_: Any) -> tuple[str, dict[str, Any] | None]:
        """The command through the admin agent, as the admin topic would hand it over."""
        submitted.append((action, key, partition))
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        channel.waiters["c1"] = waiter
        async with runtime.agents["admin"].test_context() as admin:
            await admin.put(AdminCommand("c1", action, key, "test", 0).to_json(), key=key, partition=partition)
            return "c1", await asyncio.wait_for(waiter, 5)

    channel.submit = submit
    name = base64_of_key(SCHEMA_REGISTRY_KEY)
    status, body = await worker.post(f"/retry/admin/keys/{name}/retry-now?key_encoding=base64")
    assert status == 200 and body["count"] == 1, body
    assert body["key_base64"] == name and body["key"] == SCHEMA_REGISTRY_KEY.decode("utf-8", "backslashreplace")
    assert submitted == [("retry-now", b"\x01" + SCHEMA_REGISTRY_KEY, 0)]  # the escaped table key (it starts with 0)
    assert worker.routed == [SCHEMA_REGISTRY_KEY]  # routed by the record key's bytes, as its producer partitioned it
    await eventually(lambda: runtime.counters["admin.retry_now"] == 1)

    status, body = await worker.post(f"/retry/admin/keys/{base64_of_key(REPORTED_KEY)}/dead-letter?key_encoding=base64")
    assert status == 200 and body["count"] == 1, body
    [dead] = runtime.failed_topics["items"].sent
    assert dead.key == REPORTED_KEY and dead.value == b"value"  # byte-exact
    status, body = await worker.get(f"/retry/keys/{base64_of_key(REPORTED_KEY)}?key_encoding=base64")
    assert status == 404 and body["key_base64"] == base64_of_key(REPORTED_KEY)


async def test_the_audit_line_of_a_key_action_names_the_key_and_its_time_as_the_other_audit_lines(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """Reported: the key actions' audit line printed the table key's bytes (``b'\\x01\\x00...'``, the escaped key)
    where replay's printed ``'key'``, and no time where pause's printed epoch ms. Now each names the record key as
    text in quotes, escaped, with its base64 when the text does not name it, and the time in ISO 8601 (UTC)."""
    runtime = worker.runtime
    table_key = b"\x01" + SCHEMA_REGISTRY_KEY  # the escaped table key the view sends (it starts with 0)
    requested = 1_746_093_600_000  # 2025-05-01T10:00:00Z
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    runtime.admin_channel.waiters["c9"] = waiter
    with caplog.at_level(logging.WARNING, logger="agents.admin"):
        async with runtime.agents["admin"].test_context() as admin:
            command = AdminCommand("c9", "retry-now", table_key, "10.0.0.5", requested)
            await admin.put(command.to_json(), key=table_key, partition=0)
            await asyncio.wait_for(waiter, 5)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admin action retry-now")]
    named = f"'\\x00\\x00\\x00\\x00\\x07\\x10\\xff\\xfeitem' (base64 {base64_of_key(SCHEMA_REGISTRY_KEY)})"
    assert f"on key {named} (partition 0, requested by 10.0.0.5 at 2025-05-01T10:00:00Z, command c9)" in line, line
    assert "\x00" not in line and "\x07" not in line  # nothing a terminal would act on


async def test_the_pause_audit_line_says_its_time_in_iso_8601_as_the_other_audit_lines(
    worker: Worker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Reported: ``admin pause of the main topics ... at 1746093600000``, epoch ms where the key actions' and
    replay's lines (and the control reader's) say ``2025-05-01T10:00:00Z``."""

    async def set_paused(runtime: Any, *, paused: bool, by: str, source: str) -> Written:
        return Written(PauseState(paused=paused, by=by, source=source, at_ms=1_746_093_600_000, action_id="p1"), True)

    monkeypatch.setattr(admin_views, "set_paused", set_paused)
    with caplog.at_level(logging.WARNING, logger="app.web.admin"):
        status, _ = await worker.post("/retry/admin/pause")
    assert status == 200
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admin pause")]
    assert " at 2025-05-01T10:00:00Z (action p1)" in line, line


@pytest.fixture
async def other_worker() -> AsyncIterator[tuple[str, list[tuple[str, str, str | None]]]]:
    """Another worker's web server: records what is forwarded to it and answers for itself."""
    seen: list[tuple[str, str, str | None]] = []

    async def answer(request: aiohttp_web.Request) -> aiohttp_web.Response:
        seen.append((request.method, request.raw_path, request.headers.get("Authorization")))
        return aiohttp_web.json_response({"answered_by": "other"})

    application = aiohttp_web.Application()
    application.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(application, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), seen
    finally:
        await server.close()


async def test_partition_routes_to_its_active_owner_whatever_the_key_hashes_to(
    worker: Worker, other_worker: tuple[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``?partition=N`` (a key placed by a librdkafka producer's CRC32 partitioner): the worker actively owning
    partition N of the state table answers, here or forwarded there with the same path and query; the key's hash is
    not asked. The key's state is read by key: partition 0 here finds it."""
    runtime, (other_url, seen) = worker.runtime, other_worker
    monkeypatch.setattr(runtime, "partitions", 2)
    changelog = runtime.table.changelog_topic.get_topic_name()
    runtime.app.assignor.changelog_distribution = {
        str(runtime.app.conf.canonical_url): {changelog: [0]},
        other_url: {changelog: [1]},
    }
    name = base64_of_key(SCHEMA_REGISTRY_KEY)
    try:
        status, body = await worker.get(f"/retry/keys/{name}?key_encoding=base64&partition=0")
        assert status == 200 and body["found"] is True and body["key_base64"] == name, body
        status, body = await worker.get("/retry/keys/plain?partition=1")
        assert (status, body) == (200, {"answered_by": "other"})
        status, body = await worker.post(f"/retry/admin/keys/{name}/dead-letter?key_encoding=base64&partition=1")
        assert (status, body) == (200, {"answered_by": "other"})
        assert seen == [
            ("GET", "/retry/keys/plain?partition=1", None),
            ("POST", f"/retry/admin/keys/{name}/dead-letter?key_encoding=base64&partition=1", f"Bearer {TOKEN}"),
        ]
        assert worker.routed == []  # routed by the partition, never by the key's bytes
        assert runtime.failed_topics["items"].sent == []

        runtime.app.assignor.changelog_distribution = {str(runtime.app.conf.canonical_url): {changelog: [0]}}
        status, body = await worker.get("/retry/keys/plain?partition=1")  # no worker owns partition 1 (yet)
        assert status == 503 and "no worker owns" in body["error"]
    finally:
        if runtime.app._http_client is not None:  # type: ignore[attr-defined]
            await runtime.app._http_client.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["2", "-1", "x", "", "1.0"])
async def test_a_partition_of_no_main_topic_answers_400_without_routing(
    worker: Worker, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker.runtime, "partitions", 2)
    says = f"partition must be an integer from 0 to 1 (2 partitions), not {value!r}"
    status, body = await worker.get(f"/retry/keys/plain?partition={value}")
    assert status == 400 and body["error"] == says and body["found"] is False
    status, body = await worker.post(f"/retry/admin/keys/plain/retry-now?partition={value}")
    assert status == 400 and body["error"] == says and body["action"] == "retry-now"
    assert worker.routed == []


async def test_a_refused_key_actions_audit_line_names_the_key_its_name_reads_as(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: the refused line logged the path's text as if it were the key: with ``?key_encoding=base64`` the
    base64 in quotes, as a key of that text. It names the key as the other audit lines do now, or says the name
    names none."""
    name = base64_of_key(REPORTED_KEY)
    with caplog.at_level(logging.WARNING, logger="app.web.admin"):
        for path, query in ((name, "?key_encoding=base64"), ("plain", ""), ("not$base64", "?key_encoding=base64")):
            response = await worker.client.post(f"/retry/admin/keys/{path}/retry-now{query}")  # no token: refused
            assert response.status == 401
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines == [
        f"admin retry-now of key 'retry-\\xff\\xfe' (base64 {name}) refused (401): admin actions need an "
        "'Authorization: Bearer <token>' header",
        "admin retry-now of key 'plain' refused (401): admin actions need an 'Authorization: Bearer <token>' header",
        "admin retry-now of key named 'not$base64' (not base64: '$' is not a base64 character (in 'not$base64')) "
        "refused (401): admin actions need an 'Authorization: Bearer <token>' header",
    ], lines
