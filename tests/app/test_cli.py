"""The operator commands (``app/cli.py``, ``app/api_client.py``) against a fake worker web API (aiohttp test server).

What is checked: the request each command makes (path, query, token and operator headers), what it prints (plain
columns, or the JSON answer with ``--json``), and its exit code: 0 done, 1 the worker answered with an error, 2 no
admin token, 3 no worker answered, 4 a key action not complete or an admin action not confirmed (202). Two runs go
through ``python -m faust -A app <command>`` itself, with no broker anywhere: the commands must not build the worker's
app.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.api_client import ApiClient, default_base_url, environment
from app.cli import cli_app, format_key_action, format_pause, is_faust_cli, requested_command, run_command, table

ROOT = Path(__file__).resolve().parents[2]
NOW_MS = 1_700_000_000_000

BACKLOG = {
    "now": NOW_MS,
    "scope": "cluster",
    "workers": [{"worker": "w1", "url": "http://w1:6066", "age_ms": 100, "partitions": [0, 1]}],
    "stale_workers": [],
    "partitions_reported": [0, 1],
    "partitions_missing": [],
    "tiers": {
        "items.retry.5m": {
            "waiting": 12,
            "overdue": 2,
            "max_overdue_ms": 1_500,
            "next_release_in_ms": 252_000,
            "oldest_age_ms": 3_600_000,
        },
        "items.retry.1h": {"waiting": 0, "overdue": 0, "max_overdue_ms": 0, "next_release_in_ms": None},
    },
    "ordering": {"mode": "none", "blocked_keys": 0, "held": 0},
    "breakers": {},
    "paused": {
        "paused": True,
        "by": "alice@ops-1",
        "source": "10.0.0.5",
        "at": NOW_MS,
        "topics": ["items"],
        "known": True,
        "applied_here": True,
    },
}


@dataclass
class FakeWorker:
    """Answers every path from ``answers`` (path -> (status, body)) and records the requests."""

    answers: dict[str, tuple[int, Any]] = field(default_factory=dict)
    texts: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> (status, a plain-text body)
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(
            {
                "method": request.method,
                "path": request.raw_path.split("?", 1)[0],
                "query": dict(request.query),
                "authorization": request.headers.get("Authorization"),
                "operator": request.headers.get("X-Rebound-Operator"),
            }
        )
        if request.path in self.texts:
            status, text = self.texts[request.path]
            return web.Response(text=text, status=status)
        status, body = self.answers.get(request.path, (404, {"error": f"no route {request.path}"}))
        return web.json_response(body, status=status)


@pytest.fixture
async def fake() -> AsyncIterator[FakeWorker]:
    worker = FakeWorker()
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", worker.handle)
    server = TestServer(application, host="127.0.0.1")
    await server.start_server()
    worker.url = str(server.make_url("")).rstrip("/")
    try:
        yield worker
    finally:
        await server.close()


async def run(fake: FakeWorker, command: str, *, token: str | None = "s3cret", **options: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    client = ApiClient(fake.url, token=token, operator="alice@ops-1", timeout_s=5)
    code = await run_command(command, client=client, out=out, err=err, **options)
    return code, out.getvalue(), err.getvalue()


async def test_backlog_prints_the_pause_and_aligned_tier_columns(fake: FakeWorker) -> None:
    fake.answers["/retry/backlog"] = (200, BACKLOG)
    code, out, err = await run(fake, "backlog")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("main topics items: PAUSED by alice@ops-1 from 10.0.0.5 at 2023-11-14T22:13:20Z")
    assert "retries are still released" in lines[0]
    assert lines[1] == "workers: 1 reporting, 0 stale; partitions missing: -"
    assert lines[2].split() == ["TIER", "WAITING", "OVERDUE", "MAX", "OVERDUE", "NEXT", "RELEASE", "IN", "OLDEST"]
    # The tiers in the worker's order (by delay), not by name (reported: 10s, 2s, 5s).
    assert lines[3].split() == ["items.retry.5m", "12", "2", "1s", "4m12s", "1h00m"]
    assert lines[4].split() == ["items.retry.1h", "0", "0", "-", "-", "-"]
    assert lines[4].index("0 ") == lines[3].index("12 ") + 1  # numbers right-aligned under their heading
    assert fake.requests[0]["authorization"] is None  # read-only views send no token

    code, out, _ = await run(fake, "backlog", as_json=True, worker_only=True)
    assert code == 0 and json.loads(out) == BACKLOG
    # Review: --json sorted the keys, so the tiers came by name (1h before 5m): the answer is printed as it came.
    assert list(json.loads(out)["tiers"]) == ["items.retry.5m", "items.retry.1h"]
    assert fake.requests[-1]["query"] == {"scope": "worker"}


async def test_key_shows_the_pending_messages_and_a_missing_key_exits_1(fake: FakeWorker) -> None:
    fake.answers["/retry/keys/item 1/x"] = (
        200,
        {
            "key": "item 1/x",
            "found": True,
            "worker": "w1",
            "attempts": 2,
            "next_due": NOW_MS,
            "pending": [
                {
                    "origin": "items/0/42",
                    "attempt": 2,
                    "tier": "5m",
                    "due_at": NOW_MS,
                    "error_class": "RetryableError",
                    "error_message": "item does\nnot exist yet",
                }
            ],
        },
    )
    code, out, _ = await run(fake, "key", key="item 1/x")
    assert code == 0
    assert fake.requests[-1]["path"] == "/retry/keys/item%201%2Fx"  # one path segment, whatever the key holds
    assert "key item 1/x: 1 pending, 2 attempt(s)" in out
    row = out.splitlines()[2]
    assert row.split()[:3] == ["items/0/42", "2", "5m"] and "RetryableError: item does not exist yet" in row

    code, out, err = await run(fake, "key", key="nothing")
    assert code == 1 and out == ""
    assert err == "error: HTTP 404: no route /retry/keys/nothing\n"


async def test_key_prints_each_message_on_its_way_to_its_tier(fake: FakeWorker) -> None:
    """Between a send to a tier and its park, a message of the key is on its way (the view's ``on_its_way``): the
    command printed "0 pending" and nothing else for it (before the view listed it: exit 1, "no retry state")."""
    fake.answers["/retry/keys/item-3"] = (
        200,
        {
            "key": "item-3",
            "found": True,
            "worker": "w1",
            "attempts": 1,
            "next_due": None,
            "pending": [],
            "on_its_way": [
                {"origin": "items/0/3", "attempt": 1, "state": "forwarded", "since_ms": 40},
                {"origin": "items/0/9", "attempt": 2, "state": "sending", "since_ms": 1500},
            ],
        },
    )
    code, out, _ = await run(fake, "key", key="item-3")
    assert code == 0
    assert out.splitlines() == [
        "key item-3: 0 pending, 1 attempt(s), next due -, 2 on its way  (worker w1)",
        "on its way to its tier: items/0/3 attempt 1 (forwarded 40ms ago)",
        "on its way to its tier: items/0/9 attempt 2 (being sent, marked 1s ago)",
    ]


async def test_a_key_with_nothing_pending_prints_one_line_and_exits_1(fake: FakeWorker) -> None:
    """The worker's own 404 for a key with nothing pending (``app/views.py``) has no ``error`` field: the command
    printed its raw JSON (``error: HTTP 404: {"key": ...}``). One line now, exit 1 as for the other "not found"
    answers (an admin action on such a key, a replay of an offset with no record)."""
    fake.answers["/retry/keys/item-9"] = (404, {"key": "item-9", "found": False, "worker": "w1"})
    code, out, err = await run(fake, "key", key="item-9")
    assert (code, out) == (1, "")
    says = "no retry state for key 'item-9': nothing pending or on its way to a tier (answered by w1, which owns its partition)"
    assert err == f"error: {says}\n"
    code, out, err = await run(fake, "key", key="item-9", as_json=True)
    assert code == 1
    assert json.loads(out) == {
        "key": "item-9",
        "found": False,
        "worker": "w1",
        "status": 404,
        "error": says,
    }


@pytest.mark.parametrize(
    ("status", "text", "expected"),
    [
        (
            500,
            "500 Internal Server Error\n\nServer got itself in trouble",  # aiohttp's page for a view that raised
            "error: HTTP 500: Internal Server Error Server got itself in trouble (see the worker's log)",
        ),
        (404, "404: Not Found", "error: HTTP 404: Not Found"),  # no such path (not a Rebound worker, or an old one)
        (502, "<html>\n<body>\n<h1>502 Bad Gateway</h1>\n</body>\n</html>\n", None),  # a proxy's page
        (503, "", "error: HTTP 503: no body (see the worker's log)"),
    ],
    ids=["500", "404", "502-html", "503-empty"],
)
async def test_an_error_answer_that_is_not_the_worker_s_json_prints_one_line(
    fake: FakeWorker, status: int, text: str, expected: str | None
) -> None:
    fake.texts["/retry/backlog"] = (status, text)
    code, out, err = await run(fake, "backlog")
    assert (code, out) == (1, "")
    assert len(err.splitlines()) == 1, err
    assert expected is None or err == expected + "\n"


async def test_a_2xx_answer_that_is_not_the_worker_s_json_is_an_error_not_a_traceback(fake: FakeWorker) -> None:
    """``--url`` pointing at something else that answers 200 (a web server's page): before, ``format_backlog`` raised
    ``AttributeError`` on the text."""
    fake.texts["/retry/backlog"] = (200, "<html><body>It works!</body></html>")
    code, out, err = await run(fake, "backlog")
    assert (code, out) == (1, "")
    assert err.startswith("error: the answer of http://") and "is not a Rebound worker's JSON" in err
    assert len(err.splitlines()) == 1


async def test_failed_lists_topics_and_the_latest_records_to_replay(fake: FakeWorker) -> None:
    fake.answers["/retry/failed"] = (
        200,
        {
            "caught_up": False,
            "topics": {
                "items.failed": {
                    "depth": 3,
                    "by_reason": {"exhausted": 2, "undecodable": 1},
                    "newest_record": NOW_MS,
                    "latest": [
                        {
                            "partition": 1,
                            "offset": 7,
                            "key": "item-4",
                            "headers": {"rebound.reason": "exhausted", "rebound.error-class": "RetryableError"},
                        }
                    ],
                }
            },
        },
    )
    code, out, _ = await run(fake, "failed", limit=100)
    assert code == 0 and fake.requests[-1]["query"] == {"limit": "100"}
    lines = out.splitlines()
    assert lines[1].split() == ["items.failed", "3", "exhausted", "2,", "undecodable", "1", "2023-11-14T22:13:20Z"]
    assert "counts still partial" in lines[2]
    assert "faust -A app replay items.failed <partition> <offset>" in out
    assert lines[-1].split() == ["1", "7", "item-4", "exhausted", "RetryableError"]


async def test_keys_and_errors_from_records_cannot_drive_the_terminal(fake: FakeWorker) -> None:
    """Found trying it as a new user: a failed record keyed ``\\x1b[31mRED\\x1b[0m`` printed real escape codes (and a
    tab broke the columns) in ``failed``; the same went for the worker's error messages printed on stderr."""
    fake.answers["/retry/failed"] = (
        200,
        {
            "caught_up": True,
            "topics": {
                "items.failed": {
                    "depth": 1,
                    "by_reason": {"exhausted": 1},
                    "newest_record": NOW_MS,
                    "latest": [
                        {
                            "partition": 0,
                            "offset": 3,
                            "key": "\x1b[31mRED\x1b[0m\tx",
                            "headers": {"rebound.reason": "exhausted", "rebound.error-class": "E\x9bX"},
                        }
                    ],
                }
            },
        },
    )
    code, out, _ = await run(fake, "failed")
    assert code == 0
    assert "\x1b" not in out and "\t" not in out and "\x9b" not in out
    assert "\\x1b[31mRED\\x1b[0m x" in out and "E\\x9bX" in out  # (a cell's whitespace is one space)
    fake.answers["/retry/backlog"] = (500, {"error": "boom \x1b]0;owned\x07"})
    code, _, err = await run(fake, "backlog")
    assert code == 1 and "\x1b" not in err and "\x07" not in err and "boom \\x1b]0;owned\\x07" in err


async def test_admin_commands_send_the_token_and_who_asked(fake: FakeWorker) -> None:
    fake.answers["/retry/admin/keys/item-1/retry-now"] = (
        200,
        {
            "action": "retry-now",
            "key": "item-1",
            "count": 1,
            "results": [{"partition": 0, "messages": [{"origin": "items/0/3", "attempt": 1, "tier": "5m"}]}],
        },
    )
    code, out, _ = await run(fake, "retry-now", key="item-1")
    assert code == 0
    assert fake.requests[-1] | {"query": None} == {
        "method": "POST",
        "path": "/retry/admin/keys/item-1/retry-now",
        "query": None,
        "authorization": "Bearer s3cret",
        "operator": "alice@ops-1",
    }
    assert out.splitlines()[0] == "retry-now of key item-1: 1 message(s)"
    assert out.splitlines()[2].split()[:3] == ["items/0/3", "1", "5m"]

    fake.answers["/retry/admin/keys/item-2/dead-letter"] = (202, {"key": "item-2", "count": 0, "results": []})
    code, out, _ = await run(fake, "dead-letter", key="item-2")
    assert code == 4 and "not confirmed" in out

    requests = len(fake.requests)
    code, out, err = await run(fake, "pause", token=None)
    assert (code, out) == (2, "") and "REBOUND_ADMIN_TOKEN" in err
    assert len(fake.requests) == requests  # nothing sent without a token

    fake.answers["/retry/admin/pause"] = (401, {"error": "wrong admin token", "action": "pause"})
    code, _, err = await run(fake, "pause")
    assert code == 1 and err == "error: HTTP 401: wrong admin token\n"


async def test_pause_and_resume_print_the_resulting_state(fake: FakeWorker) -> None:
    fake.answers["/retry/admin/pause"] = (200, {"action": "pause", **BACKLOG["paused"], "confirmed": True})
    code, out, _ = await run(fake, "pause")
    assert code == 0 and out.startswith("main topics items: PAUSED by alice@ops-1") and "applied" not in out
    resumed = {**BACKLOG["paused"], "paused": False, "by": "bob", "confirmed": False}
    fake.answers["/retry/admin/resume"] = (202, {"action": "resume", **resumed})
    code, out, _ = await run(fake, "resume")
    assert code == 4  # not confirmed: not "done"
    assert out.splitlines()[0].startswith("main topics items: fetched (resumed by bob from 10.0.0.5")
    assert "had not applied it yet" in out.splitlines()[1]
    assert format_pause({"paused": False, "topics": ["items"], "known": False}) == (
        "main topics items: pause state not read yet: first tries held"
    )
    assert format_pause({"paused": False, "topics": ["items"], "known": False, "reader_failures": 4}).endswith(
        "first tries held (the control reader failed 4 time(s): see the worker's log)"
    )


async def test_an_overtaken_pause_exits_1_and_prints_the_current_state(fake: FakeWorker) -> None:
    current = {**BACKLOG["paused"], "paused": False, "by": "bob"}
    error = "another pause/resume was written after this pause before it was applied: see state"
    fake.answers["/retry/admin/pause"] = (409, {"action": "pause", "overtaken": True, "error": error, "state": current})
    code, _, err = await run(fake, "pause")
    assert code == 1
    assert err.splitlines() == [f"error: HTTP 409: {error}", f"now: {format_pause(current)}"]


async def test_backlog_lists_workers_that_have_not_read_the_pause_state(fake: FakeWorker) -> None:
    fake.answers["/retry/backlog"] = (200, {**BACKLOG, "pause_state_unknown": ["w2"]})
    code, out, _ = await run(fake, "backlog")
    assert code == 0
    assert out.splitlines()[1] == "workers that have not read the pause state yet (first tries held there): w2"


async def test_backlog_says_the_main_topics_are_held_while_a_circuit_breaker_is_open(fake: FakeWorker) -> None:
    """An outage with the breaker on: the first line said ``fetched (never paused)`` while the breaker held the main
    topics (only the breaker line below it was right)."""
    never_paused = {"paused": False, "by": None, "source": None, "at": None, "topics": ["items"], "known": True}
    two = [{"worker": "w1", "partitions": [0]}, {"worker": "w2", "partitions": [1]}]
    fake.answers["/retry/backlog"] = (
        200,
        {
            **BACKLOG,
            "workers": two,
            "paused": never_paused,
            "breakers": {"w1": {"state": "open"}, "w2": {"state": "half-open"}},
        },
    )
    code, out, _ = await run(fake, "backlog")
    assert code == 0
    assert out.splitlines()[0] == (
        "main topics items: held by the circuit breaker on w1 (open), w2 (half-open) (never paused by an operator)"
    )
    assert "circuit breaker w1: open" in out.splitlines()

    # One worker of two: the other fetches them.
    resumed = {**never_paused, "by": "bob", "source": "10.0.0.5", "at": NOW_MS}
    fake.answers["/retry/backlog"] = (
        200,
        {
            **BACKLOG,
            "workers": two,
            "paused": resumed,
            "breakers": {"w1": {"state": "closed"}, "w2": {"state": "open"}},
        },
    )
    code, out, _ = await run(fake, "backlog")
    assert out.splitlines()[0] == (
        "main topics items: held by the circuit breaker on w2 (open), fetched on the other worker(s) "
        "(resumed by bob from 10.0.0.5 at 2023-11-14T22:13:20Z)"
    )

    # This worker's view (?scope=worker): its own breaker.
    fake.answers["/retry/backlog"] = (
        200,
        {**BACKLOG, "scope": "worker", "paused": never_paused, "breakers": None, "breaker": {"state": "open"}},
    )
    code, out, _ = await run(fake, "backlog", worker_only=True)
    assert out.splitlines()[0] == (
        "main topics items: held by the circuit breaker on this worker (open) (never paused by an operator)"
    )

    # Closed breakers change nothing; an operator's pause says so first, and the open breaker after it.
    fake.answers["/retry/backlog"] = (200, {**BACKLOG, "paused": never_paused, "breakers": {"w1": {"state": "closed"}}})
    code, out, _ = await run(fake, "backlog")
    assert out.splitlines()[0] == "main topics items: fetched (never paused)"
    fake.answers["/retry/backlog"] = (200, {**BACKLOG, "breakers": {"w1": {"state": "open"}}})
    code, out, _ = await run(fake, "backlog")
    assert out.splitlines()[0].startswith("main topics items: PAUSED by alice@ops-1")
    assert out.splitlines()[0].endswith(
        "(first tries wait; retries are still released, not on w1 (open): held by the circuit breaker)"
    )


async def test_replay_prints_where_the_record_went_and_a_refusal_exits_1(fake: FakeWorker) -> None:
    path = "/retry/admin/replay/items.failed/1/7"
    fake.answers[path] = (
        200,
        {
            "action": "replay",
            "failed": {"topic": "items.failed", "partition": 1, "offset": 7},
            "target": {"topic": "items", "partition": 1, "offset": 99},
            "key": "item-4",
            "reason": "exhausted",
            "redrive_count": 1,
            "max_redrives": 2,
        },
    )
    code, out, _ = await run(fake, "replay", topic="items.failed", partition=1, offset=7, max_redrives=2)
    assert code == 0 and fake.requests[-1]["query"] == {"max_redrives": "2"}
    assert out.strip() == (
        "replayed items.failed partition 1 offset 7 -> items partition 1 offset 99 "
        "(key 'item-4', was exhausted, redrive-count 1 of at most 2)"
    )
    refusal = {"action": "replay", "error": "the dead letter's value was left out", "refused": "value-left-out"}
    fake.answers[path] = (409, refusal)
    code, out, err = await run(fake, "replay", topic="items.failed", partition=1, offset=7, as_json=True)
    assert code == 1
    assert json.loads(out) == {**refusal, "status": 409}  # the worker's answer as it is, with the status
    assert err == "error: HTTP 409: the dead letter's value was left out\n"
    fake.answers[path] = (200, {"action": "replay"})
    await run(fake, "replay", topic="items.failed", partition=1, offset=7, force_other_group=True)
    assert fake.requests[-1]["query"] == {"force_other_group": "true"}


async def test_no_worker_answering_exits_3() -> None:
    out, err = io.StringIO(), io.StringIO()
    client = ApiClient("http://127.0.0.1:1", timeout_s=5)
    assert await run_command("backlog", client=client, out=out, err=err) == 3
    assert err.getvalue().startswith("error: cannot reach a Rebound worker at http://127.0.0.1:1")


def test_the_worker_url_and_token_come_from_the_environment_then_dot_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert default_base_url({}) == "http://127.0.0.1:6066"
    assert default_base_url({"REBOUND_WEB_PORT": "7000", "REBOUND_WEB_HOST": "0.0.0.0"}) == "http://127.0.0.1:7000"
    assert default_base_url({"REBOUND_WEB_HOST": "::1"}) == "http://[::1]:6066"
    assert default_base_url({"REBOUND_WEB_URL": "https://w.example/", "REBOUND_WEB_PORT": "1"}) == "https://w.example"
    (tmp_path / ".env").write_text("REBOUND_ADMIN_TOKEN=from-file\nREBOUND_WEB_PORT=7001\nOTHER=x\n")
    monkeypatch.chdir(tmp_path)
    assert environment({"REBOUND_WEB_PORT": "7002"}) == {"REBOUND_ADMIN_TOKEN": "from-file", "REBOUND_WEB_PORT": "7002"}


def test_the_command_line_gets_the_bare_app_only_for_rebound_s_commands() -> None:
    assert requested_command(["faust", "-A", "app", "-l", "info", "worker"]) == "worker"
    assert requested_command(["faust", "--app=app", "--json", "pause"]) == "pause"
    assert requested_command(["faust", "-A", "app", "--help"]) is None
    assert is_faust_cli(["/venv/bin/faust"]) and is_faust_cli(["/venv/lib/faust/__main__.py"])
    assert not is_faust_cli(["/venv/bin/pytest"])
    assert cli_app(["faust", "-A", "app", "worker"]) is None
    assert cli_app(["pytest", "backlog"]) is None
    light = cli_app(["faust", "-A", "app", "backlog"])
    assert light is not None and light.conf.id == "rebound-cli"
    assert cli_app(["faust", "-A", "app", "replay", "items.failed", "0", "1"]) is light


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--token", "X", "pause"], "--token goes after the command's name: faust -A app pause --token ..."),
        (
            ["--url=http://w:1", "--timeout", "3", "key", "k"],
            "--url, --timeout go after the command's name: faust -A app key",
        ),
        (["--operator", "bob"], "faust -A app <command> --operator ..."),
    ],
)
def test_a_shared_option_before_the_command_is_one_usage_line_saying_where_it_goes(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert requested_command(["faust", "-A", "app", *argv]) == next((w for w in argv if w in ("pause", "key")), None)
    with pytest.raises(SystemExit) as exited:
        cli_app(["faust", "-A", "app", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert cli_app(["faust", "-A", "app", "--json", "pause", "--token", "X"]) is not None  # after it: as ever


def test_table_aligns_columns() -> None:
    assert table(("A", "NUMBER", "TEXT"), [("x", 5, "a"), ("long", 123, None)]).splitlines() == [
        "A     NUMBER  TEXT",
        "x          5  a",
        "long     123  -",
    ]


async def faust_cli(*args: str, env: dict[str, str], cwd: Path = ROOT) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "faust",
        "-A",
        "app",
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_faust_runs_the_commands_without_a_broker(fake: FakeWorker, tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REBOUND_")},
        "REBOUND_BROKER": "kafka://127.0.0.1:1",  # nothing listens: building the worker's app would fail
        "REBOUND_WEB_URL": fake.url,
        "REBOUND_ADMIN_TOKEN": "s3cret",
        "REBOUND_DATA_DIR": str(tmp_path / "data"),
    }
    fake.answers["/retry/backlog"] = (200, BACKLOG)
    code, out, err = await faust_cli("backlog", env=env)
    assert code == 0, err
    assert out.splitlines()[0].startswith("main topics items: PAUSED by alice@ops-1")
    assert not (tmp_path / "data").exists()

    fake.answers["/retry/admin/replay/items.failed/0/5"] = (409, {"error": "a tombstone", "refused": "tombstone"})
    code, out, err = await faust_cli("replay", "items.failed", "0", "5", "--json", "--operator", "ci", env=env)
    assert code == 1
    assert json.loads(out)["refused"] == "tombstone" and "HTTP 409: a tombstone" in err
    assert fake.requests[-1]["operator"] == "ci" and fake.requests[-1]["authorization"] == "Bearer s3cret"

    # Reported: ``--json`` was taken before the command and ``--token`` not (the token's value was taken for the
    # command, the worker's app built, and its configuration error printed). One usage line now, saying where it goes.
    asked = len(fake.requests)
    code, out, err = await faust_cli("--json", "--token", "s3cret", "pause", env=env)
    assert (code, out) == (2, "") and len(fake.requests) == asked
    assert (
        err
        == "error: --token goes after the command's name: faust -A app pause --token ... (--json is taken before it too)\n"
    )


async def test_a_reader_that_goes_away_is_not_an_error(fake: FakeWorker, tmp_path: Path) -> None:
    """``faust -A app backlog | head -1``: the pipe closes while the table is printed; no traceback, exit 0."""
    fake.answers["/retry/backlog"] = (200, BACKLOG)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REBOUND_")},
        "REBOUND_WEB_URL": fake.url,
        "REBOUND_DATA_DIR": str(tmp_path / "data"),
    }
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "faust",
        "-A",
        "app",
        "backlog",
        cwd=ROOT,
        env=env,
        stdout=write,
        stderr=asyncio.subprocess.PIPE,
    )
    os.close(write)
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_a_key_action_cut_short_does_not_read_as_done() -> None:
    """An operator's ``dead-letter`` refused partway (revoked, or the session lease lapsed): the first line says it
    is not complete and how many were not sent, before the table of those that were and the worker's warning."""
    body = {
        "action": "dead-letter",
        "key": "item-3",
        "count": 1,
        "results": [
            {
                "partition": 0,
                "messages": [{"origin": "items/0/7", "attempt": 1, "tier": "5m"}],
                "not_sent": [{"origin": "items/0/8", "attempt": 1, "tier": "5m"}],
                "incomplete": True,
                "warning": "partition revoked (or the session lease lapsed) after 1 of 2 dead letters; ...",
            }
        ],
    }
    lines = format_key_action("dead-letter", 200, body).splitlines()
    assert lines[0] == "dead-letter of key item-3: NOT COMPLETE (partition 0): 1 message(s) sent, 1 not sent; see below"
    assert lines[-1].startswith("partition 0: partition revoked")
    nothing = {
        "key": "item-3",
        "count": 0,
        "results": [{"partition": 0, "messages": [], "warning": "... nothing done"}],
    }
    assert format_key_action("dead-letter", 200, nothing).splitlines()[0] == (
        "dead-letter of key item-3: NOT COMPLETE (partition 0): 0 message(s) sent; see below"
    )
    assert format_key_action("retry-now", 200, nothing).splitlines()[0] == (
        "retry-now of key item-3: NOT COMPLETE (partition 0): 0 message(s) made due; see below"
    )


CUT_SHORT = {
    "partition": 0,
    "messages": [{"origin": "items/0/7", "attempt": 1, "tier": "5m"}],
    "not_sent": [{"origin": "items/0/8", "attempt": 1, "tier": "5m"}],
    "incomplete": True,
    "warning": "partition revoked (or the session lease lapsed) after 1 of 2 dead letters; ...",
}


async def test_a_dead_letter_not_complete_does_not_exit_as_done(fake: FakeWorker) -> None:
    """Review of 27a47d8: a dead-letter cut short printed NOT COMPLETE but exited 0, "done" for a script."""
    fake.answers["/retry/admin/keys/item-3/dead-letter"] = (200, {"key": "item-3", "count": 1, "results": [CUT_SHORT]})
    code, out, _ = await run(fake, "dead-letter", key="item-3")
    assert "NOT COMPLETE" in out
    assert code != 0, "exit code 0 ('done' in docs/operating.md) for a command the output says is not complete"


@pytest.mark.parametrize(
    "result",
    [
        CUT_SHORT,
        {"partition": 1, "messages": [], "warning": "partition not owned here (...): nothing done"},
        {"partition": 0, "messages": [], "not_sent": [{"origin": "items/0/7"}], "error": "RuntimeError('x')"},
    ],
    ids=["incomplete", "warning", "error"],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_a_key_action_not_complete_on_any_partition_exits_4(
    fake: FakeWorker, result: dict[str, Any], as_json: bool
) -> None:
    done = {"partition": 2, "messages": [{"origin": "items/2/1", "attempt": 1, "tier": "5m"}], "count": 1}
    body = {"key": "item-3", "count": 1, "results": [done, result]}
    fake.answers["/retry/admin/keys/item-3/dead-letter"] = (200, body)
    code, out, _ = await run(fake, "dead-letter", key="item-3", as_json=as_json)
    assert code == 4, out
    assert json.loads(out) == body if as_json else "NOT COMPLETE" in out.splitlines()[0]


NOT_CONFIRMED = {
    "dead-letter": ("/retry/admin/keys/item-3/dead-letter", {"key": "item-3", "count": 0, "results": [],
                    "accepted_not_confirmed": [{"id": "c1", "partition": 0}]}),
    "retry-now": ("/retry/admin/keys/item-3/retry-now", {"key": "item-3", "count": 0, "results": [],
                  "accepted_not_confirmed": [{"id": "c1", "partition": 0}]}),
    "pause": ("/retry/admin/pause", {"action": "pause", **BACKLOG["paused"], "confirmed": False}),
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(NOT_CONFIRMED))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_an_admin_action_sent_but_not_confirmed_exits_4(fake: FakeWorker, command: str, as_json: bool) -> None:
    """HTTP 202: the action was sent, but the worker did not see it applied within its wait (it may yet be refused, or
    overtaken): not "done" (0) for a script, which checks again (``key``, ``backlog``) as the output says."""
    path, body = NOT_CONFIRMED[command]
    fake.answers[path] = (202, body)
    code, out, _ = await run(fake, command, key="item-3", as_json=as_json)
    assert code == 4, out
    assert json.loads(out) == body if as_json else ("not confirmed" in out or "not applied it yet" in out)


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_a_key_action_done_on_every_partition_exits_0(fake: FakeWorker, as_json: bool) -> None:
    done = {"partition": 2, "messages": [{"origin": "items/2/1", "attempt": 1, "tier": "5m"}], "count": 1}
    fake.answers["/retry/admin/keys/item-3/dead-letter"] = (200, {"key": "item-3", "count": 1, "results": [done]})
    code, out, _ = await run(fake, "dead-letter", key="item-3", as_json=as_json)
    assert code == 0, out


REPORTED_KEY = b"retry-\xff\xfe"
REPORTED_NAME = "cmV0cnkt__4="  # its base64 (URL-safe alphabet)


def key_answer(key_text: str, key_base64: str) -> dict[str, Any]:
    return {"key": key_text, "key_base64": key_base64, "found": True, "worker": "w1", "attempts": 1, "pending": []}


async def test_key_commands_name_a_key_by_its_base64_and_print_it_back(fake: FakeWorker) -> None:
    fake.answers[f"/retry/keys/{REPORTED_NAME}"] = (200, key_answer("retry-\\xff\\xfe", REPORTED_NAME))
    code, out, err = await run(fake, "key", key=REPORTED_NAME, key_encoding="base64")
    assert (code, err) == (0, "")
    assert fake.requests[-1]["path"] == f"/retry/keys/{REPORTED_NAME}"
    assert fake.requests[-1]["query"] == {"key_encoding": "base64"}
    assert out.startswith(f"key retry-\\xff\\xfe (base64 {REPORTED_NAME}): 0 pending")

    # The key's raw bytes as a shell passes them (Python keeps the bytes that are not UTF-8 as lone surrogates).
    code, _, _ = await run(fake, "key", key=REPORTED_KEY.decode("utf-8", "surrogateescape"))
    assert code == 0 and fake.requests[-1]["query"] == {"key_encoding": "base64"}
    assert fake.requests[-1]["path"] == f"/retry/keys/{REPORTED_NAME}"

    schema_key = b"\x00\x00\x00\x00\x07item-42"  # UTF-8, but its control characters go as base64 too
    name = "AAAAAAdpdGVtLTQy"
    fake.answers[f"/retry/keys/{name}"] = (200, key_answer(schema_key.decode(), name))
    code, out, _ = await run(fake, "key", key=schema_key.decode())
    assert code == 0 and fake.requests[-1]["path"] == f"/retry/keys/{name}"
    assert out.startswith(f"key \\x00\\x00\\x00\\x00\\x07item-42 (base64 {name}): ")  # no raw NUL on the terminal

    for action in ("retry-now", "dead-letter"):
        answer = {"action": action, "key": "retry-\\xff\\xfe", "key_base64": REPORTED_NAME, "count": 1, "results": []}
        fake.answers[f"/retry/admin/keys/{REPORTED_NAME}/{action}"] = (200, answer)
        code, out, _ = await run(fake, action, key=REPORTED_NAME, key_encoding="base64")
        assert code == 0 and out.startswith(f"{action} of key retry-\\xff\\xfe (base64 {REPORTED_NAME}): 1 message(s)")
        assert fake.requests[-1]["method"] == "POST" and fake.requests[-1]["query"] == {"key_encoding": "base64"}
        assert fake.requests[-1]["authorization"] == "Bearer s3cret"


async def test_a_binary_key_with_nothing_pending_is_named_as_the_other_answers_name_it(fake: FakeWorker) -> None:
    """The one-line 404 of a key (s38-ux) merged with keys named by their bytes (s37): its text and base64, and the
    partition that answered when ``--partition`` routed the request."""
    fake.answers[f"/retry/keys/{REPORTED_NAME}"] = (404, {"key": "retry-\\xff\\xfe", "found": False, "worker": "w2"})
    code, out, err = await run(fake, "key", key=REPORTED_NAME, key_encoding="base64", partition=3)
    assert (code, out) == (1, "")
    assert fake.requests[-1]["query"] == {"key_encoding": "base64", "partition": "3"}
    assert err == (
        f"error: no retry state for key retry-\\xff\\xfe (base64 {REPORTED_NAME}): nothing pending or on its way to a tier"
        " (answered by w2, which owns partition 3)\n"
    )


async def test_a_text_key_is_sent_as_its_text_as_before(fake: FakeWorker) -> None:
    fake.answers["/retry/keys/a\\b"] = (200, {"key": "a\\b", "found": True, "pending": []})
    code, out, _ = await run(fake, "key", key="a\\b")
    assert code == 0 and fake.requests[-1]["path"] == "/retry/keys/a%5Cb" and fake.requests[-1]["query"] == {}
    assert out.startswith("key a\\b: 0 pending")


@pytest.mark.parametrize("as_json", [False, True])
async def test_a_key_argument_that_is_not_base64_is_a_usage_error_and_sends_nothing(
    fake: FakeWorker, as_json: bool
) -> None:
    code, out, err = await run(fake, "retry-now", key="not base64!", key_encoding="base64", as_json=as_json)
    assert code == 2 and "' ' is not a base64 character" in err
    assert fake.requests == []
    if as_json:
        assert json.loads(out)["status"] is None and "not base64" in json.loads(out)["error"]


@pytest.mark.parametrize("command", ["key", "retry-now", "dead-letter"])
@pytest.mark.parametrize("key_encoding", ["text", "base64"])
async def test_an_empty_key_is_a_usage_error_and_sends_nothing(
    fake: FakeWorker, command: str, key_encoding: str
) -> None:
    """Reported: ``faust -A app key ''`` printed a bare ``error: HTTP 404: Not Found`` (the request went to
    ``/retry/keys/``)."""
    code, out, err = await run(fake, command, key="", key_encoding=key_encoding)
    assert (code, out, err) == (2, "", "error: an empty key cannot be named (yet)\n")
    assert fake.requests == []


async def test_faust_takes_the_key_encoding_option_and_a_key_s_raw_bytes(fake: FakeWorker, tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REBOUND_")},
        "REBOUND_WEB_URL": fake.url,
        "REBOUND_DATA_DIR": str(tmp_path / "data"),
    }
    fake.answers[f"/retry/keys/{REPORTED_NAME}"] = (200, key_answer("retry-\\xff\\xfe", REPORTED_NAME))
    code, out, err = await faust_cli("key", "--key-encoding", "base64", REPORTED_NAME, env=env)
    assert code == 0, err
    assert out.startswith(f"key retry-\\xff\\xfe (base64 {REPORTED_NAME})")
    code, out, err = await faust_cli("key", os.fsdecode(REPORTED_KEY), env=env)  # the argument's bytes: ff fe
    assert code == 0, err
    assert [(r["path"], r["query"]) for r in fake.requests] == [
        (f"/retry/keys/{REPORTED_NAME}", {"key_encoding": "base64"})
    ] * 2


@pytest.mark.parametrize(("key", "name"), [(".", "Lg=="), ("..", "Li4=")])
async def test_a_key_that_is_a_dot_segment_is_sent_in_base64(fake: FakeWorker, key: str, name: str) -> None:
    """As a path segment, ``.`` and ``..`` are normalised away by the URL (``/retry/keys/..`` is ``/retry/``): the
    request would reach another path, or for an admin action another key's."""
    fake.answers[f"/retry/keys/{name}"] = (200, {"key": key, "key_base64": name, "found": True, "pending": []})
    code, _, err = await run(fake, "key", key=key)
    assert (code, err) == (0, "")
    assert (fake.requests[-1]["path"], fake.requests[-1]["query"]) == (
        f"/retry/keys/{name}",
        {"key_encoding": "base64"},
    )
    fake.answers[f"/retry/admin/keys/{name}/retry-now"] = (200, {"key": key, "count": 1, "results": []})
    code, _, err = await run(fake, "retry-now", key=key)
    assert (code, err) == (0, "")
    assert fake.requests[-1]["path"] == f"/retry/admin/keys/{name}/retry-now"
    assert fake.requests[-1]["query"] == {"key_encoding": "base64"}


async def test_key_commands_take_the_partition_to_route_to(fake: FakeWorker) -> None:
    """``--partition N``: a key placed by a producer whose partitioner is not murmur2 (librdkafka's default)."""
    fake.answers["/retry/keys/item-42"] = (200, {"key": "item-42", "found": True, "pending": []})
    code, _, err = await run(fake, "key", key="item-42", partition=3)
    assert (code, err) == (0, "") and fake.requests[-1]["query"] == {"partition": "3"}
    fake.answers[f"/retry/admin/keys/{REPORTED_NAME}/dead-letter"] = (200, {"key": "k", "count": 1, "results": []})
    code, _, err = await run(fake, "dead-letter", key=REPORTED_NAME, key_encoding="base64", partition=0)
    assert (code, err) == (0, "")
    assert fake.requests[-1]["query"] == {"key_encoding": "base64", "partition": "0"}
    code, _, _ = await run(fake, "retry-now", key="item-42")
    assert "partition" not in fake.requests[-1]["query"]  # not given: routed by the key's bytes


async def test_faust_takes_the_partition_option_and_refuses_a_negative_one(fake: FakeWorker, tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REBOUND_")},
        "REBOUND_WEB_URL": fake.url,
        "REBOUND_DATA_DIR": str(tmp_path / "data"),
    }
    fake.answers["/retry/keys/item-42"] = (200, {"key": "item-42", "found": True, "pending": []})
    code, _, err = await faust_cli("key", "--partition", "2", "item-42", env=env)
    assert code == 0, err
    assert [(r["path"], r["query"]) for r in fake.requests] == [("/retry/keys/item-42", {"partition": "2"})]
    code, _, err = await faust_cli("key", "--partition", "-1", "item-42", env=env)
    assert code == 2 and "--partition" in err and len(fake.requests) == 1  # a usage error: nothing sent


async def test_a_dotenv_file_that_is_not_utf8_is_one_line_and_exit_78(tmp_path: Path) -> None:
    """Review: the command line read ``.env`` with its own parser, and a file in Latin-1 ended in a traceback
    (``UnicodeDecodeError``); the worker says it in one line with exit 78, and so does the command line now."""
    (tmp_path / ".env").write_bytes(b"REBOUND_APP_ID=caf\xe9\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REBOUND_")},
        "PYTHONPATH": str(ROOT),
    }
    code, out, err = await faust_cli("backlog", env=env, cwd=tmp_path)
    assert code == 78, (out, err)
    lines = err.splitlines()
    assert lines == [f"error: {tmp_path / '.env'} is not UTF-8 text (byte 0xe9 on line 1): save it as UTF-8"], lines
