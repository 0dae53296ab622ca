"""The command line's HTTP client of a worker's web API (``/retry/...``): one request per command, no broker.

Where: ``REBOUND_WEB_URL``, else ``http://<REBOUND_WEB_HOST or 127.0.0.1>:<REBOUND_WEB_PORT or 6066>`` (a worker's
wildcard listen address is reached on 127.0.0.1). The admin token comes from ``REBOUND_ADMIN_TOKEN``. Both are read
from the environment, then from a ``.env`` file in the working directory, as the worker reads its settings.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rebound.attempts import key_text
from rebound.key_names import BASE64, KEY_ENCODING_PARAM, PARTITION_PARAM, base64_of_key, needs_base64

DEFAULT_PORT = "6066"
DEFAULT_TIMEOUT_S = 30.0
OPERATOR_HEADER = "X-Rebound-Operator"


class ClientError(Exception):
    """Any failure of a command; ``exit_code`` is what the process exits with."""

    exit_code = 1


class ApiError(ClientError):
    """The worker answered with an HTTP error."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body


class Unreachable(ClientError):
    """No answer: connection refused, name not resolved, timed out."""

    exit_code = 3


class MissingToken(ClientError):
    exit_code = 2


class NotAWorker(ClientError):
    """Something answered 2xx, but not with a JSON object: not a Rebound worker's web API."""


class KeyNotFound(ApiError):
    """``GET /retry/keys/{key}`` answered 404 ``found: false``: nothing of the key pending or on its way to a tier. The
    worker that owns the key's partition answered (the view is routed there), so no other worker has any either. Exit code 1, as for the
    other "not found" answers (an admin action on a key with nothing pending, a replay of an offset with no record):
    the worker answered, and not with what was asked for."""

    def __init__(self, key: bytes, body: dict[str, Any], partition: int | None = None) -> None:
        worker = body.get("worker") or "?"
        named = f"{key_text(key)} (base64 {base64_of_key(key)})" if needs_base64(key) else repr(key.decode())
        owns = "its partition" if partition is None else f"partition {partition}"
        message = f"no retry state for key {named}: nothing pending or on its way to a tier (answered by {worker}, which owns {owns})"
        super().__init__(404, message, {**body, "error": message})

    def __str__(self) -> str:
        return self.message


_LONGEST_MESSAGE = 200


