"""The run's verdict: ``result.json`` (everything, for tools) and ``summary.md`` (the figures a person reads first).

Worker logs are scanned for the lines that explain a loss or a wedge (send retries, internal errors, tracebacks), so
a failing run hands over its evidence instead of only a count.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

LOG_PATTERNS: dict[str, re.Pattern[str]] = {
    "error": re.compile(r"\bERROR\b|\[E\]|\bCRITICAL\b"),
    "send-retry": re.compile(r"send to \S+ failed"),
    "internal-error": re.compile(r"internal error|internal-error"),
    "release-failed": re.compile(r"release of \S+ attempt \d+ failed"),
    "revoked-during-release": re.compile(r"revoked during the release"),
    "attempt-event-lost": re.compile(r"could not emit attempt event"),
}
SAMPLES_PER_PATTERN = 5


def _exception_line(line: str) -> bool:
    """The line that ends a traceback: not a frame, not source, not a chaining notice."""
    return bool(line.strip()) and not line[0].isspace() and not line.startswith(("Traceback", "The above", "During"))


def scan_logs(logs_dir: Path) -> dict[str, Any]:
    """Counts of each pattern per log file, the first matching lines of each, and the exceptions that tracebacks
    ended with (the traceback's first line says nothing; its last one says what happened)."""
    per_file: dict[str, dict[str, int]] = {}
    samples: dict[str, list[str]] = {name: [] for name in LOG_PATTERNS}
    exceptions: Counter[str] = Counter()
    for path in sorted(logs_dir.glob("*.log")):
        counts: dict[str, int] = {}
        in_traceback = False
        with path.open(encoding="utf-8", errors="replace") as file:
            for line in file:
                if in_traceback and _exception_line(line):
                    exceptions[line.strip()[:300]] += 1
                    in_traceback = False
                if line.startswith("Traceback"):
                    in_traceback = True
                for name, pattern in LOG_PATTERNS.items():
                    if pattern.search(line):
                        counts[name] = counts.get(name, 0) + 1
                        if len(samples[name]) < SAMPLES_PER_PATTERN:
                            samples[name].append(f"{path.name}: {line.strip()[:400]}")
        if counts:
            per_file[path.name] = counts
    return {
        "per_file": per_file,
        "samples": {name: lines for name, lines in samples.items() if lines},
        "exceptions": dict(exceptions.most_common(20)),
    }


def write_result(out: Path, result: dict[str, Any]) -> Path:
    path = out / "result.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def _kinds(listing: dict[str, Any]) -> str:
    by_kind = listing.get("by_kind") or {}
    return "" if not by_kind else " (" + "; ".join(f"{kind}: {count}" for kind, count in sorted(by_kind.items())) + ")"


def _fmt(value: object) -> str:
    return "n/a" if value is None else str(value)


def markdown(result: dict[str, Any]) -> str:
    check = result["check"]
    run = result["run"]
    lateness = check["lateness_ms"]
    faults = ", ".join(f"{kind} {count}" for kind, count in sorted(run["faults_injected"].items())) or "none"
    verdict = "PASS" if check["passed"] else "FAIL: " + "; ".join(check["failures"])
    lines = [
        f"# Chaos run {run['run_id']}: {verdict}",
        "",
        f"{run['started']} · commit `{run['commit']}` · {run['cpus']} cores · {run.get('kafka', 'tansu')} · seed {run['seed']} · "
        f"{run['workers']} workers · {run['partitions']} partitions · retry sequence `{run['retry_sequence']}`"
        f" · ordering `{run.get('ordering', 'none')}` · outcome `{run.get('outcome', 'scripted')}`",
        "",
        "| figure | value |",
        "|---|---|",
        f"| messages produced | {check['messages']} (of {run['messages_planned']} planned) |",
        f"| kinds | {', '.join(f'{k} {v}' for k, v in sorted(check['by_kind'].items()))} |",
        f"| faults injected | {faults} |",
        f"| handler calls | {check['calls']} |",
        f"| lost | {check['lost']['count']}{_kinds(check['lost'])} |",
        f"| forks (more than one terminal state) | {check['multi_terminal']['count']}"
        f"{_kinds(check['multi_terminal'])} |",
        *_lifecycle_rows(check.get("lifecycles")),
        f"| unexpected terminal state | {check['unexpected_terminal']['count']} |",
        f"| dead letters not byte-exact | {check['corrupt_dead_letters']['count']} |",
        f"| retries run before due | {check['early']['count']} |",
        f"| retries without a known due time | {check['unknown_due']['count']} |",
        f"| duplicate calls (same message and attempt) | {check['duplicates']['extra_calls']} extra calls on "
        f"{check['duplicates']['pairs']} pairs, at most {check['duplicates']['max_calls_per_pair']} calls per pair |",
        f"| same terminal state reached again (dead letter sent twice) | "
        f"{check['duplicates'].get('repeated_terminal_states', 0)} |",
        f"| lateness after due, ms (p50 / p99 / max, {lateness['count']} retries) | "
        f"{_fmt(lateness['p50'])} / {_fmt(lateness['p99'])} / {_fmt(lateness['max'])} |",
        *_stall_row(check.get("stalls")),
        f"| terminal states | {', '.join(f'{k} {v}' for k, v in sorted(check['terminal'].items()))} |",
        *_key_order_row(check.get("key_order")),
        f"| worker crashes (exited unasked) | {len(run['crashes'])} |",
        f"| wall time | {run['wall_s']} s (all terminal after {_fmt(run['all_terminal_after_s'])} s) |",
        "",
        *_duplicates_by_fault(check["duplicates"].get("by_fault", [])),
    ]
    if check["lost"]["count"]:
        ids = ", ".join(item["id"] for item in check["lost"]["items"][:30])
        lines += [f"Lost (first 30): {ids}", ""]
    if check["multi_terminal"]["count"]:
        items = "; ".join(
            f"{item['id']}: {', '.join(item['states'])}" for item in check["multi_terminal"]["items"][:10]
        )
        lines += [f"Forks, more than one terminal state (first 10): {items}", ""]
    if check["early"]["count"]:
        items = "; ".join(
            f"{item['id']} attempt {item['attempt']} {item['early_by_ms']} ms early"
            for item in check["early"]["items"][:10]
        )
        lines += [f"Early (first 10): {items}", ""]
    exceptions = result.get("log_evidence", {}).get("exceptions", {})
    if exceptions:
        lines += ["Exceptions in worker logs (count, last line of the traceback):", ""]
        lines += [f"- {count} x `{text[:200]}`" for text, count in list(exceptions.items())[:8]]
        lines.append("")
    evidence = result.get("log_evidence", {}).get("samples", {})
    if evidence:
        lines += ["Worker log evidence (first lines per pattern):", ""]
        for name, samples in evidence.items():
            lines += [f"- {name}:"] + [f"  - `{sample[:300]}`" for sample in samples[:3]]
        lines.append("")
    lines.append(
        "Details: `result.json`; inputs for `python -m chaos --recheck DIR`: `produced.jsonl`, "
        "`observed.json`, `calls/`."
    )
    return "\n".join(lines) + "\n"


def write_summary(out: Path, result: dict[str, Any]) -> Path:
    path = out / "summary.md"
    path.write_text(markdown(result), encoding="utf-8")
    return path


def _key_order_row(key_order: dict[str, Any] | None) -> list[str]:
    if not key_order or not key_order.get("pairs_checked"):
        return []
    return [
        f"| key order: a message started before the one before it settled | {key_order['count']} of "
        f"{key_order['pairs_checked']} consecutive pairs of a key |"
    ]


def _duplicates_by_fault(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    return [
        "Repeated calls by the last fault before them (same process: read again after a rebalance or a seek; other "
        "process: a new owner redoing what was not committed):",
        "",
        "| after | extra calls | same process | other process |",
        "|---|---|---|---|",
        *(f"| {r['after']} | {r['extra_calls']} | {r['same_process']} | {r['other_process']} |" for r in rows),
        "",
    ]


def _lifecycle_rows(lifecycles: dict[str, Any] | None) -> list[str]:
    """Second lifecycles of a message (absent from results written before they were counted)."""
    if not lifecycles:
        return []
    return [
        f"| first tries run again after the message left the main topic | {lifecycles['restarted']['count']} |",
        f"| retries run again after the message ended | {lifecycles['retries_after_end']['count']} |",
    ]


def _stall_row(stalls: dict[str, Any] | None) -> list[str]:
    """Issue 22's stall target, reported only (absent from results written before stalls were measured)."""
    if not stalls:
        return []
    worst = stalls.get("worst_stream")
    where = "" if worst is None else f" ({worst}, after {stalls['per_stream'][worst].get('after', 'no fault')})"
    return [
        f"| longest stall after a fault, s (worst stream) | {stalls['worst_ms'] / 1000:.1f}{where}; "
        f"{stalls['over_target']} of {stalls['streams']} streams over {stalls['target_ms'] / 1000:.0f} s |"
    ]
