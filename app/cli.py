"""Operating from the command line: ``faust -A app <command>`` against a running worker's web API.

Commands: ``backlog``, ``key <key>``, ``failed``, ``retry-now <key>``, ``dead-letter <key>``, ``pause``, ``resume``,
``replay <topic> <partition> <offset>``. A key is its text, or with ``--key-encoding base64`` the base64 of its bytes (a
key that is not UTF-8, holds control characters, or is ``.`` or ``..`` is sent in base64 either way). Each makes one
HTTP request (``app/api_client.py``) and prints plain aligned columns, or the worker's JSON with ``--json``. Exit
codes: 0 done, 1 the worker answered with an error, 2 a usage error (or no admin token for an admin command), 3 no
worker answered, 4 an admin action not known to be done: a key action not complete on some partition, or any admin
action answered 202 (:data:`NOT_COMPLETE`).

``faust -A app`` imports the app module, and building the real app provisions topics on the broker and registers the
agents. For these commands that is neither needed nor wanted (they must work from an operator's laptop, with no
broker in reach, next to a running worker without becoming a second one): when the command line names one of them
(or no command at all, or ``--help`` anywhere: ``faust -A app worker --help`` only prints the worker's options),
``app.app`` is a bare Faust app that carries only the commands (:func:`cli_app`). Any other command (``worker`` first
of all) gets the real app, with these commands registered too.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar, NoReturn

from app.api_client import ApiClient, ApiError, BadKeyName, ClientError, default_base_url, environment
from app.startup import EX_CONFIG
from rebound.display import key_label, utc_time
from rebound.errors import ConfigurationError
from rebound.key_names import KEY_ENCODINGS, TEXT, KeyNameError, key_of_name

COMMANDS = ("backlog", "key", "failed", "retry-now", "dead-letter", "pause", "resume", "replay")
SHARED_OPTIONS = ("--url", "--token", "--operator", "--timeout")
"""The options every command takes, each with a value. They go after the command's name: Faust's command line parses
what comes before it with its own options (``--json`` is one of them: it is taken in both places) before it imports
the app that registers the commands, so it cannot take them there (:func:`misplaced_options`)."""
# Options that take a value (``faust -A app -l info worker``): skipped when finding the command's name. Faust's root
# options, and Rebound's shared ones (only ever misplaced there, but the command is still the word after the value).
_VALUE_OPTIONS = frozenset(
    {"-A", "--app", "-W", "--workdir", "-D", "--datadir", "-L", "--loop", "-f", "--logfile", "-l", "--loglevel"}
    | {"--blocking-timeout", "--console-port", *SHARED_OPTIONS}
)
NOT_COMPLETE = 4
"""The exit code of an admin action the worker answered, but not with "done": a ``retry-now`` or ``dead-letter``
whose answer has a partition's result refused partway, warned or failed (:func:`not_complete`), or any admin action
answered 202 (sent, not confirmed within the worker's wait)."""
_light_app: Any = None
_registered = False


# ---------------------------------------------------------------------------------------------------- which app


def is_faust_cli(argv: Sequence[str]) -> bool:
    """Whether this process is Faust's command line (``faust ...`` or ``python -m faust ...``)."""
    if not argv:
        return False
    program = Path(argv[0])
    return program.name == "faust" or (program.name == "__main__.py" and program.parent.name == "faust")


def requested_command(argv: Sequence[str]) -> str | None:
    """The sub-command Faust's command line will run: the first word that is neither an option nor its value."""
    skip = False
    for word in argv[1:]:
        if skip:
            skip = False
            continue
        if word == "--":
            return None
        if word.startswith("-"):
            skip = word in _VALUE_OPTIONS
            continue
        return word
    return None


def misplaced_options(argv: Sequence[str]) -> list[str]:
    """Rebound's shared options given before the command's name (``faust -A app --token X pause``), which Faust's
    command line refuses (:data:`SHARED_OPTIONS`)."""
    found: list[str] = []
    skip = False
    for word in argv[1:]:
        if skip:
            skip = False
            continue
        if word == "--" or not word.startswith("-"):  # the command's name (or the end of the options)
            break
        if word.partition("=")[0] in SHARED_OPTIONS:
            found.append(word.partition("=")[0])
        skip = word in _VALUE_OPTIONS  # (``--token=X`` carries its value)
    return found


def refuse_misplaced_options(argv: Sequence[str], err: IO[str] | None = None) -> None:
    """Exit with a one-line usage error (status 2) when :func:`misplaced_options` finds any, saying where they go:
    Faust's own message would be a usage screen ending in ``No such option``, after building the worker's app."""
    misplaced = misplaced_options(argv)
    if not misplaced:
        return
    command = requested_command(argv) or "<command>"
    names = " ".join(f"{name} ..." for name in misplaced)
    print(
        f"error: {', '.join(misplaced)} {'goes' if len(misplaced) == 1 else 'go'} after the command's name: "
        f"faust -A app {command} {names} (--json is taken before it too)",
        file=err or sys.stderr,
        flush=True,
    )
    raise SystemExit(2)


def asks_for_help(argv: Sequence[str]) -> bool:
    """Whether the command line only asks for help (``faust -A app worker --help``): no command runs then."""
    words = list(argv[1:])
    return "--help" in (words[: words.index("--")] if "--" in words else words)


def cli_app(argv: Sequence[str] | None = None) -> Any:
    """The bare app for Rebound's commands, or None when the command line runs anything else."""
    global _light_app  # noqa: PLW0603 - one per process, as ``app.app`` is
    argv = sys.argv if argv is None else argv
    if not is_faust_cli(argv):
        return None
    if requested_command(argv) in (*COMMANDS, None):
        refuse_misplaced_options(argv)
    elif not asks_for_help(argv):
        return None
    if _light_app is None:
        import faust

        # No broker is contacted: a Faust app connects only when it is started, and commands never start it.
        _light_app = faust.App("rebound-cli", autodiscover=False, env={}, web_enabled=False)
        register_commands(_light_app)
    return _light_app


# ---------------------------------------------------------------------------------------------------- formatting


def duration(ms: float | None) -> str:
    """``850ms``, ``12s``, ``4m12s``, ``3h02m``, ``2d03h``; ``-`` for none."""
    if ms is None:
        return "-"
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def when(ms: int | None) -> str:
    if not ms:
        return "-"
    return utc_time(ms)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain aligned columns: numbers right-aligned, text left-aligned, the last column not padded."""
    cells = [[("-" if value is None else str(value)) for value in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)]
    numeric = [all(isinstance(row[i], int | float) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str], numbers: Sequence[bool]) -> str:
        parts = [
            value.rjust(widths[i]) if numbers[i] else (value if i == len(values) - 1 else value.ljust(widths[i]))
            for i, value in enumerate(values)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers), numeric), *(line(row, numeric) for row in cells)])


def _short(text: Any, limit: int = 60) -> str:
    value = "" if text is None else " ".join(str(text).split())
    return value if len(value) <= limit else value[: limit - 1] + "…"


def format_pause(paused: Mapping[str, Any] | None, *, breakers: Sequence[str] = (), everywhere: bool = True) -> str:
    """The main topics' first line: the operator's pause, and ``breakers`` (``worker (state)``) holding them too: a
    circuit breaker not closed on those workers (``everywhere``: on every worker reporting)."""
    if not paused:
        return "main topics: pause state unknown (the worker predates pause/resume)"
    topics = ",".join(paused.get("topics") or []) or "main topics"
    if not paused.get("known", True):
        failing = int(paused.get("reader_failures") or 0)
        text = f"main topics {topics}: pause state not read yet: first tries held"
        return text + (f" (the control reader failed {failing} time(s): see the worker's log)" if failing else "")
    who = f"by {paused.get('by') or '?'} from {paused.get('source') or '?'} at {when(paused.get('at'))}"
    held = ", ".join(breakers)
    if paused.get("paused"):
        released = "retries are still released" + (f", not on {held}: held by the circuit breaker" if held else "")
        text = f"main topics {topics}: PAUSED {who} (first tries wait; {released})"
    elif held:
        elsewhere = "" if everywhere else ", fetched on the other worker(s)"
        since = f"resumed {who}" if paused.get("at") else "never paused by an operator"
        text = f"main topics {topics}: held by the circuit breaker on {held}{elsewhere} ({since})"
    elif paused.get("at"):
        text = f"main topics {topics}: fetched (resumed {who})"
    else:
        text = f"main topics {topics}: fetched (never paused)"
    return text


def breakers_holding(body: Mapping[str, Any]) -> tuple[list[str], bool]:
    """The workers of a backlog answer whose circuit breaker holds the main topics (not closed), as
    ``worker (state)``, and whether that is every worker reporting."""
    breakers = dict(body.get("breakers") or {})
    if body.get("breaker"):
        breakers["this worker"] = body["breaker"]
    held = [
        f"{worker} ({snapshot.get('state')})"
        for worker, snapshot in sorted(breakers.items())
        if snapshot and snapshot.get("state") not in (None, "closed")
    ]
    reporting = 1 if body.get("scope") == "worker" else len(body.get("workers") or [])
    return held, len(held) >= reporting


def format_backlog(body: Mapping[str, Any]) -> str:
    held, everywhere = breakers_holding(body)
    lines = [format_pause(body.get("paused"), breakers=held, everywhere=everywhere)]
    if body.get("pause_state_unknown"):
        unknown = ", ".join(body["pause_state_unknown"])
        lines.append(f"workers that have not read the pause state yet (first tries held there): {unknown}")
    if body.get("scope") == "worker":
        lines.append(f"this worker only: partitions {_numbers(body.get('owned_partitions'))}")
    else:
        workers = body.get("workers") or []
        stale = body.get("stale_workers") or []
        lines.append(
            f"workers: {len(workers)} reporting, {len(stale)} stale; "
            f"partitions missing: {_numbers(body.get('partitions_missing'))}"
        )
    rows = [
        (
            name,
            int(stats.get("waiting") or 0),
            int(stats.get("overdue") or 0),
            duration(stats.get("max_overdue_ms")) if stats.get("overdue") else "-",
            duration(stats.get("next_release_in_ms")) if stats.get("next_release_in_ms") is not None else "-",
            duration(stats.get("oldest_age_ms")) if stats.get("oldest_age_ms") is not None else "-",
        )
        for name, stats in (body.get("tiers") or {}).items()  # in the worker's order: the policy's
    ]
    lines.append(table(("TIER", "WAITING", "OVERDUE", "MAX OVERDUE", "NEXT RELEASE IN", "OLDEST"), rows))
    ordering = body.get("ordering") or {}
    if ordering.get("mode") == "key":
        lines.append(f"key order: {ordering.get('blocked_keys', 0)} blocked key(s), {ordering.get('held', 0)} held")
    breakers = dict(body.get("breakers") or {})
    if body.get("breaker"):
        breakers["this worker"] = body["breaker"]
    for worker, snapshot in sorted(breakers.items()):
        if snapshot:
            lines.append(f"circuit breaker {worker}: {snapshot.get('state')}")
    return "\n".join(lines)


def _numbers(values: Any) -> str:
    return ",".join(str(v) for v in values) if values else "-"


def _messages_table(messages: Sequence[Mapping[str, Any]], now_ms: int, *, error: bool = True) -> str:
    rows = []
    for message in messages:
        due = message.get("due_at")
        due_text = when(due) if due is None or due > now_ms else f"{when(due)} (due)"
        row: list[Any] = [message.get("origin"), message.get("attempt"), message.get("tier") or "-", due_text]
        if error:
            kind, text = message.get("error_class"), message.get("error_message")
            row.append(_short(f"{kind}: {text}" if kind else text or ""))
        rows.append(row)
    headers = ["ORIGIN", "ATTEMPT", "TIER", "DUE"] + (["LAST ERROR"] if error else [])
    return table(headers, rows)


def answer_key(body: Mapping[str, Any]) -> str:
    """The key of an answer as printed: its text, and for a key the text does not name (``key_base64`` given) the
    text with control characters escaped and the base64 to pass back with ``--key-encoding base64``."""
    text = "" if body.get("key") is None else str(body.get("key"))
    named = body.get("key_base64")
    return key_label(text, str(named)) if named else text


def format_key(body: Mapping[str, Any]) -> str:
    now = int(time.time() * 1000)
    pending = body.get("pending") or []
    moving = body.get("on_its_way") or []
    lines = [
        f"key {answer_key(body)}: {len(pending)} pending, {body.get('attempts', 0)} attempt(s), "
        f"next due {when(body.get('next_due'))}{f', {len(moving)} on its way' if moving else ''}  "
        f"(worker {body.get('worker') or '?'})"
    ]
    if pending:
        lines.append(_messages_table(pending, now))
    lines += [on_its_way_line(message) for message in moving]
    if body.get("blocked"):
        lines.append(f"blocked by {body.get('blocked_by') or '?'}; held: {len(body.get('held') or [])}")
    return "\n".join(lines)


def on_its_way_line(message: Mapping[str, Any]) -> str:
    """One message of the key view's ``on_its_way``: its retry sent (or about to be) to its tier, not parked yet."""
    ago = duration(message.get("since_ms"))
    how = f"forwarded {ago} ago" if message.get("state") == "forwarded" else f"being sent, marked {ago} ago"
    return f"on its way to its tier: {message.get('origin')} attempt {message.get('attempt')} ({how})"


def format_failed(body: Mapping[str, Any], *, latest: int = 5) -> str:
    topics = body.get("topics") or {}
    rows = [
        (
            name,
            int(info.get("depth") or 0),
            _short(", ".join(f"{reason} {count}" for reason, count in (info.get("by_reason") or {}).items()), 50)
            or "-",
            when(info.get("newest_record")),
        )
        for name, info in sorted(topics.items())
    ]
    lines = [table(("TOPIC", "DEPTH", "REASONS", "NEWEST"), rows)]
    if body.get("caught_up") is False:
        lines.append("(counts still partial: the worker has not read the failed topics to their end yet)")
    for name, info in sorted(topics.items()):
        records = (info.get("latest") or [])[:latest]
        if not records:
            continue
        lines.append(f"\nlatest on {name} (replay one with: faust -A app replay {name} <partition> <offset>):")
        lines.append(
            table(
                ("PARTITION", "OFFSET", "KEY", "REASON", "ERROR"),
                [
                    (
                        int(record.get("partition") or 0),
                        int(record.get("offset") or 0),
                        _short(record.get("key"), 30) or "-",
                        (record.get("headers") or {}).get("rebound.reason") or "-",
                        _short((record.get("headers") or {}).get("rebound.error-class"), 40) or "-",
                    )
                    for record in records
                ],
            )
        )
    return "\n".join(lines)


def not_complete(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A key action's partition results refused (partway or before anything), warned or failed: not done."""
    return [r for r in body.get("results") or [] if r.get("incomplete") or r.get("warning") or r.get("error")]


def format_key_action(action: str, status: int, body: Mapping[str, Any]) -> str:
    now = int(time.time() * 1000)
    messages = [message for result in body.get("results") or [] for message in result.get("messages") or []]
    head = f"{action} of key {answer_key(body)}: {body.get('count', 0)} message(s)"
    cut = not_complete(body)
    if cut:  # refused or failed on a partition (the worker's words below): not to be read as done
        not_sent = sum(len(r.get("not_sent") or []) for r in cut)
        done = "sent" if action == "dead-letter" else "made due"  # (a dead letter sent may still be parked: below)
        head = (
            f"{action} of key {answer_key(body)}: NOT COMPLETE (partition {', '.join(str(r.get('partition')) for r in cut)}"
            f"): {body.get('count', 0)} message(s) {done}{f', {not_sent} not sent' if not_sent else ''}; see below"
        )
    lines = [head]
    if messages:
        lines.append(_messages_table(messages, now, error=False))
    for result in body.get("results") or []:
        if result.get("error"):
            lines.append(f"partition {result.get('partition')}: failed: {result['error']}")
        if result.get("warning"):
            lines.append(f"partition {result.get('partition')}: {result['warning']}")
        if result.get("held_released"):
            lines.append(f"{result['held_released']} held message(s) released")
    if status == 202 or body.get("accepted_not_confirmed"):
        lines.append("sent, but not confirmed within the worker's wait: check again with `key`")
    return "\n".join(lines)


def format_pause_action(status: int, body: Mapping[str, Any]) -> str:
    text = format_pause(body)
    if status == 202 or body.get("confirmed") is False:
        text += "\n(written; the worker that answered had not applied it yet: each worker applies it as it reads it)"
    return text


def format_replay(body: Mapping[str, Any]) -> str:
    failed, target = body.get("failed") or {}, body.get("target") or {}
    return (
        f"replayed {failed.get('topic')} partition {failed.get('partition')} offset {failed.get('offset')} -> "
        f"{target.get('topic')} partition {target.get('partition')} offset {target.get('offset')} "
        f"(key {body.get('key')!r}, was {body.get('reason')}, redrive-count {body.get('redrive_count')} "
        f"of at most {body.get('max_redrives')})"
    )


# ---------------------------------------------------------------------------------------------------- running


async def run_command(
    command: str,
    *,
    client: ApiClient,
    as_json: bool = False,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    key: str | None = None,
    key_encoding: str = TEXT,
    topic: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    max_redrives: int | None = None,
    force_other_group: bool = False,
    worker_only: bool = False,
    limit: int | None = None,
    latest: int = 5,
) -> int:
    """Run one command against ``client``; prints the result (or the error) and returns the exit code.

    ``key`` is the key's text (its UTF-8 bytes; an argument's bytes that are not UTF-8 stay those bytes) or, with
    ``key_encoding="base64"``, the base64 of its bytes (``rebound/key_names.py``). ``partition`` is replay's argument,
    or for a key command the main topics' partition to route to (``--partition``; None: by the key's hash)."""
    out = out or sys.stdout
    err = err or sys.stderr

    def named() -> bytes:
        if not key:  # the path's segment would be empty: another view (a 404), or no key at all
            raise BadKeyName("an empty key cannot be named (yet)")
        try:
            return key_of_name(str(key), key_encoding)
        except KeyNameError as exc:
            raise BadKeyName(str(exc)) from exc

    calls: dict[str, Callable[[], Awaitable[tuple[int, Any]]]] = {
        "backlog": lambda: client.backlog(worker_only=worker_only),
        "key": lambda: client.key(named(), partition=partition),
        "failed": lambda: client.failed(limit=limit),
        "retry-now": lambda: client.key_action("retry-now", named(), partition=partition),
        "dead-letter": lambda: client.key_action("dead-letter", named(), partition=partition),
        "pause": lambda: client.pause(paused=True),
        "resume": lambda: client.pause(paused=False),
        "replay": lambda: client.replay(
            str(topic),
            int(partition or 0),
            int(offset or 0),
            max_redrives=max_redrives,
            force_other_group=force_other_group,
        ),
    }
    try:
        status, body = await calls[command]()
    except ClientError as exc:
        if as_json:
            detail = exc.body if isinstance(exc, ApiError) and isinstance(exc.body, dict) else {}
            status_code = exc.status if isinstance(exc, ApiError) else None
            print(json.dumps({"error": str(exc), **detail, "status": status_code}, sort_keys=True), file=out)
        print(terminal_safe(f"error: {exc}"), file=err)
        if isinstance(exc, ApiError) and isinstance(exc.body, dict) and exc.body.get("overtaken"):
            print(terminal_safe(f"now: {format_pause(exc.body.get('state'))}"), file=err)
        return exc.exit_code
    unfinished = status == 202 or (command in ("retry-now", "dead-letter") and not_complete(body))
    code = NOT_COMPLETE if unfinished else 0
    if as_json:
        print(json.dumps(body, indent=2), file=out)  # as the worker answered: its order (the tiers by delay)
        return code
    if command == "backlog":
        text = format_backlog(body)
    elif command == "key":
        text = format_key(body)
    elif command == "failed":
        text = format_failed(body, latest=latest)
    elif command in ("retry-now", "dead-letter"):
        text = format_key_action(command, status, body)
    elif command in ("pause", "resume"):
        text = format_pause_action(status, body)
    else:
        text = format_replay(body)
    print(terminal_safe(text), file=out)
    return code


_TERMINAL_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0)) if code != 0x0A}