def one_line(text: str | None, limit: int = _LONGEST_MESSAGE) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters."""
    value = " ".join((text or "").split())
    return value if len(value) <= limit else value[: limit - 1] + "…"


def error_message(status: int, text: str | None, body: Any) -> str:
    """One line for an HTTP error answer: the worker's ``error`` field; else the body on one line, without the status
    a plain-text error page repeats (aiohttp's ``500 Internal Server Error\n\nServer got itself in trouble``); for a
    5xx without a worker's explanation, where to look."""
    if isinstance(body, dict) and body.get("error"):
        return one_line(str(body["error"]))
    if isinstance(body, dict | list):
        message = one_line(json.dumps(body, sort_keys=True))
    else:
        message = one_line(text).removeprefix(str(status)).lstrip(" :") if text else ""
    message = message or "no body"
    return f"{message} (see the worker's log)" if status >= 500 else message


class BadKeyName(ClientError):
    """A key argument that names no key (``--key-encoding base64`` with something that is not base64)."""

    exit_code = 2


def key_path(key: bytes, partition: int | None = None) -> tuple[str, dict[str, str] | None]:
    """A key's path segment and query: its text when that names it (as before ``key_encoding`` existed), else its
    base64 with ``key_encoding=base64`` (``rebound/key_names.py``: not UTF-8, holding control characters, or ``.`` and
    ``..``, which the URL would drop from the path).

    With ``partition``, ``?partition=N`` too: routed to the worker owning that partition instead of by the key's hash.
    """
    where = {} if partition is None else {PARTITION_PARAM: str(partition)}
    if needs_base64(key):
        return base64_of_key(key), {KEY_ENCODING_PARAM: BASE64, **where}
    return quote(key.decode("utf-8"), safe=""), where or None


def environment(env: Mapping[str, str] | None = None, env_file: str | Path = ".env") -> dict[str, str]:
    """``REBOUND_*`` variables: the process's, over those of ``env_file`` (if it exists)."""
    merged: dict[str, str] = {}
    path = Path(env_file)
    if path.is_file():
        from app.environment import env_file_values

        merged.update(
            {k: v for k, v in env_file_values(path.resolve()).items() if k.startswith("REBOUND_") and v is not None}
        )
    merged.update({k: v for k, v in (os.environ if env is None else env).items() if k.startswith("REBOUND_")})
    return merged


def default_base_url(env: Mapping[str, str]) -> str:
    url = (env.get("REBOUND_WEB_URL") or "").strip()
    if url:
        return url.rstrip("/")
    host = (env.get("REBOUND_WEB_HOST") or "").strip()
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = (env.get("REBOUND_WEB_PORT") or "").strip() or DEFAULT_PORT
    return f"http://{host}:{port}"


def default_operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "?"
    return f"{user}@{socket.gethostname()}"


@dataclass
class ApiClient:
    base_url: str
    token: str | None = None
    operator: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    async def _call(
        self, method: str, path: str, *, admin: bool = False, params: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        import aiohttp

        headers: dict[str, str] = {"Accept": "application/json"}
        if admin:
            if not self.token:
                raise MissingToken("admin actions need the workers' admin token: set REBOUND_ADMIN_TOKEN (or --token)")
            headers["Authorization"] = f"Bearer {self.token}"
            headers[OPERATOR_HEADER] = self.operator or default_operator()
        url = f"{self.base_url}{path}"
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session,
                session.request(method, url, headers=headers, params=params) as response,
            ):
                status = response.status
                text = await response.text()
        except TimeoutError as exc:
            raise Unreachable(f"no answer from {url} within {self.timeout_s:g}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(f"cannot reach a Rebound worker at {self.base_url} ({exc.os_error or exc})") from exc
        except aiohttp.ClientError as exc:
            raise Unreachable(f"request to {url} failed: {exc!r}") from exc
        try:
            body: Any = json.loads(text) if text else None
        except ValueError:
            body = text
        if status >= 400:
            raise ApiError(status, error_message(status, text, body), body)
        if not isinstance(body, dict):
            raise NotAWorker(
                f"the answer of {url} is not a Rebound worker's JSON (check REBOUND_WEB_URL or --url): "
                f"{one_line(text) or 'no body'}"
            )
        return status, body

    async def backlog(self, *, worker_only: bool = False) -> tuple[int, Any]:
        return await self._call("GET", "/retry/backlog", params={"scope": "worker"} if worker_only else None)

    async def key(self, key: bytes, *, partition: int | None = None) -> tuple[int, Any]:
        segment, params = key_path(key, partition)
        try:
            return await self._call("GET", f"/retry/keys/{segment}", params=params)
        except ApiError as exc:
            if exc.status == 404 and isinstance(exc.body, dict) and exc.body.get("found") is False:
                raise KeyNotFound(key, exc.body, partition) from None
            raise

    async def failed(self, *, limit: int | None = None) -> tuple[int, Any]:
        return await self._call("GET", "/retry/failed", params={"limit": str(limit)} if limit else None)

    async def key_action(self, action: str, key: bytes, *, partition: int | None = None) -> tuple[int, Any]:
        segment, params = key_path(key, partition)
        return await self._call("POST", f"/retry/admin/keys/{segment}/{action}", admin=True, params=params)

    async def pause(self, *, paused: bool) -> tuple[int, Any]:
        return await self._call("POST", "/retry/admin/pause" if paused else "/retry/admin/resume", admin=True)

    async def replay(
        self,
        topic: str,
        partition: int,
        offset: int,
        *,
        max_redrives: int | None = None,
        force_other_group: bool = False,
    ) -> tuple[int, Any]:
        params = {"max_redrives": str(max_redrives)} if max_redrives is not None else {}
        if force_other_group:
            params["force_other_group"] = "true"
        path = f"/retry/admin/replay/{quote(topic, safe='')}/{partition}/{offset}"
        return await self._call("POST", path, admin=True, params=params or None)
