"""``inventory``: what sits on the failed topics now (or in a time window), and which of it was already redriven.

With ``--since``/``--until`` only that part of each failed topic is fetched from the broker, so a look at the last
hour of a large failed topic does not read all of it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import TYPE_CHECKING, Any

from pipeline.common import JobConfig, check_window, parse_time, read_failed, write_table
from pipeline.jobs.redrive import identify, with_already_redriven
from pipeline.ledger import read_ledger

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top", type=int, default=20, help="how many keys to list")
    parser.add_argument("--since", type=parse_time, help="failed-topic record time >= this (ISO-8601 UTC or epoch ms)")
    parser.add_argument("--until", type=parse_time, help="failed-topic record time < this")


def build(
    failed: DataFrame, ledger_rows: list[dict[str, Any]], spark: SparkSession, top: int, now: dt.datetime
) -> dict[str, pd.DataFrame]:
    import pandas as pd
    from pyspark.sql import functions as F

    # Redriven per original message, by redrive's own rule: a dead letter whose message was sent back through
    # another dead letter (one per group, or a dead letter written twice) counts as redriven too.
    failed = with_already_redriven(identify(failed), ledger_rows, spark).withColumnRenamed(
        "already_redriven", "redriven"
    )
    failed = failed.withColumn("redriven", F.coalesce("redriven", F.lit(False))).cache()
    now_ts = F.lit(now.replace(tzinfo=None)).cast("timestamp")
    depth = (
        failed.groupBy("topic")
        .agg(
            F.count("*").alias("depth"),
            F.min("timestamp").alias("oldest"),
            F.sum(F.col("redriven").cast("int")).alias("redriven"),
        )
        .withColumn("oldest_age_s", F.unix_timestamp(now_ts) - F.unix_timestamp("oldest"))
        .orderBy("topic")
        .toPandas()
    )

    def by(column: str) -> pd.DataFrame:
        return (
            failed.withColumn(column, F.coalesce(column, F.lit("(none)")))
            .groupBy(column)
            .agg(F.count("*").alias("records"), F.sum(F.col("redriven").cast("int")).alias("redriven"))
            .orderBy(F.desc("records"), column)
            .toPandas()
        )

    tables = {
        "depth": depth,
        "by_reason": by("reason"),
        "by_error_class": by("error_class"),
        "by_original_topic": by("original_topic"),
        "top_keys": failed.groupBy("topic", "key_text")
        .count()
        .orderBy(F.desc("count"), "key_text")
        .limit(top)
        .toPandas(),
        "redriven": failed.where("redriven")
        .select("topic", "partition", "offset", "key_text", "reason", "redrive_count")
        .orderBy("topic", "partition", "offset")
        .toPandas(),
    }
    failed.unpersist()
    if not len(tables["depth"]):
        tables["depth"] = pd.DataFrame(columns=["topic", "depth", "oldest", "redriven", "oldest_age_s"])
    return tables


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    check_window(args.since, args.until)
    failed = read_failed(spark, cfg, since=args.since, until=args.until)
    tables = build(failed, read_ledger(cfg.out), spark, args.top, dt.datetime.now(dt.UTC))
    out = cfg.out / "inventory"
    for name, pdf in tables.items():
        write_table(pdf, out, name)
    summary = {
        "window": {
            "since": args.since.isoformat() if args.since else None,
            "until": args.until.isoformat() if args.until else None,
        },
        "topics": {
            r["topic"]: {
                "depth": int(r["depth"]),
                "redriven": int(r["redriven"] or 0),
                "oldest_age_s": int(r["oldest_age_s"]),
            }
            for r in tables["depth"].to_dict("records")
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name in ("depth", "by_reason", "by_error_class", "by_original_topic", "top_keys"):
        print(f"== {name}\n{tables[name].to_string(index=False) if len(tables[name]) else '(none)'}")
    return {"summary": summary, "tables": tables}
