"""The key view while a message moves between tiers: its retry was sent to a tier and is not parked yet.

A new user polled ``GET /retry/keys/K`` every 50 ms while a message moved between tiers and read ``found: false``
for 50-100 ms at each hop (CLI ``faust -A app key K``: exit 1, "no retry state"), though the message was alive. The
key's index remembers it (a *forwarded* mark, ``rebound/state.py``): the view lists it under ``on_its_way`` and
answers found. The real agents through ``test_context`` (tier topics replaced by recorders: a forwarded retry stays
"on the tier topic" until the test hands it to the tier agent), the store in memory, the worker's own web app over
HTTP (aiohttp's test server); no broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from app import views
from tests.agents.support import Agents, first

FAILS_TWICE = b'{"succeed_on": 2}'


class Worker:
    def __init__(self, runtime: Any, agents: Agents, client: TestClient) -> None:
        self.runtime, self.agents, self.client = runtime, agents, client

    async def key(self, name: str = "k") -> tuple[int, Any]:
        response = await self.client.get(f"/retry/keys/{name}")
        return response.status, await response.json()


@pytest.fixture
async def worker(make_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Worker]:
    runtime = make_runtime(ended_memory="10s")
    runtime.schedule.adopt(0, [])
    monkeypatch.setattr(views, "tables_started", lambda app: True)
    monkeypatch.setattr(runtime.app.producer, "_ensure_producer", lambda: None)  # no metadata to fetch: logged
    monkeypatch.setattr(runtime.app.router, "key_store", lambda table, key: runtime.app.conf.canonical_url)
    async with Agents(runtime) as agents, TestClient(TestServer(runtime.app.web.web_app)) as client:
        yield Worker(runtime, agents, client)


async def test_a_retry_on_its_way_to_its_tier_is_found_and_listed_until_it_parks(worker: Worker, clock: Any) -> None:
    await first(worker.agents, FAILS_TWICE)  # offset 0 fails: its retry 1 is sent to items.retry.1s, not parked yet
    clock.advance(40)
    status, body = await worker.key()
    assert status == 200 and body["found"] is True, body
    assert body["pending"] == []
    assert body["on_its_way"] == [
        {
            "origin": "items/0/0",
            "original_topic": "items",
            "original_partition": 0,
            "original_offset": 0,
            "attempt": 1,
            "state": "forwarded",
            "since_ms": 40,
        }
    ]

    await worker.agents.park_tier_records()  # it arrives: the parked entry says where it is
    status, body = await worker.key()
    assert status == 200 and [entry["attempt"] for entry in body["pending"]] == [1] and body["on_its_way"] == []

    clock.advance(1000)
    await worker.agents.release_due()  # retry 1 fails: retry 2 goes to its tier, the entry is settled
    status, body = await worker.key()
    assert status == 200 and body["pending"] == [], body
    assert [(item["attempt"], item["state"], item["since_ms"]) for item in body["on_its_way"]] == [(2, "forwarded", 0)]

    clock.advance(10_000)  # REBOUND_ENDED_MEMORY later the mark counts for nothing, forgotten or not
    status, body = await worker.key()
    assert status == 404 and body["found"] is False


async def test_a_key_with_nothing_parked_or_on_its_way_is_still_not_found(worker: Worker) -> None:
    status, body = await worker.key("nothing")
    assert status == 404 and body == {"key": "nothing", "found": False, "worker": body["worker"]}
