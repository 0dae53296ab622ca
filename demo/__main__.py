"""``make demo``: the update-before-create scenario on the embedded broker, printed attempt by attempt.

Plays DESIGN.md section 3 with short delays (1s,1s,2s): an update whose create comes late (retried, then succeeds),
a normal create and update, a malformed event (dead-lettered at once) and an update whose create never comes
(every tier, then ``items.failed``). Stops by itself when every item reached its end, unless ``--keep-running``.

Its files (the worker's data directory and log, the handler's SQLite file) are in a ``rebound-demo-*`` directory of
the system's temporary directory, removed when the demo ends, by itself or interrupted (Ctrl-C, SIGTERM); kept with
``--keep-files``, or when the scenario did not finish (the worker log says why: its path is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from demo.embedded_broker import EmbeddedBroker, start_broker
from demo.harness import Record, Tail, Worker, create_topics, produce, worker_env

SEQUENCE = "1s,1s,2s"
HANDLER = "demo.handler:handle"  # REBOUND_HANDLER has no default: the demo names its own, as a deployment does
DONE_OUTCOMES = {"succeeded", "dead", "expired"}


def event(kind: str, item_id: str, **fields: object) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return item_id.encode(), json.dumps({"type": kind, "id": item_id, **fields}).encode(), []


SCENARIO = [
    event("UpdateItem", "item-1", price=12.5),  # its create arrives only after the first retry failed
    event("CreateItem", "item-2", name="kettle", price=30),
    event("UpdateItem", "item-2", price=28),
    (b"item-3", b'{"type": "CreateItem", "id": "item-3", "name": ', [("source", b"legacy-importer")]),
    event("UpdateItem", "item-4", price=1),  # its create never comes
]
EXPECTED_END = {
    (b"item-1", "UpdateItem"): "succeeded",
    (b"item-1", "CreateItem"): "succeeded",
    (b"item-2", "CreateItem"): "succeeded",
    (b"item-2", "UpdateItem"): "succeeded",
    (b"item-3", None): "dead",
    (b"item-4", "UpdateItem"): "dead",
}


def describe(record: Record, started: float, kinds: dict[tuple[str, int, int], str | None]) -> str:
    data = record.json()
    kind = kinds.get((data["original_topic"], data["original_partition"], data["original_offset"])) or "?"
    tier = data["tier"] or "main"
    outcome = data["outcome"]
    detail = ""
    if outcome == "scheduled":
        detail = f"-> retry {data['attempt'] + 1} in tier {data['next_tier']} (due in {data['due_at'] - data['event_time']} ms)"
    elif outcome in {"dead", "expired"}:
        detail = f"-> items.failed, reason {data['reason']}"
    if data.get("error_message"):
        detail += f"  [{data['error_class'].rsplit('.', 1)[-1]}: {data['error_message'][:60]}]"
    return (
        f"{data['event_time'] / 1000 - started:7.2f}s  {data['key']:<7} {kind:<11} attempt {data['attempt']}  "
        f"{tier:<5} {outcome:<9} {detail}"
    )


def operator_hints(web_port: int, token: str) -> str:
    url = f"http://127.0.0.1:{web_port}"
    return f"""
still running (Ctrl-C to stop), with a trickle of new items so the charts move: about one a second, most created
a few seconds after their first update (retried, then succeeded), every seventh a malformed event (items.failed).

  dashboard:  {url}/dashboard/
  from another terminal, in this directory:
    export REBOUND_WEB_URL={url} REBOUND_ADMIN_TOKEN={token}
    .venv/bin/faust -A app backlog
    .venv/bin/faust -A app pause          # first tries stop on every worker; retries are still released
    .venv/bin/faust -A app resume
    .venv/bin/faust -A app failed         # the latest failed records, with partition and offset
    .venv/bin/faust -A app replay items.failed <partition> <offset>
"""


async def trickle(bootstrap: str, worker: Worker, *, period_s: float = 1.0, create_after_s: float = 2.5) -> None:
    """Produce a little live traffic until the worker stops: an update whose create follows ``create_after_s`` later
    (a retry or two, then success), and every seventh item a malformed event (dead-lettered at once)."""
    creates: list[tuple[float, str]] = []
    number = 0
    while worker.process is not None and worker.process.poll() is None:
        number += 1
        item = f"live-{number}"
        batch = [event("UpdateItem", item, price=number)]
        if number % 7 == 0:
            batch.append((f"live-bad-{number}".encode(), b'{"type": "CreateItem", "id": ', []))
        now = time.time()
        creates.append((now + create_after_s, item))
        batch += [event("CreateItem", due, name="gadget") for at, due in creates if at <= now]
        creates = [(at, due) for at, due in creates if at > now]
        await produce(bootstrap, "items", batch)
        await asyncio.sleep(period_s)


class DemoFiles:
    """The demo's temporary directory: removed by :meth:`close` unless ``keep`` or ``failed``."""

    def __init__(self, *, keep: bool = False) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="rebound-demo-"))
        self.keep = keep
        self.failed = False

    def close(self) -> None:
        if self.keep or self.failed:
            why = "--keep-files" if self.keep else "the demo did not finish"
            print(f"kept {self.path} ({why}): the worker log is {self.path / 'worker.log'}", file=sys.stderr)
            return
        shutil.rmtree(self.path, ignore_errors=True)


