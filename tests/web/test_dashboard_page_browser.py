"""The dashboard's tables in a real headless Chromium, against stand-in JSON views (no worker, no broker): every
backlog column has a heading and the tiers keep the worker's order, and a key the failed-record table shows with its
base64 can be typed back into the filter (``key_encoding=base64``).

Needs Debian's ``chromium`` and ``chromium-driver`` and the dev dependency selenium (skipped, saying so, without
them: ``make system-packages``). The end-to-end browser test on a real worker is
``tests/integration/test_dashboard_browser.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rebound.key_names import base64_of_key

pytestmark = pytest.mark.slow

STATIC = Path(__file__).resolve().parents[2] / "app" / "web" / "static"
BINARY_KEY = b"retry-\xff\xfe"
TIER = {"waiting": 0, "overdue": 0, "max_overdue_ms": 0, "next_release_in_ms": None, "oldest_due": None}
BACKLOG = {
    "scope": "cluster",
    "workers": [],
    "tiers": {  # the worker's order, the policy's: by delay
        "items.retry.2s": {**TIER, "waiting": 3, "oldest_age_ms": 1000},
        "items.retry.5s": {**TIER, "oldest_age_ms": None},
        "items.retry.10s": {**TIER, "oldest_age_ms": None},
    },
}
RECORD = {"topic": "items.failed", "partition": 0, "offset": 7, "timestamp": 1, "headers": {}}


class StandIn:
    """The JSON views the page polls, on a loopback port in a thread of its own; ``queries`` of /retry/failed."""

    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()

    async def failed(self, request: web.Request) -> web.Response:
        if "topic" not in request.query:  # the summary
            return web.json_response({"topics": {}, "caught_up": True})
        self.queries.append(dict(request.query))
        record = {
            **RECORD,
            "key": BINARY_KEY.decode("utf-8", "backslashreplace"),
            "key_base64": base64_of_key(BINARY_KEY),
        }
        body = {"records": [record], "next_before": None, "scanned": 1, "scan_limit": 1000, "scan_capped": False}
        return web.json_response(body)

    def serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        for name in ("dashboard.js", "dashboard.css"):
            app.router.add_get(f"/dashboard/{name}", self.file(name))
        app.router.add_get("/dashboard/", self.file("dashboard.html"))
        app.router.add_get("/retry/backlog", self.answer(BACKLOG))
        app.router.add_get("/retry/history", self.answer({"samples": [], "now": 1, "window_ms": 1, "interval_ms": 1}))
        app.router.add_get("/metrics", lambda _: self.text(""))
        app.router.add_get("/retry/failed", self.failed)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    @staticmethod
    def file(name: str) -> Callable[[web.Request], Any]:
        async def handle(_: web.Request) -> web.Response:
            kind = {"html": "text/html", "js": "text/javascript", "css": "text/css"}[name.rsplit(".", 1)[1]]
            return web.Response(body=(STATIC / name).read_bytes(), content_type=kind)

        return handle

    @staticmethod
    def answer(body: Any) -> Callable[[web.Request], Any]:
        async def handle(_: web.Request) -> web.Response:
            return web.json_response(body)

        return handle

    @staticmethod
    async def text(body: str) -> web.Response:
        return web.Response(text=body)


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandIn]:
    server = StandIn()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    assert server.ready.wait(10)
    yield server
    server.loop.call_soon_threadsafe(server.loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    pytest.importorskip("selenium", reason="selenium is a dev dependency: pip install -e '.[dev]'")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from tests.integration.test_dashboard_browser import find_chromium

    found = find_chromium()
    if found is None:
        pytest.skip("chromium and chromedriver not found: make system-packages")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    chrome = webdriver.Chrome(service=Service(executable_path=found[1]), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def until(what: str, check: Callable[[], Any], timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except Exception:  # the page is not there yet
            found = None
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def texts(driver: Any, selector: str) -> list[str]:
    return [node.text for node in driver.find_elements("css selector", selector)]


def test_every_backlog_column_has_a_heading_and_a_value_in_the_worker_s_tier_order(
    stand_in: StandIn, driver: Any
) -> None:
    """Reported: the backlog table had an empty last column (the waiting bar's, with no heading, empty while nothing
    waits). The bar is in the waiting cell now."""
    driver.get(f"http://127.0.0.1:{stand_in.port}/dashboard/")
    rows = until("the backlog rows", lambda: driver.find_elements("css selector", "#backlog tbody tr[data-tier]"))
    headings = texts(driver, "#backlog thead th")
    assert all(headings), headings
    assert [row.get_attribute("data-tier") for row in rows] == list(BACKLOG["tiers"])
    for row in rows:
        cells = [cell.text for cell in row.find_elements("css selector", "td")]
        assert len(cells) == len(headings) and all(cells), cells
    assert texts(driver, "#backlog td.waiting") == ["3", "0", "0"]
    assert driver.find_elements("css selector", "#backlog td.waiting .bar")


def test_a_key_shown_with_its_base64_is_found_again_by_that_base64(stand_in: StandIn, driver: Any) -> None:
    """Reported: the failed-record filter took text only, and the text shown for a key that is not UTF-8
    (``retry-\\xff\\xfe``) names other bytes. The table shows its base64 too, and "base64" sends what is typed as
    ``key_encoding=base64``."""
    driver.get(f"http://127.0.0.1:{stand_in.port}/dashboard/")
    name = base64_of_key(BINARY_KEY)
    shown = until("the first page", lambda: texts(driver, "#failed-records td.key"))
    assert shown == [f"retry-\\xff\\xfe (base64 {name})"]
    box = driver.find_element("id", "failed-key")
    box.send_keys(name)
    driver.find_element("id", "failed-key-base64").click()
    stand_in.queries.clear()
    driver.find_element("id", "failed-search").click()
    query = until("the filtered request", lambda: stand_in.queries and stand_in.queries[-1])
    assert (query["key"], query["key_encoding"]) == (name, "base64")
    driver.find_element("id", "failed-key-base64").click()  # unticked: the text as it is, as before
    stand_in.queries.clear()
    driver.find_element("id", "failed-search").click()
    query = until("the text request", lambda: stand_in.queries and stand_in.queries[-1])
    assert query["key"] == name and "key_encoding" not in query
