"""What redrive remembers under ``<out>/redrive/``: the ledger, the audit trail and the run lock.

Every file here is written once and never changed, because ``--out`` may be an object store (no append, no rename)
or shared storage that several operators' drivers write to:

* ``ledger/<run>-<seq>.jsonl``: one object per chunk of records the broker acknowledged, written only after the
  acknowledgement; the ledger is the union of all of them. A crash between the acknowledgement and the write can at
  worst send that one chunk (at most 100 records) again. A write that keeps failing leaves the lock in place, marked
  ``ledger_incomplete`` (:func:`mark_lock_incomplete`), so no run starts before the operator has recorded the rows.
  A chunk object is never torn (written whole), so one that does not parse is an error, not a line to skip.
* ``audit/<run>-<n>-<status>.json``: ``started`` when a run begins, ``finished`` or ``failed`` (with the error)
  when it ends, so a run that died midway still left a trace.
* ``lock``: held by the one run that executes at a time; created exclusively (``O_EXCL`` locally, a conditional
  put on S3), so two operators starting ``--execute`` together cannot both send.

Files of the earlier layout (``ledger.jsonl``, ``audit.jsonl``, appended by older versions) are still read.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from typing import Any

from pipeline.storage import Location

LedgerKey = tuple[str, int, int]


class LockHeld(SystemExit):
    """Another redrive run holds ``<out>/redrive/lock``; the message names it."""


def redrive_dir(out: Location) -> Location:
    return out / "redrive"


def ledger_dir(out: Location) -> Location:
    return redrive_dir(out) / "ledger"


def audit_dir(out: Location) -> Location:
    return redrive_dir(out) / "audit"


def lock_path(out: Location) -> Location:
    return redrive_dir(out) / "lock"


def _json_line(row: dict[str, Any]) -> str:
    return json.dumps(row, default=str, separators=(",", ":")) + "\n"


class LedgerCorrupt(RuntimeError):
    """A ledger chunk object cannot be read; skipping it would forget sends, so redrive stops instead."""


def _parse_lines(text: str, source: Location | None = None) -> list[dict[str, Any]]:
    """JSON lines; with ``source`` (an immutable object, never torn by an append) a bad line raises."""
    rows = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            elif source is not None:
                raise LedgerCorrupt(
                    f"redrive: ledger object {source} line {number} is not a JSON object; its records may have "
                    "been sent, so nothing is redriven until it is repaired (restore it, or rewrite the line from "
                    "the audit records of its run)"
                )
            # else: a line torn by a crash of an older, appending version; the rest is intact
    return rows


def _write_once(target: Location, data: bytes, *, same_is_fine: bool = False) -> Location:
    if not target.create_exclusive(data):
        if same_is_fine and target.read_bytes() == data:
            return target  # a retried write whose first attempt did land
        raise FileExistsError(f"{target} exists already: redrive objects are written once, under a unique run id")
    return target


def write_ledger_chunk(out: Location, run_id: str, seq: int, rows: Iterable[dict[str, Any]]) -> Location | None:
    """Record one acknowledged chunk as its own object; nothing is written for an empty chunk."""
    text = "".join(_json_line(r) for r in rows)
    if not text:
        return None
    return _write_once(ledger_dir(out) / f"{run_id}-{seq:06d}.jsonl", text.encode("utf-8"), same_is_fine=True)


def read_ledger(out: Location) -> list[dict[str, Any]]:
    """Every ledger row: the union of the chunk objects, and of the appended file an older version left."""
    rows: list[dict[str, Any]] = []
    for chunk in ledger_dir(out).glob("*.jsonl"):
        rows.extend(_parse_lines(chunk.read_text(), chunk))
    legacy = redrive_dir(out) / "ledger.jsonl"
    if legacy.exists():
        rows.extend(_parse_lines(legacy.read_text()))
    return rows


def ledger_keys(out: Location) -> set[LedgerKey]:
    """The failed records already sent, as ``(topic, partition, offset)``."""
    return {(r["failed_topic"], int(r["failed_partition"]), int(r["failed_offset"])) for r in read_ledger(out)}


def write_audit(out: Location, run_id: str, seq: int, record: dict[str, Any]) -> Location:
    """One audit object per event of a run (``record["status"]``: started, finished, failed)."""
    stamped = {**record, "run_id": run_id, "seq": seq, "at": dt.datetime.now(dt.UTC).isoformat()}
    name = f"{run_id}-{seq}-{record['status']}.json"
    return _write_once(audit_dir(out) / name, json.dumps(stamped, default=str, indent=1).encode("utf-8"))


def read_audit(out: Location) -> list[dict[str, Any]]:
    """Every audit record, oldest first (rows of an older ``audit.jsonl`` included, before the rest)."""
    legacy = redrive_dir(out) / "audit.jsonl"
    rows = _parse_lines(legacy.read_text()) if legacy.exists() else []
    objects = [json.loads(obj.read_text()) for obj in audit_dir(out).glob("*.json")]
    objects.sort(key=lambda r: (str(r.get("at", "")), str(r.get("run_id", "")), int(r.get("seq", 0))))
    return rows + objects


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"run {holder.get('run_id', '?')} by {holder.get('user', '?')}@{holder.get('host', '?')} "
        f"(pid {holder.get('pid', '?')}) since {holder.get('acquired_at', '?')}"
    )


def acquire_lock(out: Location, holder: dict[str, Any], *, break_lock: bool = False) -> Location:
    """Take ``<out>/redrive/lock`` for ``holder`` (run id, user, host, pid) or raise :class:`LockHeld` naming the
    run that has it.

    A lock is never taken over by age: a long run at a low ``--rate`` looks just like a crashed one, so only the
    operator, after checking that the holder is gone, may remove it with ``break_lock``.
    """
    path = lock_path(out)
    data = json.dumps({**holder, "acquired_at": dt.datetime.now(dt.UTC).isoformat()}, indent=1).encode("utf-8")
    if path.create_exclusive(data):
        return path
    current = read_lock(out)
    if current.get("ledger_incomplete"):
        incomplete = current["ledger_incomplete"]
        message = (
            f"redrive: {path} was left by {_describe(current)}, whose ledger is incomplete: "
            f"{incomplete.get('records', '?')} record(s) the broker acknowledged could not be recorded "
            f"({incomplete.get('error', '?')}). They are listed in {incomplete.get('listed_in', 'its failed audit')}; "
            "write them to the ledger (as a <run>-<seq>.jsonl object under "
            f"{ledger_dir(out)}) so they are not sent twice, then rerun with --break-lock."
        )
        if not break_lock:
            raise LockHeld(message)
    if not break_lock:
        raise LockHeld(
            f"redrive: {path} is held by {_describe(current)}; only one executing redrive per --out at a time. "
            "If that run is no longer running (check the host and pid), rerun with --break-lock."
        )
    path.unlink()
    if path.create_exclusive(data):
        return path
    raise LockHeld(
        f"redrive: {path} was taken again right after --break-lock removed it, by {_describe(read_lock(out))}"
    )


def read_lock(out: Location) -> dict[str, Any]:
    """The lock holder, or an empty dict (no lock, or one being written)."""
    try:
        value = json.loads(lock_path(out).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def holds_lock(out: Location, run_id: str) -> bool:
    return read_lock(out).get("run_id") == run_id


def release_lock(out: Location, run_id: str) -> None:
    """Remove the lock if this run still holds it (someone may have broken it meanwhile). Checked right before
    the delete; the storage has no conditional delete, so a lock broken and retaken in between is still a race."""
    if holds_lock(out, run_id):
        lock_path(out).unlink()


def mark_lock_incomplete(out: Location, run_id: str, details: dict[str, Any]) -> None:
    """Keep this run's lock, marked: records were sent that the ledger does not know, and the next ``--execute``
    must not start before an operator has recorded them (:func:`acquire_lock` says how)."""
    holder = read_lock(out)
    if holder.get("run_id") != run_id:
        return
    lock_path(out).write_bytes(json.dumps({**holder, "ledger_incomplete": details}, indent=1).encode("utf-8"))
