"""The redrive ledger and audit log: JSON lines under ``<out>/redrive/``.

The ledger has one line per record sent back, keyed by the failed record's ``(topic, partition, offset)``; a line
is appended only after the broker acknowledged the send, so a later run never sends a record twice (a crash between
the acknowledgement and the append can at worst resend that last chunk). The audit log has one line per run, dry or
not: who, when, with which filters, and the counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

LedgerKey = tuple[str, int, int]


def ledger_path(out: Path) -> Path:
    return out / "redrive" / "ledger.jsonl"


def audit_path(out: Path) -> Path:
    return out / "redrive" / "audit.jsonl"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    with path.open(encoding="utf-8") as fh:
        for raw in fh:
            line = raw.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line torn by a crash mid-write; everything before it is intact
    return rows


def read_ledger(out: Path) -> list[dict[str, Any]]:
    return _read_lines(ledger_path(out))


def ledger_keys(out: Path) -> set[LedgerKey]:
    return {(r["failed_topic"], int(r["failed_partition"]), int(r["failed_offset"])) for r in read_ledger(out)}


def _append(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = False
    if path.exists() and path.stat().st_size:
        with path.open("rb") as check:
            check.seek(-1, os.SEEK_END)
            torn = check.read(1) != b"\n"
    with path.open("a", encoding="utf-8") as fh:
        if torn:  # never glue a new row onto a line left half-written by a crash
            fh.write("\n")
        for row in rows:
            fh.write(json.dumps(row, default=str, separators=(",", ":")) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def append_ledger(out: Path, rows: Iterable[dict[str, Any]]) -> None:
    _append(ledger_path(out), rows)


def append_audit(out: Path, row: dict[str, Any]) -> None:
    _append(audit_path(out), [row])


def read_audit(out: Path) -> list[dict[str, Any]]:
    return _read_lines(audit_path(out))
