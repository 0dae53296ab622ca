"""Key views before the worker can route keys (``app/views.py``): a 503 with ``Retry-After``, and no metadata lookup
that a broker creating topics on request would answer by creating the changelog with its own partition count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from faust.web.exceptions import ServiceUnavailable

from agents.runtime import Runtime
from app import views
from app.views import NO_OWNER_YET, ROUTING_RETRY_AFTER_S, TABLES_STARTING, ensure_routable, routed_answer
from tests.app_under_test import build_runtime


@pytest.fixture
async def runtime(tmp_path: Path) -> Runtime:
    return build_runtime(tmp_path, web_enabled=False)


class AnsweringView:
    """What a Faust view's ``json`` gives a handler, kept to be checked."""

    def json(self, body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Any:
        return {"body": body, "status": status, "headers": headers}


async def test_before_the_tables_start_a_key_view_answers_503_without_asking_the_broker(runtime: Runtime) -> None:
    assert not runtime.app.tables.recovery.started  # a worker that has not started its tables yet
    refusal = await ensure_routable(runtime)
    assert refusal == (
        {"error": TABLES_STARTING, "retry_after_s": ROUTING_RETRY_AFTER_S},
        503,
        {"Retry-After": str(ROUTING_RETRY_AFTER_S)},
    )
    assert runtime.app._producer is None  # type: ignore[attr-defined]  # no producer, so no metadata request

    async def route() -> Any:
        raise AssertionError("routed before the tables started")

    answer = await routed_answer(runtime, AnsweringView(), route)
    assert answer["status"] == 503 and answer["headers"] == {"Retry-After": str(ROUTING_RETRY_AFTER_S)}


async def test_faust_s_503_before_any_worker_owns_the_partition_gets_a_reason_and_retry_after(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "tables_started", lambda app: True)
    monkeypatch.setattr(runtime.app.producer, "_ensure_producer", lambda: None)  # metadata fetch fails: logged

    async def route() -> Any:
        raise ServiceUnavailable()  # what ``app.router.route_req`` raises when no worker owns the key's partition

    answer = await routed_answer(runtime, AnsweringView(), route)
    assert answer == {
        "body": {"error": NO_OWNER_YET, "retry_after_s": ROUTING_RETRY_AFTER_S},
        "status": 503,
        "headers": {"Retry-After": str(ROUTING_RETRY_AFTER_S)},
    }
