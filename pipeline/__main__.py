"""``python -m pipeline <job>`` (or ``spark-submit pipeline/__main__.py <job>``): facts, report, tune, inventory,
redrive. Run with ``--help`` after a job name for its flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # spark-submit runs this file as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.common import Job, add_common_arguments, config_from_args, spark_session
from pipeline.jobs import facts, inventory, redrive, report, tune

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

JOBS: dict[str, tuple[Job, str]] = {
    "facts": (facts, "attempts topic -> de-duplicated Parquet facts (incremental)"),
    "report": (report, "HTML report, PNG charts and tables from the facts and failed topics"),
    "tune": (tune, "recommend a retry sequence from observed time to recovery"),
    "inventory": (inventory, "failed-topic depth, age, breakdowns and redrive status"),
    "redrive": (redrive, "send chosen failed records back to their original topic (dry run by default)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="job", required=True)
    for name, (module, help_text) in JOBS.items():
        p = sub.add_parser(
            name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        add_common_arguments(p)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None, spark: SparkSession | None = None) -> dict[str, Any]:
    """Run one job; ``spark`` lets tests reuse their session. Returns the job's result dict."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    module = JOBS[args.job][0]
    session = spark or spark_session(cfg, args.job)
    return module.run(args, cfg, session)


if __name__ == "__main__":
    main()
    sys.exit(0)
