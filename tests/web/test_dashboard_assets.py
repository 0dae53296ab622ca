"""The dashboard's files (``app/web/static/``) as the web server serves them: content types, the page's
Content-Security-Policy, ETags and 304s, and a page that loads only its own files. A bare Faust app's web server, no
broker."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import faust
import pytest
from aiohttp.test_utils import TestClient, TestServer
from faust.web import Blueprint

from app.web.dashboard import ASSETS, CONTENT_SECURITY_POLICY, matches, register_assets

STATIC = Path(__file__).resolve().parents[2] / "app" / "web" / "static"


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    app = faust.App("dashboard-assets-test", web_enabled=True)
    blueprint = Blueprint("rebound")
    register_assets(blueprint)
    blueprint.register(app)
    async with TestClient(TestServer(app.web.web_app)) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "name", "content_type"),
    [
        ("/dashboard/", "dashboard.html", "text/html"),
        ("/dashboard/dashboard.css", "dashboard.css", "text/css"),
        ("/dashboard/dashboard.js", "dashboard.js", "text/javascript"),
    ],
)
async def test_each_file_is_served_as_it_is_with_its_type(
    client: Any,
    path: str,
    name: str,
    content_type: str,
) -> None:
    response = await client.get(path)
    assert response.status == 200
    assert response.content_type == content_type and response.charset == "utf-8"
    assert await response.read() == (STATIC / name).read_bytes()
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Cache-Control"] == "no-cache"
    etag = response.headers["ETag"]
    assert re.fullmatch(r'"[0-9a-f]{32}"', etag)

    again = await client.get(path, headers={"If-None-Match": etag})
    assert again.status == 304 and await again.read() == b""
    assert again.headers["ETag"] == etag

    stale = await client.get(path, headers={"If-None-Match": '"0123"'})
    assert stale.status == 200 and await stale.read() == (STATIC / name).read_bytes()


async def test_the_page_loads_only_its_own_files_and_runs_no_inline_script(client: Any) -> None:
    response = await client.get("/dashboard/")
    assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    policy = dict(part.split(" ", 1) for part in CONTENT_SECURITY_POLICY.split("; "))
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"  # no 'unsafe-inline'
    html = await response.text()
    assert re.findall(r'<script src="([^"]+)"></script>', html) == ["/dashboard/dashboard.js"]
    assert re.findall(r'<link rel="stylesheet" href="([^"]+)">', html) == ["/dashboard/dashboard.css"]
    assert "<style" not in html and re.search(r"<script>|\son\w+=", html) is None
    for text in (html, (STATIC / "dashboard.js").read_text(), (STATIC / "dashboard.css").read_text()):
        # Self-contained: nothing external (the SVG namespace is a name, never fetched).
        assert not re.search(r"https?://", text.replace("http://www.w3.org/2000/svg", ""))


def test_every_file_of_the_static_folder_is_served() -> None:
    assert sorted(name for _, name, _, _ in ASSETS) == sorted(path.name for path in STATIC.iterdir())


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, False),
        ("", False),
        ('"abc"', True),
        ('W/"abc"', True),
        ('"x", "abc"', True),
        ("*", True),
        ('"abcd"', False),
    ],
)
def test_if_none_match(header: str | None, expected: bool) -> None:
    assert matches(header, '"abc"') is expected