def terminal_safe(text: str) -> str:
    """``text`` with every control character but the line breaks the tables are made of escaped (``\\x1b``, a tab
    ``\\x09``): keys, topic names and error messages come from records anyone can produce, and an escape sequence in
    one would recolour or rewrite the operator's terminal, a tab break the columns. (``--json`` prints JSON, whose
    strings escape them already.)"""
    return text.translate(_TERMINAL_ESCAPES)


def make_client(
    url: str | None, token: str | None, operator: str | None, timeout: float, env: Mapping[str, str] | None = None
) -> ApiClient:
    values = environment() if env is None else dict(env)
    return ApiClient(
        base_url=(url or default_base_url(values)).rstrip("/"),
        token=token or values.get("REBOUND_ADMIN_TOKEN") or None,
        operator=operator,
        timeout_s=timeout,
    )


# ---------------------------------------------------------------------------------------------------- Faust


def register_commands(app: Any) -> None:
    """Register the commands with Faust's command line (``@app.command``); once per process (Faust's command line is
    one click group, whatever the app)."""
    global _registered  # noqa: PLW0603
    if _registered:
        return
    _registered = True
    import click
    from faust.cli import AppCommand

    class ReboundCommand(AppCommand):
        """Runs without starting a Faust worker (Faust's commands run inside one): one HTTP request, an exit code."""

        abstract: ClassVar[bool] = True

        def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
            options = {**self.kwargs, **kwargs}
            try:
                code = asyncio.run(self.run(*self.args, *args, **options))
            except ConfigurationError as exc:  # (a .env file that cannot be read): one line, as the worker says it
                print(f"error: {terminal_safe(str(exc))}", file=sys.stderr)
                code = EX_CONFIG
            except BrokenPipeError:
                # The reader went away (``faust -A app failed | head``): what it wanted was printed. Point stdout at
                # /dev/null so the interpreter's own flush at exit does not raise again.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                code = 0
            raise SystemExit(code)

        async def rebound(self, command: str, options: dict[str, Any]) -> int:
            client = make_client(
                options.pop("url"), options.pop("token"), options.pop("operator"), options.pop("timeout")
            )
            as_json = bool(options.pop("as_json") or getattr(self, "json", False))
            return await run_command(command, client=client, as_json=as_json, **options)

    def command(*options: Any) -> Callable[[Callable[..., Awaitable[int]]], Any]:
        """``@app.command`` with Rebound's base class (typed, for mypy)."""
        decorator: Callable[[Callable[..., Awaitable[int]]], Any] = app.command(*options, base=ReboundCommand)
        return decorator

    common = [
        click.option(
            "--url", default=None, help="worker web URL (default: $REBOUND_WEB_URL, else REBOUND_WEB_HOST/PORT)"
        ),
        click.option("--token", default=None, help="admin token (default: $REBOUND_ADMIN_TOKEN)"),
        click.option("--operator", default=None, help="who you are, for the audit log (default: user@host)"),
        click.option("--timeout", type=float, default=30.0, show_default=True, help="seconds to wait for the answer"),
        click.option("--json", "as_json", is_flag=True, default=False, help="print the worker's JSON answer"),
    ]
    key_options = [
        click.argument("key"),
        *common,
        click.option(
            "--key-encoding",
            type=click.Choice(KEY_ENCODINGS),
            default=TEXT,
            show_default=True,
            help="how KEY is written: text (its bytes as given), or base64 of its bytes (a view's key_base64)",
        ),
        click.option(
            "--partition",
            type=click.IntRange(min=0),
            default=None,
            help="the main topics' partition holding KEY: ask its owner (a producer not partitioning by murmur2)",
        ),
    ]

    @command(
        *common,
        click.option("--worker", "worker_only", is_flag=True, help="this worker's partitions only"),
    )
    async def backlog(self: ReboundCommand, **options: Any) -> int:
        """Retry backlog per tier, cluster-wide, and whether the main topics are paused."""
        return await self.rebound("backlog", options)

    @command(*key_options)
    async def key(self: ReboundCommand, **options: Any) -> int:
        """A key's pending messages (attempt, tier, due time, last error) and those on their way to a tier."""
        return await self.rebound("key", options)

    @command(
        *common,
        click.option("--limit", type=int, default=None, help="records the worker reads at most for this answer"),
        click.option("--latest", type=int, default=5, show_default=True, help="latest records listed per topic"),
    )
    async def failed(self: ReboundCommand, **options: Any) -> int:
        """Failed topics: depth, counts by reason, the latest records (partition and offset, for replay)."""
        return await self.rebound("failed", options)

    @command(*key_options)
    async def retry_now(self: ReboundCommand, **options: Any) -> int:
        """Admin: a key's pending messages become due now (attempt numbers unchanged)."""
        return await self.rebound("retry-now", options)

    @command(*key_options)
    async def dead_letter(self: ReboundCommand, **options: Any) -> int:
        """Admin: move a key's pending messages to their failed topic (reason admin)."""
        return await self.rebound("dead-letter", options)

    @command(*common)
    async def pause(self: ReboundCommand, **options: Any) -> int:
        """Admin: pause the main topics on every worker (retries are still released)."""
        return await self.rebound("pause", options)

    @command(*common)
    async def resume(self: ReboundCommand, **options: Any) -> int:
        """Admin: fetch the main topics again on every worker."""
        return await self.rebound("resume", options)

    @command(
        click.argument("topic"),
        click.argument("partition", type=int),
        click.argument("offset", type=int),
        *common,
        click.option("--max-redrives", type=int, default=None, help="refuse a record redriven this many times (<= 3)"),
        click.option(
            "--force-other-group",
            is_flag=True,
            default=False,
            help="replay a dead letter of another consumer group too (every group reading the main topic gets it)",
        ),
    )
    async def replay(self: ReboundCommand, **options: Any) -> int:
        """Admin: send one failed record back to its main topic (redrive-count + 1)."""
        return await self.rebound("replay", options)