def stop_on_signals() -> None:
    """SIGTERM or SIGHUP cancel the demo like Ctrl-C does, so its ``finally`` stops the worker and the broker.

    Both run in sessions of their own (a signal to the demo's process group does not reach them), so without this a
    ``kill`` of ``--keep-running`` would leave them running.
    """
    task = asyncio.current_task()
    if task is None:
        return
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(number, task.cancel)


@contextlib.contextmanager
def demo_files(keep: bool) -> Iterator[DemoFiles]:
    """The demo's files for the ``with`` block: removed at its end unless kept, or the block failed (an exception;
    an interruption, Ctrl-C or SIGTERM, is a cancellation and removes them)."""
    files = DemoFiles(keep=keep)
    try:
        yield files
    except Exception:
        files.failed = True
        raise
    finally:
        files.close()


async def play(keep_running: bool, timeout: float, keep_files: bool = False) -> int:
    stop_on_signals()
    broker = start_broker()
    try:
        with demo_files(keep_files) as files:
            code = await play_scenario(broker, files.path, keep_running, timeout)
            files.failed = code != 0
            return code
    finally:
        broker.stop()


async def play_scenario(broker: EmbeddedBroker, workdir: Path, keep_running: bool, timeout: float) -> int:
    # Admin actions (pause, resume, replay, dead-letter) need a token: the caller's, or one made for this demo.
    token = os.environ.get("REBOUND_ADMIN_TOKEN") or secrets.token_urlsafe(12)
    worker = Worker(
        worker_env(
            broker.url,
            workdir / "data",
            REBOUND_HANDLER=HANDLER,
            REBOUND_ADMIN_TOKEN=token,
            REBOUND_RETRY_SEQUENCE=SEQUENCE,
            REBOUND_DEMO_DB=str(workdir / "items.db"),
            REBOUND_LOG_LEVEL="warn",
        ),
        workdir / "worker.log",
    )
    print(f"embedded broker: {broker.url}   retry sequence: {SEQUENCE}   worker log: {worker.log_path}")
    try:
        await create_topics(broker.bootstrap, ["items"], partitions=4)
        worker.start()
        print(f"worker started (web on http://127.0.0.1:{worker.web_port}/retry/backlog); producing the scenario\n")
        started = time.time()
        sent = await produce(broker.bootstrap, "items", SCENARIO)
        kinds: dict[tuple[str, int, int], str | None] = {}
        for (_, value, _), meta in zip(SCENARIO, sent, strict=True):
            try:
                kinds[("items", meta.partition, meta.offset)] = json.loads(value)["type"]
            except ValueError:
                kinds[("items", meta.partition, meta.offset)] = None
        ends: dict[tuple[bytes, str | None], str] = {}
        create_sent = False

        async def on_record(record: Record) -> None:
            nonlocal create_sent
            if record.topic == "items.failed":
                print(
                    f"{' ' * 9}items.failed <- {record.key.decode() if record.key else None}: "
                    f"reason={record.headers['rebound.reason'].decode()} "
                    f"attempt={record.headers['rebound.attempt'].decode()} value={record.value!r:.60}"
                )
                return
            data = record.json()
            print(describe(record, started, kinds))
            key = data["key"].encode()
            kind = kinds.get((data["original_topic"], data["original_partition"], data["original_offset"]))
            if data["outcome"] in DONE_OUTCOMES:
                ends[(key, kind)] = data["outcome"]
            if key == b"item-1" and data["outcome"] == "scheduled" and data["attempt"] == 1 and not create_sent:
                create_sent = True
                meta = (await produce(broker.bootstrap, "items", [event("CreateItem", "item-1", name="lamp")]))[0]
                kinds[("items", meta.partition, meta.offset)] = "CreateItem"
                print(f"{time.time() - started:7.2f}s  item-1  CreateItem produced (late)")

        async with Tail(broker.bootstrap, ["rebound.attempts", "items.failed"]) as tail:
            finished = await tail.until(
                lambda _: (
                    all(ends.get(key) == outcome for key, outcome in EXPECTED_END.items())
                    and sum(1 for r in tail.records if r.topic == "items.failed") >= 2
                ),
                timeout,
                on_record,
            )
        print()
        outcomes = [r.json()["outcome"] for r in tail.records if r.topic == "rebound.attempts"]
        failed = [r for r in tail.records if r.topic == "items.failed"]
        print(
            f"summary: {len(outcomes)} attempts ({outcomes.count('succeeded')} succeeded, "
            f"{outcomes.count('scheduled')} scheduled for retry, {outcomes.count('dead')} dead), "
            f"{len(failed)} records on items.failed "
            f"({', '.join(sorted(r.headers['rebound.reason'].decode() for r in failed))}), "
            f"{time.time() - started:.1f}s"
        )
        if not finished:
            print(f"the scenario did not finish within {timeout:.0f}s; see {worker.log_path}", file=sys.stderr)
            return 1
        print("scenario complete: every item reached its expected end.")
        if keep_running:
            print(operator_hints(worker.web_port, token))
            await trickle(broker.bootstrap, worker)
        return 0
    finally:
        worker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    parser.add_argument("--keep-running", action="store_true", help="leave the worker and broker up afterwards")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    parser.add_argument(
        "--keep-files", action="store_true", help="keep the demo's temporary directory (worker log, data) at the end"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        return asyncio.run(play(args.keep_running, args.timeout, args.keep_files))
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:  # SIGTERM or SIGHUP (see stop_on_signals)
        return 143


if __name__ == "__main__":
    sys.exit(main())
