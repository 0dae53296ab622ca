"""``report``: what the retries did, from the attempt facts and the failed topics, as HTML + PNG + Parquet/JSON.

A *message* is one original record seen by one consumer group: ``(group, original_topic, original_partition,
original_offset)``. It *recovered* when it succeeded on a retry (attempt >= 1); its time to recovery is the success
event's ``event_time`` minus ``first_received_at``. It *never recovered* when its last outcome is dead or expired
and no success exists.

``--since``/``--until`` limit the report to attempt events whose ``event_time`` is in the window (read from those date
partitions only) and to failed-topic records whose timestamp is: a message whose events straddle a bound is seen in
part, e.g. a recovery inside the window whose first failure was before it (its time to recovery is still right: it
comes from the success event alone).
"""

from __future__ import annotations

import argparse
import html
import io
import json
from typing import TYPE_CHECKING, Any

from pipeline.common import JobConfig, check_window, read_failed, write_table
from pipeline.jobs.facts import add_window_arguments, facts_in_window, facts_path
from pipeline.storage import Location

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure
    from pyspark.sql import DataFrame, SparkSession

MESSAGE_KEY = ["group", "original_topic", "original_partition", "original_offset"]
FAILURE_OUTCOMES = ["scheduled", "dead", "expired"]
OUTCOMES = ["succeeded", *FAILURE_OUTCOMES]
FIRST_TRY = "first try"
UNKNOWN_TIER = "(unknown)"
TOP_KEYS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top", type=int, default=TOP_KEYS, help="how many failing keys to list")
    parser.add_argument("--skip-failed-topics", action="store_true", help="do not read the failed topics")
    add_window_arguments(parser, "attempt events (by event time) and failed-topic records (by record time)")


def with_next_tier(facts: DataFrame) -> DataFrame:
    """The scheduled events, each with ``next_tier``: the tier the message was sent to.

    That is the event's own ``next_tier``; for facts written before the attempt event carried it, the tier of the
    same message's next attempt, and ``(unknown)`` when that attempt has not happened yet.
    """
    from pyspark.sql import functions as F

    following = (
        facts.where(F.col("tier").isNotNull())
        .select(*MESSAGE_KEY, (F.col("attempt") - 1).alias("attempt"), F.col("tier").alias("following_tier"))
        .dropDuplicates([*MESSAGE_KEY, "attempt"])
    )
    return (
        facts.where(F.col("outcome") == "scheduled")
        .join(following, [*MESSAGE_KEY, "attempt"], "left")
        .withColumn("next_tier", F.coalesce("next_tier", "following_tier", F.lit(UNKNOWN_TIER)))
        .drop("following_tier")
    )


def scheduled_routes(facts: DataFrame) -> pd.DataFrame:
    """Where scheduled messages went: rows ``tier -> next_tier`` with the scheduled events and distinct messages."""
    from pyspark.sql import functions as F

    return (
        with_next_tier(facts)
        .withColumn("tier", F.coalesce("tier", F.lit(FIRST_TRY)))
        .groupBy("tier", "next_tier")
        .agg(
            F.min("attempt").alias("first_attempt"),
            F.count("*").alias("scheduled"),
            F.countDistinct(*MESSAGE_KEY).alias("messages"),
        )
        .orderBy("first_attempt", "tier", "next_tier")
        .drop("first_attempt")
        .toPandas()
    )


def outcomes_per_tier(facts: DataFrame, routes: pd.DataFrame | None = None) -> pd.DataFrame:
    """Rows: tier ("first try" for attempt 0), one column per outcome (counts of events), and ``scheduled_to``:
    where that tier's scheduled events went, e.g. ``30s (4)`` (from :func:`scheduled_routes`)."""
    from pyspark.sql import functions as F

    pdf: pd.DataFrame = (
        facts.withColumn("tier", F.coalesce("tier", F.lit(FIRST_TRY)))
        .groupBy("tier", "attempt")
        .pivot("outcome", [*OUTCOMES])
        .count()
        .na.fill(0)
        .groupBy("tier")
        .agg(
            F.min("attempt").alias("first_attempt"),
            *[F.sum(c).alias(c) for c in OUTCOMES],
        )
        .orderBy("first_attempt", "tier")
        .toPandas()
    )
    pdf = pdf.drop(columns=["first_attempt"]).astype(dict.fromkeys(OUTCOMES, "int64"))
    if routes is None:
        routes = scheduled_routes(facts)
    went = {
        tier: ", ".join(f"{r.next_tier} ({r.scheduled})" for r in part.itertuples())
        for tier, part in routes.groupby("tier", sort=False)
    }
    pdf["scheduled_to"] = [went.get(tier, "") for tier in pdf["tier"]]
    return pdf


