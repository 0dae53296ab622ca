"""``GET /dashboard/``: one HTML page, its style sheet and its script (no CDN, no external asset), its charts drawn by
the script.

The files are package data in ``app/web/static/`` (``dashboard.html``, ``dashboard.css``, ``dashboard.js``), read once
when the views are registered and served from memory with their content type and an ETag. The page polls the JSON
views (``/retry/backlog``, ``/retry/history``, ``/retry/failed``, ``/metrics``) and draws SVG charts of the last hour.
Everything it shows from the server (keys, topic names, error messages) is inserted as text (``textContent``), never
as markup; the page's Content-Security-Policy allows only scripts and styles from its own server and no inline script,
so even markup that slipped in could not run anything or load anything.

:func:`register_dashboard_views` registers the page and its files, ``/retry/history`` (with its sampling timer) and
``/retry/failed`` (summary and browser).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from faust.web import Blueprint

from agents.runtime import Runtime
from agents.services import Closing, start_with
from rebound.key_names import KeyNameError

STATIC = "static"
"""The page's files, next to this module (package data): ``dashboard.html``, ``dashboard.css``, ``dashboard.js``."""

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
"""Only the page's own script file runs (no inline script: an injected ``onerror=`` or ``<script>`` would not), nothing
is loaded from anywhere else, and the page fetches only its own server's views."""

CACHE_CONTROL = "no-cache"
"""A browser keeps the files but asks again each time (a 304 while the ETag matches): after an upgrade the page and its
script never come from different releases."""


@dataclass(frozen=True)
class Asset:
    """One file of the page, read once at start-up; its ETag is a digest of its bytes."""

    body: bytes
    content_type: str
    etag: str

    @classmethod
    def of(cls, body: bytes, content_type: str) -> Asset:
        return cls(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


ASSETS = [
    # (URL path, file in STATIC, content type, view name)
    ("/dashboard/", "dashboard.html", "text/html; charset=utf-8", "dashboard"),
    ("/dashboard/dashboard.css", "dashboard.css", "text/css; charset=utf-8", "dashboard_css"),
    ("/dashboard/dashboard.js", "dashboard.js", "text/javascript; charset=utf-8", "dashboard_js"),
]


def load_assets() -> dict[str, Asset]:
    """The page's files by URL path, from the installed package (a missing file fails the worker's start)."""
    folder = resources.files("app.web").joinpath(STATIC)
    return {path: Asset.of(folder.joinpath(name).read_bytes(), content_type) for path, name, content_type, _ in ASSETS}


def matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` header names this ETag (or ``*``); weak ETags (``W/"..."``) compare equal."""
    if not if_none_match:
        return False
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return "*" in tags or etag in tags


def asset_view(asset: Asset) -> Any:
    """The view serving one file: its bytes, or a bodiless 304 when the browser's copy is current."""

    async def serve(web: Any, request: Any) -> Any:
        headers = {
            "Content-Type": asset.content_type,  # in the headers: aiohttp refuses a charset in ``content_type``
            "Cache-Control": CACHE_CONTROL,
            "ETag": asset.etag,
            "X-Content-Type-Options": "nosniff",
        }
        if asset.content_type.startswith("text/html"):
            headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        if matches(request.headers.get("If-None-Match"), asset.etag):
            return web.bytes(b"", status=304, headers=headers)
        return web.bytes(asset.body, headers=headers)

    return serve


def register_assets(blueprint: Blueprint) -> None:
    """``GET /dashboard/`` (the page) and the two files it loads, ``/dashboard/dashboard.{css,js}``."""
    assets = load_assets()
    for path, _, _, name in ASSETS:
        blueprint.route(path, name=name)(asset_view(assets[path]))


def _int_arg(request: Any, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except (TypeError, ValueError):
        return default


def register_dashboard_views(runtime: Runtime, blueprint: Blueprint) -> None:
    """``/dashboard/``, ``/retry/history`` (and its sampling timer) and ``/retry/failed``."""
    from app.web.failed import (
        BROWSE_PARAMS,
        DEFAULT_LIMIT,
        DEFAULT_PAGE,
        FailedTopicReader,
        browse_filter,
        decode_cursor,
    )
    from app.web.history import SCOPES, history_view, register_history

    app = runtime.app
    rings = register_history(runtime)
    failed_names = {main: topic.get_topic_name() for main, topic in runtime.failed_topics.items()}
    failed_reader = FailedTopicReader(
        runtime.settings.bootstrap_servers,
        list(failed_names.values()),
        fetch_max_wait_ms=min(runtime.settings.fetch_max_wait_ms, 200),
    )

    register_assets(blueprint)

    @blueprint.route("/retry/history")
    async def retry_history(web: Any, request: Any) -> Any:
        chosen = request.query.get("scope", "cluster")
        if chosen not in SCOPES:
            return web.json({"error": f"scope must be one of {', '.join(SCOPES)}"}, status=400)
        since = request.query.get("since")
        try:
            since_ms = None if since in (None, "") else int(since)
        except ValueError:
            return web.json({"error": "since must be epoch milliseconds"}, status=400)
        return web.json(history_view(runtime, rings, scope=chosen, since_ms=since_ms))

    @blueprint.route("/retry/failed")
    async def retry_failed(web: Any, request: Any) -> Any:
        query = request.query
        show = runtime.settings.show_payloads
        if not any(name in query for name in BROWSE_PARAMS):
            limit = _int_arg(request, "limit", DEFAULT_LIMIT)
            return web.json(await failed_reader.summary(limit=limit, show_payloads=show))
        topic = query.get("topic") or None
        topics = None
        if topic is not None:
            name = failed_names.get(topic, topic)  # a main topic names its failed topic
            if name not in failed_names.values():
                return web.json({"error": f"not a failed topic: {topic}"}, status=400)
            topics = [name]
        before = None
        if query.get("before"):
            try:
                before = decode_cursor(query["before"])
            except ValueError as exc:
                return web.json({"error": str(exc)}, status=400)
        try:
            wanted = browse_filter(query)
        except KeyNameError as exc:
            return web.json({"key": query.get("key"), "error": str(exc)}, status=400)
        page = await failed_reader.browse(
            wanted=wanted,
            topics=topics,
            before=before,
            limit=_int_arg(request, "limit", DEFAULT_PAGE),
            show_payloads=show,
        )
        return web.json(page)

    start_with(app, Closing("failed-topic reader", failed_reader.close))
