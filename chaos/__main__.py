"""``python -m chaos``: run the conservation harness (or re-check a finished run) and exit non-zero on a violation.

Exit codes: 0 every message conserved, 1 a guarantee was violated (lost, early, more than one terminal state, ...),
2 the harness itself could not run, 130/143 interrupted (every process it started has been ended).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path

from chaos.checker import check
from chaos.evidence import load_inputs
from chaos.faults import FaultKind
from chaos.report import markdown
from chaos.run import RunConfig, run
from chaos.scenario import OUTCOMES

QUICK_NUMBERS: dict[str, float] = {
    "messages": 600,
    "workers": 2,
    "partitions": 4,
    "duration": 30.0,
    "deadline": 240.0,
    "stall": 45.0,
}
QUICK_FAULTS = "kill,stop"


def parse_faults(text: str) -> dict[FaultKind, int]:
    """``kill=2,stop=2,rebalance=2,broker-pause=1``; a bare name means once; ``none`` means no faults."""
    counts: dict[FaultKind, int] = {}
    if text.strip() in ("", "none"):
        return counts
    for part in text.split(","):
        name, _, count = part.strip().partition("=")
        try:
            kind = FaultKind(name)
        except ValueError:
            choices = ", ".join(kind.value for kind in FaultKind)
            raise argparse.ArgumentTypeError(f"unknown fault {name!r}; choose from {choices}") from None
        counts[kind] = counts.get(kind, 0) + (int(count) if count else 1)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("--messages", type=int, help="messages to produce (default 20000; quick 600)")
    parser.add_argument("--workers", type=int, help="workers at all times (default 3; quick 2)")
    parser.add_argument("--partitions", type=int, help="partitions of the main topic (default 6; quick 4)")
    parser.add_argument("--duration", type=float, help="fault window in seconds (default 240; quick 30)")
    parser.add_argument(
        "--faults",
        type=parse_faults,
        help="e.g. kill=2,stop=2,rebalance=2,broker-pause=1 (the default); quick: kill,stop; none for no faults",
    )
    parser.add_argument(
        "--deadline", type=float, help="longest wait for terminal states after the fault window (default 900 s)"
    )
    parser.add_argument(
        "--stall", type=float, help="give up waiting once no message became terminal for this long (default 90 s)"
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds the message plan and the fault schedule")
    parser.add_argument("--retry-sequence", default="1s,2s,3s", help="REBOUND_RETRY_SEQUENCE of the workers")
    parser.add_argument(
        "--ordering", default="none", choices=["none", "key"], help="REBOUND_ORDERING of the workers (key: checked)"
    )
    parser.add_argument(
        "--outcome",
        default="scripted",
        choices=list(OUTCOMES),
        help="the handler decides by attempt number (scripted) or at random per call (random: forks become visible)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/chaos"), help="directory for results, logs, call logs")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 workers, 600 messages, kill and stop")
    parser.add_argument(
        "--bootstrap", help="use this running broker (host:port) instead of starting one; no broker-pause then"
    )
    parser.add_argument("--log-level", default="info", choices=["crit", "error", "warn", "info", "debug"])
    parser.add_argument(
        "--kafka",
        default="tansu",
        choices=["tansu", "mock"],
        help="the broker the run starts: the embedded Tansu broker (default) or librdkafka's mock cluster (3 brokers)",
    )
    parser.add_argument("--recheck", type=Path, metavar="DIR", help="only re-run the checker on a finished run's DIR")
    return parser


def config_from(args: argparse.Namespace) -> RunConfig:
    """Explicit flags win over ``--quick``, which wins over the full run's defaults."""
    defaults = RunConfig(out=args.out)
    quick: dict[str, float] = QUICK_NUMBERS if args.quick else {}

    def pick(name: str, default: float) -> float:
        value = getattr(args, name)
        return float(value) if value is not None else quick.get(name, default)

    quick_faults = parse_faults(QUICK_FAULTS) if args.quick else defaults.faults
    faults = args.faults if args.faults is not None else quick_faults
    return RunConfig(
        out=args.out,
        messages=int(pick("messages", defaults.messages)),
        workers=int(pick("workers", defaults.workers)),
        partitions=int(pick("partitions", defaults.partitions)),
        duration_s=pick("duration", defaults.duration_s),
        faults=faults,
        deadline_s=pick("deadline", defaults.deadline_s),
        stall_s=pick("stall", defaults.stall_s),
        seed=args.seed,
        retry_sequence=args.retry_sequence,
        ordering=args.ordering,
        outcome=args.outcome,
        bootstrap=args.bootstrap,
        log_level=args.log_level,
        kafka=args.kafka,
    )


async def _main(config: RunConfig) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def interrupt(signum: int) -> None:
        received.append(signum)
        task.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, interrupt, signum)
    try:
        result = await run(config)
    except asyncio.CancelledError:
        if received:
            logging.getLogger("chaos").error("interrupted by signal %d; every started process was ended", received[0])
            return 128 + received[0]
        raise
    check_result = result["check"]
    print((config.out / "summary.md").read_text(encoding="utf-8"))
    return 0 if check_result["passed"] else 1


RECHECK_RESULT = "recheck-result.json"
RECHECK_SUMMARY = "recheck-summary.md"


def recheck(directory: Path) -> int:
    """Check a finished run again; prints the check, and next to the run's own ``result.json`` and ``summary.md``
    (never overwritten) writes ``recheck-result.json`` and ``recheck-summary.md`` with the new check."""
    inputs = load_inputs(directory)
    result_path = directory / "result.json"
    original = json.loads(result_path.read_text(encoding="utf-8")) if result_path.exists() else None
    if original is not None:  # fault ends, for the stall figure (load_inputs keeps only the starts)
        windows = [
            (int(f["started_ms"]), int(f.get("ended_ms") or f["started_ms"]), f"{f['kind']} {f['target']}")
            for f in original.get("run", {}).get("faults", [])
        ]
        inputs = replace(inputs, fault_windows=windows)
    verdict = check(inputs)
    print(json.dumps(verdict.to_json(), indent=2))
    if original is not None:
        rechecked = {**original, "check": verdict.to_json()}
        (directory / RECHECK_RESULT).write_text(json.dumps(rechecked, indent=2, default=str) + "\n", encoding="utf-8")
        (directory / RECHECK_SUMMARY).write_text(markdown(rechecked), encoding="utf-8")
    return 0 if verdict.passed else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its subscription chatter would bury the progress
    if args.recheck is not None:
        return recheck(args.recheck)
    try:
        return asyncio.run(_main(config_from(args)))
    except SystemExit:
        raise
    except Exception:
        logging.getLogger("chaos").exception("the harness could not complete the run")
        return 2


if __name__ == "__main__":
    sys.exit(main())
