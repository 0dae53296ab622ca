"""The checker's inputs on disk, so a finished run can be checked again (``python -m chaos --recheck DIR``).

Keeping the raw material next to the verdict means a surprising figure can be traced to the records behind it
without re-running minutes of faults; the call logs are already files, the rest is written here.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chaos.calllog import read_all
from chaos.checker import CheckInputs, DeadLetter, DueTime, Origin, Produced

PRODUCED_FILE = "produced.jsonl"
OBSERVED_FILE = "observed.json"
CALLS_DIR = "calls"


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _origin(raw: Any) -> Origin | None:
    return None if raw is None else (str(raw[0]), int(raw[1]), int(raw[2]))


def save_produced(out: Path, produced: Iterable[Produced]) -> None:
    with (out / PRODUCED_FILE).open("w", encoding="utf-8") as file:
        for message in produced:
            row = {
                "id": message.mid,
                "origin": list(message.origin),
                "key": _b64(message.key),
                "value": _b64(message.value),
                "kind": message.kind,
                "expected": message.expected,
                "expected_attempt": message.expected_attempt,
            }
            file.write(json.dumps(row) + "\n")


def save_observed(out: Path, inputs: CheckInputs) -> None:
    """Everything of ``inputs`` except what has its own file (the produced set, the call logs)."""
    main_log = inputs.main_log
    committed = inputs.committed
    document = {
        "main_log": None
        if main_log is None
        else [[list(origin), _b64(key), _b64(value)] for origin, (key, value) in main_log.items()],
        "committed": None if committed is None else [[topic, p, offset] for (topic, p), offset in committed.items()],
        "dead_letters": [
            {
                "origin": None if letter.origin is None else list(letter.origin),
                "reason": letter.reason,
                "attempt": letter.attempt,
                "key": _b64(letter.key),
                "value": _b64(letter.value),
                "partition": letter.partition,
                "offset": letter.offset,
            }
            for letter in inputs.dead_letters
        ],
        "due_times": [[list(due.origin), due.attempt, due.due_ms, due.source] for due in inputs.due_times],
        "succeeded_events": [[list(origin), attempt] for origin, attempt in inputs.succeeded_events],
    }
    (out / OBSERVED_FILE).write_text(json.dumps(document), encoding="utf-8")


def load_inputs(out: Path) -> CheckInputs:
    produced = []
    for line in (out / PRODUCED_FILE).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        origin = _origin(row["origin"])
        assert origin is not None
        produced.append(
            Produced(
                mid=row["id"],
                origin=origin,
                key=_unb64(row["key"]),
                value=_unb64(row["value"]),
                kind=row["kind"],
                expected=row["expected"],
                expected_attempt=row["expected_attempt"],
            )
        )
    observed = json.loads((out / OBSERVED_FILE).read_text(encoding="utf-8"))
    dead_letters = [
        DeadLetter(
            origin=_origin(row["origin"]),
            reason=row["reason"],
            attempt=row["attempt"],
            key=_unb64(row["key"]),
            value=_unb64(row["value"]),
            partition=row["partition"],
            offset=row["offset"],
        )
        for row in observed["dead_letters"]
    ]
    due_times = []
    for origin_raw, attempt, due_ms, source in observed["due_times"]:
        origin = _origin(origin_raw)
        assert origin is not None
        due_times.append(DueTime(origin, attempt, due_ms, source))
    succeeded: list[tuple[Origin, int]] = []
    for origin_raw, attempt in observed["succeeded_events"]:
        origin = _origin(origin_raw)
        assert origin is not None
        succeeded.append((origin, attempt))
    main_log: dict[Origin, tuple[bytes | None, bytes | None]] | None = None
    if observed.get("main_log") is not None:
        main_log = {}
        for origin_raw, key, value in observed["main_log"]:
            origin = _origin(origin_raw)
            assert origin is not None
            main_log[origin] = (_unb64(key), _unb64(value))
    committed = observed.get("committed")
    faults: list[tuple[int, str]] = []
    key_ordered = False
    result_path = out / "result.json"
    if result_path.exists():  # the run's own record of its faults, for a recheck
        run = json.loads(result_path.read_text()).get("run", {})
        faults = [(int(f["started_ms"]), f"{f['kind']} {f['target']}") for f in run.get("faults", [])]
        key_ordered = run.get("ordering") == "key"
    return CheckInputs(
        produced=produced,
        calls=read_all(out / CALLS_DIR),
        dead_letters=dead_letters,
        due_times=due_times,
        succeeded_events=succeeded,
        main_log=main_log,
        committed=None if committed is None else {(str(t), int(p)): int(o) for t, p, o in committed},
        faults=faults,
        key_ordered=key_ordered,
    )
