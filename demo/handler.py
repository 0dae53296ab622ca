"""The demo handler: an items service on SQLite.

``CreateItem`` inserts, ``UpdateItem`` changes an existing item. An update for an item that does not exist yet is a
retryable failure (its create is probably still on its way); a malformed event is permanent. Both operations are
idempotent, because delivery is at-least-once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from rebound import PermanentError, RetryableError, RetryEvent, UndecodableError

DB_ENV = "REBOUND_DEMO_DB"
_SCHEMA = "CREATE TABLE IF NOT EXISTS items (id TEXT PRIMARY KEY, name TEXT NOT NULL, price REAL, version INTEGER)"


def database_path() -> Path:
    return Path(os.environ.get(DB_ENV) or Path(os.environ.get("REBOUND_DATA_DIR", "./data")) / "items.db")


def _connect() -> sqlite3.Connection:
    path = database_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, timeout=10)
    connection.execute(_SCHEMA)
    return connection


def decode(value: bytes | None) -> dict[str, Any]:
    if value is None:
        raise PermanentError("null value: an items event needs a body")
    try:
        body = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UndecodableError(f"not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise PermanentError("an items event must be a JSON object")
    kind, item_id = body.get("type"), body.get("id")
    if kind not in {"CreateItem", "UpdateItem"}:
        raise PermanentError(f"unknown event type {kind!r}")
    if not isinstance(item_id, str) or not item_id:
        raise PermanentError("the event has no item id")
    return body


def apply(body: dict[str, Any]) -> str:
    with _connect() as connection:
        if body["type"] == "CreateItem":
            if not isinstance(body.get("name"), str):
                raise PermanentError("CreateItem needs a name")
            connection.execute(
                "INSERT OR IGNORE INTO items (id, name, price, version) VALUES (?, ?, ?, 1)",
                (body["id"], body["name"], body.get("price")),
            )
            return "created"
        row = connection.execute("SELECT version FROM items WHERE id = ?", (body["id"],)).fetchone()
        if row is None:
            raise RetryableError(f"item {body['id']} does not exist yet")
        fields = {name: body[name] for name in ("name", "price") if name in body}
        if fields:
            assignments = ", ".join(f"{name} = ?" for name in fields)
            connection.execute(
                f"UPDATE items SET {assignments}, version = version + 1 WHERE id = ?",
                (*fields.values(), body["id"]),
            )
        return "updated"


async def handle(event: RetryEvent) -> str:
    body = decode(event.value)
    return await asyncio.to_thread(apply, body)
