"""The handler's own call log: one SQLite row per handler call, independent of everything Rebound stores.

Each worker incarnation writes its own file. A shared file would let a SIGSTOPped worker that happens to hold the
write lock stall every other worker's handler (and so their heartbeats), turning one fault into a cluster-wide one
that comes from the harness, not from Rebound. WAL mode with one committed transaction per call means a SIGKILL loses
at most the call in flight, which never returned to Rebound either.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    mid TEXT,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    "offset" INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    tier TEXT,
    call_ms INTEGER NOT NULL,
    due_ms INTEGER,
    outcome TEXT NOT NULL,
    pid INTEGER NOT NULL,
    worker TEXT
)
"""


@dataclass(frozen=True, slots=True)
class Call:
    mid: str | None
    """The id read from the value (None if the bytes carry none); the provenance below is the authoritative one."""
    topic: str
    partition: int
    offset: int
    attempt: int
    call_ms: int
    outcome: str
    pid: int = 0
    worker: str | None = None
    tier: str | None = None
    due_ms: int | None = None

    @property
    def origin(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


class CallLogWriter:
    """Appends calls to one SQLite file; opened lazily in the worker process that uses it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(SCHEMA)

    def write(self, call: Call) -> None:
        self._db.execute(
            'INSERT INTO calls (mid, topic, partition, "offset", attempt, tier, call_ms, due_ms, outcome, pid, worker)'
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                call.mid,
                call.topic,
                call.partition,
                call.offset,
                call.attempt,
                call.tier,
                call.call_ms,
                call.due_ms,
                call.outcome,
                call.pid,
                call.worker,
            ),
        )

    def close(self) -> None:
        self._db.close()


class CallLogReader:
    """Reads every call log in a directory incrementally, so the harness can poll it while workers still write."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seen: dict[Path, int] = {}

    def read_new(self) -> list[Call]:
        calls: list[Call] = []
        for path in sorted(self.directory.glob("*.sqlite")):
            last = self._seen.get(path, 0)
            try:
                db = sqlite3.connect(path, timeout=30.0)
            except sqlite3.Error:
                continue
            try:
                rows = db.execute(
                    'SELECT id, mid, topic, partition, "offset", attempt, tier, call_ms, due_ms, outcome, pid, worker'
                    " FROM calls WHERE id > ? ORDER BY id",
                    (last,),
                ).fetchall()
            except sqlite3.OperationalError:  # the worker has not created its table yet
                rows = []
            finally:
                db.close()
            for row in rows:
                last = row[0]
                calls.append(
                    Call(
                        mid=row[1],
                        topic=row[2],
                        partition=row[3],
                        offset=row[4],
                        attempt=row[5],
                        tier=row[6],
                        call_ms=row[7],
                        due_ms=row[8],
                        outcome=row[9],
                        pid=row[10],
                        worker=row[11],
                    )
                )
            self._seen[path] = last
        return calls


def read_all(directory: Path) -> list[Call]:
    return CallLogReader(directory).read_new()