def messages(facts: DataFrame) -> DataFrame:
    """One row per message: success attempt/time, last error class, terminal failure."""
    from pyspark.sql import functions as F

    succ = F.col("outcome") == "succeeded"
    failure = F.col("outcome").isin(*FAILURE_OUTCOMES)
    return facts.groupBy(*MESSAGE_KEY).agg(
        F.first("key", ignorenulls=True).alias("key"),
        F.min("first_received_at").alias("first_received_at"),
        F.min(F.when(succ, F.col("attempt"))).alias("success_attempt"),
        F.min(F.when(succ, F.col("event_time"))).alias("success_time"),
        F.max_by(F.when(failure, F.col("error_class")), F.when(failure, F.col("attempt"))).alias("error_class"),
        F.max(F.when(F.col("outcome").isin("dead", "expired"), 1).otherwise(0)).alias("terminal_failure"),
        F.sum(F.when(failure, 1).otherwise(0)).alias("failures"),
    )


def attempts_to_success(msgs: DataFrame) -> pd.DataFrame:
    from pyspark.sql import functions as F

    return (
        msgs.where(F.col("success_attempt").isNotNull())
        .groupBy(F.col("success_attempt").alias("attempts_before_success"))
        .count()
        .orderBy("attempts_before_success")
        .toPandas()
    )


def recovered(msgs: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    return msgs.where(F.col("success_attempt") >= 1).withColumn(
        "recovery_ms", F.col("success_time") - F.col("first_received_at")
    )


def recovery_percentiles(msgs: DataFrame) -> pd.DataFrame:
    """p50/p90/p99 of time to recovery (seconds, exact, linearly interpolated) by error class and topic."""
    from pyspark.sql import functions as F

    pct = F.percentile(F.col("recovery_ms") / 1000.0, F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99)))
    return (
        recovered(msgs)
        .withColumn("error_class", F.coalesce("error_class", F.lit("(none)")))
        .groupBy("error_class", "original_topic")
        .agg(F.count("*").alias("recovered"), pct.alias("p"))
        .select(
            "error_class",
            "original_topic",
            "recovered",
            F.col("p")[0].alias("p50_s"),
            F.col("p")[1].alias("p90_s"),
            F.col("p")[2].alias("p99_s"),
        )
        .orderBy("error_class", "original_topic")
        .toPandas()
    )


def never_recovered(msgs: DataFrame) -> pd.DataFrame:
    from pyspark.sql import functions as F

    return (
        msgs.where((F.col("terminal_failure") == 1) & F.col("success_attempt").isNull())
        .groupBy("original_topic")
        .count()
        .withColumnRenamed("count", "never_recovered")
        .orderBy("original_topic")
        .toPandas()
    )


def top_failing_keys(facts: DataFrame, top: int) -> pd.DataFrame:
    from pyspark.sql import functions as F

    return (
        facts.where(F.col("outcome").isin(*FAILURE_OUTCOMES))
        .groupBy("original_topic", "key")
        .agg(F.count("*").alias("failures"), F.countDistinct(*MESSAGE_KEY).alias("messages"))
        .orderBy(F.desc("failures"), "original_topic", "key")
        .limit(top)
        .toPandas()
    )


def failed_growth(failed: DataFrame) -> pd.DataFrame:
    """Records landing on the failed topics per UTC hour and reason, with the running total per reason."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    hourly = (
        failed.withColumn("hour", F.date_trunc("hour", "timestamp"))
        .withColumn("reason", F.coalesce("reason", F.lit("(none)")))
        .groupBy("topic", "hour", "reason")
        .count()
    )
    window = Window.partitionBy("topic", "reason").orderBy("hour")
    return hourly.withColumn("cumulative", F.sum("count").over(window)).orderBy("hour", "topic", "reason").toPandas()


def build_tables(facts: DataFrame, failed: DataFrame | None, top: int = TOP_KEYS) -> dict[str, pd.DataFrame]:
    import pandas as pd

    msgs = messages(facts).cache()
    routes = scheduled_routes(facts)
    tables = {
        "outcomes_per_tier": outcomes_per_tier(facts, routes),
        "scheduled_routes": routes,
        "attempts_to_success": attempts_to_success(msgs),
        "recovery_percentiles": recovery_percentiles(msgs),
        "never_recovered": never_recovered(msgs),
        "top_failing_keys": top_failing_keys(facts, top),
        "failed_growth": failed_growth(failed)
        if failed is not None
        else pd.DataFrame(columns=["topic", "hour", "reason", "count", "cumulative"]),
    }
    msgs.unpersist()
    return tables


def render_charts(tables: dict[str, pd.DataFrame], directory: Location) -> dict[str, str]:
    """The charts as PNG files in ``directory`` (through fsspec, so also on object stores); returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs: dict[str, bytes] = {}

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        pngs[name] = buffer.getvalue()

    tiers = tables["outcomes_per_tier"]
    if len(tiers):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels = [f"{t}\n→ {to}" if to else t for t, to in zip(tiers["tier"], tiers["scheduled_to"], strict=True)]
        tiers.set_axis(labels)[OUTCOMES].plot.bar(
            stacked=True, ax=ax, color=["#2e7d32", "#f9a825", "#c62828", "#6a1b9a"]
        )
        ax.set_title("Outcomes per tier")
        ax.set_ylabel("events")
        ax.tick_params(axis="x", rotation=0)
        save(fig, "outcomes_per_tier")
    hist = tables["attempts_to_success"]
    if len(hist):
        fig, ax = plt.subplots(figsize=(6, 3.4))
        ax.bar(hist["attempts_before_success"].astype(str), hist["count"], color="#1565c0")
        ax.set_title("Attempts before success (0 = first try)")
        ax.set_ylabel("messages")
        save(fig, "attempts_to_success")
    pct = tables["recovery_percentiles"]
    if len(pct):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels = pct["error_class"] + " / " + pct["original_topic"]
        frame = pct.set_index(labels)[["p50_s", "p90_s", "p99_s"]]
        frame.plot.barh(ax=ax, color=["#90caf9", "#42a5f5", "#0d47a1"])
        ax.set_title("Time to recovery (s)")
        ax.set_xlabel("seconds")
        save(fig, "recovery_percentiles")
    growth = tables["failed_growth"]
    if len(growth):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for (topic, reason), part in growth.groupby(["topic", "reason"]):
            ax.plot(part["hour"], part["cumulative"], marker="o", label=f"{topic}: {reason}")
        ax.set_title("Failed-topic growth (cumulative, per UTC hour)")
        ax.legend(fontsize=8)
        fig.autofmt_xdate()
        save(fig, "failed_growth")
    for name, data in pngs.items():
        (directory / f"{name}.png").write_bytes(data)
    if pngs:
        (directory / "overview.png").write_bytes(render_overview(pngs))
    return {name: f"{name}.png" for name in pngs}


def render_overview(pngs: dict[str, bytes]) -> bytes:
    """All charts on one 2x2 page (``overview.png``), e.g. for a chat message or the docs."""
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 7.5))
    for ax in axes.flat:
        ax.axis("off")
    for ax, data in zip(axes.flat, pngs.values(), strict=False):
        ax.imshow(mpimg.imread(io.BytesIO(data), format="png"))
    fig.suptitle("Rebound retry report", fontsize=14)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def render_html(
    tables: dict[str, pd.DataFrame], charts: dict[str, str], summary: dict[str, Any], path: Location
) -> None:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Rebound retry report</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1000px}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}</style></head><body>",
        "<h1>Rebound retry report</h1>",
        f"<pre>{html.escape(json.dumps(summary, indent=1))}</pre>",
    ]
    for name, pdf in tables.items():
        parts.append(f"<h2>{html.escape(name.replace('_', ' '))}</h2>")
        if name in charts:
            parts.append(f"<img src='{charts[name]}' alt='{name}'>")
        parts.append(pdf.to_html(index=False, na_rep="") if len(pdf) else "<p>(no data)</p>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    from pyspark.sql import functions as F

    source = facts_path(cfg)
    if not any(source.glob("date=*")):
        raise SystemExit(f"no facts under {source}; run `python -m pipeline facts` first")
    check_window(args.since, args.until)
    facts = facts_in_window(spark, source, args.since, args.until).cache()
    failed = None if args.skip_failed_topics else read_failed(spark, cfg, since=args.since, until=args.until).cache()
    tables = build_tables(facts, failed, args.top)
    msgs = messages(facts)
    summary = {
        "since": args.since.isoformat() if args.since else None,
        "until": args.until.isoformat() if args.until else None,
        "events": facts.count(),
        "messages": msgs.count(),
        "recovered": recovered(msgs).count(),
        "succeeded_first_try": msgs.where(F.col("success_attempt") == 0).count(),
        "never_recovered": int(tables["never_recovered"]["never_recovered"].sum()),
        "failed_topic_records": failed.count() if failed is not None else None,
    }
    out = cfg.out / "report"
    for name, pdf in tables.items():
        write_table(pdf, out / "tables", name)
    charts = render_charts(tables, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    render_html(tables, charts, summary, out / "index.html")
    print(f"report: {summary}; open {out / 'index.html'}")
    return {"summary": summary, "tables": tables, "charts": charts, "path": str(out)}
