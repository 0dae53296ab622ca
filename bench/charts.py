"""PNG charts (matplotlib, Agg: no display on a build machine) and the summary table printed after a run.

matplotlib comes with ``make install`` (the ``pipeline`` extra), not with ``make demo``'s install: without it
``UNAVAILABLE`` says why, no chart is drawn, and the table, which needs none, is still printed.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

plt: Any
UNAVAILABLE: str | None = None  # why no chart can be drawn, or None
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as _pyplot

    plt = _pyplot
except ImportError as exc:  # not installed, or broken: the figures do not depend on it
    plt = None
    UNAVAILABLE = f"matplotlib cannot be imported ({exc})"


def draw(name: str, payload: dict[str, Any], path: Path) -> None:
    if UNAVAILABLE:
        raise RuntimeError(f"no chart for {name}: {UNAVAILABLE}")
    drawer = {
        "healthy-throughput": _throughput,
        "head-of-line": _head_of_line,
        "release-lag": _release_lag,
        "parked-memory": _parked_memory,
        "mixed-delays": _mixed_delays,
        "long-delay": _long_delay,
        "concurrency": _concurrency,
        "noop-ratio": _noop_ratio,
        "key-order": _key_order,
        "breaker-outage": _breaker_outage,
        "hot-key": _hot_key,
        "recovery": _recovery,
        "scale-parked": _scale_parked,
        "release-lateness": _release_lateness,
        "spark-read": _spark_read,
        "rebalance-memory": _rebalance_memory,
        "park-rate": _park_rate,
        "release-burst": _release_burst,
        "failure-path": _failure_path,
        "failure-mixed": _own_chart("bench.scenarios.failure_mixed"),
        "http-adaptive": _own_chart("bench.scenarios.http_adaptive"),
        "http-overhead": _own_chart("bench.scenarios.http_overhead"),
    }[name]
    fig = drawer(payload)
    fig.text(0.99, 0.01, _footer(payload), ha="right", va="bottom", fontsize=7, color="grey")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _footer(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    return f"{m['date']}  {m['cores']} cores  Python {m['python']}  faust {m['packages'].get('faust-streaming')}"


# one colour per design in every chart
COLOURS = {
    "rebound": "tab:blue",
    "sleep-until-due": "tab:orange",
    "blocking": "tab:green",
    "spring-pause": "tab:purple",
    "bare-faust": "tab:grey",
}


def _cdf(ax: Any, values: list[float], label: str, colour: str | None = None) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label, color=colour)


def _head_of_line(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    variants = payload["variants"]
    for name, result in variants.items():
        _cdf(left, [max(1, v) for v in result["raw"]["healthy_latency_ms"]], name, COLOURS.get(name))
    left.set_xscale("log")
    left.set_xlabel("healthy message end-to-end latency (ms, log)")
    left.set_ylabel("fraction of healthy messages")
    left.set_title("Latency of the healthy messages")
    left.legend()
    names = list(variants)
    rates = [variants[n]["summary"]["healthy_throughput_per_s"] for n in names]
    bars = right.bar(names, rates, color=[COLOURS.get(n, "tab:cyan") for n in names])
    right.bar_label(bars, fmt="%.1f")
    offered = payload["variants"][names[0]]["summary"]["offered_rate_per_s"]
    right.axhline(offered * (1 - payload["params"]["failing_pct"] / 100), color="grey", ls="--", lw=1)
    right.set_ylabel("healthy messages/s")
    p = payload["params"]
    right.set_title(f"Healthy throughput ({p['failing_pct']}% fail once, delay {p['delay_s']}s; dashed: offered)")
    return fig


def _mixed_delays(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    short, long = payload["params"]["retry_sequence_s"]
    for name, result in payload["variants"].items():
        colour = COLOURS.get(name)
        _cdf(left, [max(1, v) for v in result["raw"]["short_lateness_ms"]], name, colour)
        for key, marker, label in (("short_timeline", "o", f"{short}s"), ("long_timeline", "x", f"{long}s")):
            points = result["raw"][key]
            right.scatter(
                [p[0] for p in points],
                [max(1, p[1]) for p in points],
                s=14,
                marker=marker,
                color=colour,
                label=f"{name}, {label} retries",
            )
    left.set_xscale("log")
    left.set_xlabel(f"{short}s retry: call time - due time (ms, log)")
    left.set_ylabel(f"fraction of {short}s retries")
    left.set_title(f"Retries due in {short}s, sharing the retry path with {long}s ones")
    left.legend()
    right.set_yscale("log")
    right.set_xlabel("due time (s after the stream started)")
    right.set_ylabel("call time - due time (ms, log)")
    right.set_title("Each retry's lateness by its due time")
    right.legend(fontsize=7)
    return fig


def _long_delay(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(payload["variants"])
    figures = ("revocations_after_ready", "assignments_after_ready", "duplicate_calls", "group_log_lines")
    width = 0.8 / len(names)
    for n, name in enumerate(names):
        s = payload["variants"][name]["summary"]
        bars = left.bar([i + n * width for i in range(len(figures))], [s[f] for f in figures], width, label=name)
        left.bar_label(bars, fmt="%d")
    left.set_ylim(bottom=0, top=max(1, *(payload["variants"][n]["summary"][f] for n in names for f in figures)) * 1.2)
    left.set_ylabel("count")
    left.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(figures))])
    left.set_xticklabels(["revoked", "assigned", "duplicate calls", "group log lines"], fontsize=8)
    p = payload["params"]
    left.set_title(f"Sleeping {p['delay_s']}s with max.poll.interval {p['max_poll_interval_s']:g}s")
    left.legend()
    for name in names:
        _cdf(right, [max(1, v) for v in payload["variants"][name]["raw"]["lateness"]], name)
    right.set_xscale("log")
    right.set_xlabel("retry call time - due time (ms, log)")
    right.set_ylabel("fraction of retries")
    right.set_title("Retry lateness")
    right.legend()
    return fig


def _throughput(payload: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(payload["variants"])
    rates = [payload["variants"][n]["summary"]["messages_per_s"] for n in names]
    bars = ax.bar(names, rates, color=["tab:blue", "tab:grey", "tab:cyan"][: len(names)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("messages/s (drain of a backlog)")
    ax.set_title(f"All succeed: {payload['params']['messages']} messages, {payload['params']['partitions']} partitions")
    return fig


def _concurrency(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    p = payload["params"]
    variants = payload["variants"]
    rebound = sorted(
        (v["summary"] for v in variants.values() if v["summary"]["concurrency"] is not None),
        key=lambda s: s["concurrency"],
    )
    levels = [s["concurrency"] for s in rebound]
    left.plot(levels, [s["messages_per_s"] for s in rebound], marker="o", color=COLOURS["rebound"], label="Rebound")
    for s in rebound:
        bad = s["order"]["violations"]
        left.annotate(
            f"{s['messages_per_s']:.0f}" + (f"\n{bad} order violations" if bad else ""),
            (s["concurrency"], s["messages_per_s"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
            color="red" if bad else "black",
        )
    left.plot(
        levels, [s["ideal_per_s"] for s in rebound], ls=":", color="grey", label="ideal: min(level, keys) / 20 ms"
    )
    bare = variants.get("bare-faust")
    if bare:
        rate = bare["summary"]["messages_per_s"]
        left.axhline(
            rate, ls="--", color=COLOURS["bare-faust"], label=f"bare Faust agent, concurrency 1 ({rate:.0f}/s)"
        )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(levels)
    left.set_xticklabels([str(level) for level in levels])
    left.set_xlabel("REBOUND_CONCURRENCY")
    left.set_ylabel("messages/s (log)")
    left.set_title(
        f"{p['handler_ms']} ms I/O handler: {p['messages']} messages, {p['keys']} keys, {p['partitions']} partitions"
    )
    left.legend(fontsize=8)
    worker = [s["cpu_pct_one_core"]["worker"] for s in rebound]
    broker = [s["cpu_pct_one_core"]["broker"] for s in rebound]
    right.plot(levels, worker, marker="o", color=COLOURS["rebound"], label="worker")
    right.plot(levels, broker, marker="s", color="tab:brown", label="broker")
    right.plot(levels, [w + b for w, b in zip(worker, broker, strict=True)], ls="--", color="black", label="both")
    if bare:
        right.axhline(
            bare["summary"]["cpu_pct_one_core"]["worker"],
            ls="--",
            color=COLOURS["bare-faust"],
            label="bare Faust worker",
        )
    right.axhline(100, color="red", lw=0.8)
    right.axhline(200, color="red", lw=0.8, ls=":")
    right.set_xscale("log", base=2)
    right.set_xticks(levels)
    right.set_xticklabels([str(level) for level in levels])
    right.set_ylim(bottom=0)
    right.set_xlabel("REBOUND_CONCURRENCY")
    right.set_ylabel("CPU while draining (% of one core; 2 cores)")
    right.set_title("Where CPU becomes the limit")
    right.legend(fontsize=8)
    return fig


def _noop_ratio(payload: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = list(payload["variants"])
    rates = [payload["variants"][n]["summary"]["messages_per_s"] for n in names]
    colours = {**COLOURS, "stock-faust": "tab:brown"}
    bars = ax.bar(names, rates, color=[colours.get(n.split("-c")[0], "tab:cyan") for n in names])
    ax.bar_label(bars, fmt="%.0f")
    s = payload["summary"]
    against = s.get("target_against", "bare-faust")
    base = payload["variants"][against]["summary"]["messages_per_s"]
    ax.axhline(base * s["target"], color="red", ls="--", lw=1, label=f"target: {s['target']} of {against}")
    ax.set_ylabel("messages/s (drain of a backlog), median of the rounds")
    default = payload["params"]["default_concurrency"]
    default_text = "no such setting" if default is None else str(default)
    lines = [f"No-op handler, {payload['params']['messages']} messages, default concurrency {default_text}"]
    for baseline, key in (("stock Faust", "stock"), ("Faust on Rebound's app and consumer", "bare")):
        if s.get(f"rebound_vs_{key}") is not None:
            cpu = (s.get(f"rebound_vs_{key}_cpu") or {}).get("median")
            c1 = s.get(f"rebound_c1_vs_{key}")
            line = f"Rebound / {baseline}: {s[f'rebound_vs_{key}']} by rate, {cpu} by CPU"
            lines.append(line + ("" if c1 is None else f" ({c1} at concurrency 1)"))
    ax.set_title("\n".join(lines), fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _key_order(payload: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    modes = list(payload["variants"])
    rates = [payload["variants"][m]["summary"]["free_keys_per_s"] for m in modes]
    labels = {
        "none": "ordering=none",
        "key": "ordering=key\n20 keys blocked",
        "key-nothing-blocked": "ordering=key\nnothing blocked",
    }
    colours = ["tab:grey", "tab:blue", "tab:cyan"]
    bars = ax.bar([labels.get(m, m) for m in modes], rates, color=colours[: len(modes)])
    ax.bar_label(bars, fmt="%.0f")
    held = payload["variants"].get("key", {}).get("summary", {}).get("held")
    p = payload["params"]
    ax.set_ylabel("free keys' messages/s")
    ax.set_title(
        f"{p['messages']} messages, {p['blocked_keys']} keys blocked by a 1-minute retry ({held} held in key mode)\n"
        f"free keys' throughput vs unordered: {payload['summary']['key_vs_none']} with keys blocked, "
        f"{payload['summary'].get('key_nothing_blocked_vs_none', '-')} with nothing blocked",
        fontsize=9,
    )
    return fig


def _breaker_outage(payload: dict[str, Any]) -> Any:
    variants = payload["variants"]
    fig, axes = plt.subplots(len(variants), 1, figsize=(10, 3.2 * len(variants)), sharex=True)
    for ax, (name, result) in zip(axes, variants.items(), strict=True):
        ok, failed = result["timeline"]["ok"], result["timeline"]["failed"]
        seconds = list(range(len(ok)))
        ax.bar(seconds, ok, width=1.0, color="tab:green", label="handler calls succeeded")
        ax.bar(seconds, failed, width=1.0, bottom=ok, color="tab:red", label="handler calls failed")
        start, end = result["outage_s"]
        ax.axvspan(start, end, color="grey", alpha=0.2, label="dependency down")
        for index, (opened, closed) in enumerate(result["open_periods_s"]):
            ax.axvspan(
                opened, closed, ymin=0.92, ymax=1.0, color="tab:purple", label="breaker open" if not index else None
            )
        s = result["summary"]
        ax.set_title(
            f"{name}: {s['succeeded']} succeeded, {s['dead_lettered']} dead-lettered of {s['messages']}; "
            f"{s['handler_calls']} handler calls",
            fontsize=9,
        )
        ax.set_ylabel("calls per second")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("seconds since the stream started")
    return fig


def _release_lag(payload: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    lags = payload["raw"]["lag_ms"]
    if lags:
        ax.hist(lags, bins=40, color="tab:blue")
    s = payload["summary"]["lag_ms"]
    ax.axvline(0, color="red", lw=1)
    ax.set_xlabel("handler call time - due time (ms)")
    ax.set_ylabel("retries")
    ax.set_title(f"Release lag: p50 {s['p50']} / p99 {s['p99']} / max {s['max']} ms, min {s['min']} ms")
    return fig


def _parked_memory(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = payload["levels"]
    parked = [lv["parked"] for lv in levels]
    left.plot(parked, [lv["rss_mib"] for lv in levels], marker="o", label="VmRSS")
    left.set_xlabel("messages parked")
    left.set_ylabel("worker RSS (MiB)")
    left2 = left.twinx()
    left2.plot(parked, [lv["idle_cpu_pct"] for lv in levels], marker="s", color="tab:red", label="idle CPU")
    left2.set_ylabel("worker CPU while idle (% of one core)", color="tab:red")
    left2.set_ylim(bottom=0, top=max(5.0, 2 * max(lv["idle_cpu_pct"] for lv in levels)))
    left.set_ylim(bottom=0)
    left.set_title("Worker memory and idle CPU by parked messages")
    micro = payload["tick_micro"]
    for due in sorted({row["due"] for row in micro}):
        rows = [row for row in micro if row["due"] == due]
        right.plot([r["parked"] for r in rows], [r["pop_due_us"] for r in rows], marker="o", label=f"{due} due")
    right.set_xscale("symlog", linthresh=1000)
    right.set_yscale("log")
    right.set_xlabel("messages parked (symlog)")
    right.set_ylabel("ReleaseSchedule.pop_due per tick (µs, log)")
    right.set_title("Tick cost follows what is due, not what is parked")
    right.legend()
    return fig


def _park_rate(payload: dict[str, Any]) -> Any:
    variants = payload["variants"]
    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4.2), squeeze=False)
    for ax, (name, result) in zip(axes[0], variants.items(), strict=True):
        trace, s = result["raw"]["trace"], result["summary"]
        if s["forward_per_s"] is not None:
            ax.plot([row["t"] for row in trace], [row["scheduled"] for row in trace], label="forwarded to the tier")
        ax.plot([row["t"] for row in trace], [row["parked"] for row in trace], label="parked")
        ax.set_xlabel("s since production began")
        ax.set_ylabel("messages")
        ax.set_title(f"{name}: park {s['park_per_s']} msg/s, forward {s['forward_per_s']} msg/s", fontsize=10)
        ax.legend()
    return fig


def _failure_path(payload: dict[str, Any]) -> Any:
    runs = payload["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        trace, s = run["raw"]["failing"], run["summary"]
        for stage, label in (("forward", "forwarded"), ("park", "parked"), ("release", "released")):
            ax.plot([row["t"] for row in trace], [row[stage] for row in trace], label=label)
        ax.set_xlabel("s since the failing messages were produced")
        ax.set_ylabel("messages")
        ratios = ", ".join(f"{stage} {s[f'{stage}_of_first_try']}" for stage in ("forward", "park", "release"))
        ax.set_title(
            f"{run.get('variant', 'rebound')} {run['commit']} r{run['round']}: first try {s['first_try_per_s']}/s; {ratios}",
            fontsize=8,
        )
        ax.legend()
    return fig


def _release_burst(payload: dict[str, Any]) -> Any:
    from bench.scenarios.release_burst import chart

    return chart(payload, plt)


def _rebalance_memory(payload: dict[str, Any]) -> Any:
    variants = payload["variants"]
    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4.2), squeeze=False)
    for ax, (name, result) in zip(axes[0], variants.items(), strict=True):
        series = result["rss_series"]
        ax.plot([at for at, _ in series], [kib / 1024 for _, kib in series], label="first worker VmRSS")
        for phase in result["phases"][1:]:
            joined = phase["phase"].startswith("second worker in")
            ax.axvline(phase["from_s"], color="tab:green" if joined else "tab:red", linestyle=":", linewidth=1)
        ax.set_xlabel("s since start (dotted: second worker joins / leaves)")
        ax.set_ylabel("RSS (MiB)")
        ax.set_ylim(bottom=0)
        s = result["summary"]
        ax.set_title(
            f"{name}: backlog {s['backlog_mib']} MiB\npeak {s['rss_mib_peak']} MiB, most held {s['held_most_per_partition']}",
            fontsize=10,
        )
        ax.legend()
    return fig


def _hot_key(payload: dict[str, Any]) -> Any:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    size = payload["params"]["bucket_size"]
    styles = {
        "hot-key": ("tab:red", "o"),
        "distinct-keys": ("tab:blue", "s"),
        "distinct-keys-one-partition": ("tab:green", "^"),
    }
    for name, result in payload["variants"].items():
        colour, marker = styles.get(name, ("tab:grey", "x"))
        park, settle = result["park"], result["settle"]
        backlog_park = [row["backlog_after"] for row in park]
        backlog_settle = [row["backlog_after"] + size for row in settle]
        for ax, rows, xs in ((axes[0], park, backlog_park), (axes[1], settle, backlog_settle)):
            ax.plot(xs, [r["cpu_ms_per_msg"] for r in rows], marker=marker, color=colour, label=f"{name}: worker")
            ax.plot(xs, [r["broker_cpu_ms_per_msg"] for r in rows], ls=":", marker=marker, color=colour, label="broker")
        axes[2].plot(backlog_park, [r["changelog_bytes_per_msg"] for r in park], marker=marker, color=colour)
        axes[2].plot(backlog_settle, [r["changelog_bytes_per_msg"] for r in settle], ls="--", color=colour)
        axes[2].plot([], [], marker=marker, color=colour, label=f"{name}: park (solid), settle (dashed)")
    p = payload["params"]
    axes[0].set_title(f"Park: first try + park, {size} messages a bucket", fontsize=9)
    axes[1].set_title(f"Settle: release + handler + settle ({p['retry_sequence']} delay)", fontsize=9)
    axes[2].set_title("Changelog written (key + value bytes)", fontsize=9)
    for ax in axes[:2]:
        ax.set_ylabel("CPU ms per message (bucket)")
    axes[2].set_ylabel("changelog bytes per message")
    for ax in axes:
        ax.set_xlabel("messages parked on the key(s) after the bucket (park) / before it (settle)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return fig


def _recovery(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(payload["variants"])
    figures = (
        ("group_joined_s", "group joined"),
        ("adopted_s", "schedule adopted\n(log line, N parked)"),
        ("first_new_message_s", "first new message\nhandled"),
        ("first_due_run_s", "first due message\nran"),
    )
    width = 0.8 / len(names)
    for n, name in enumerate(names):
        s = payload["variants"][name]["summary"]
        values = [s.get(key) for key, _label in figures]
        bars = left.bar(
            [i + n * width for i in range(len(figures))],
            [value or 0 for value in values],
            width,
            label=f"{name} ({s['parked']} parked)",
        )
        left.bar_label(bars, labels=["-" if value is None else f"{value:.1f}" for value in values])
    left.axhline(payload["params"]["target_s"], color="red", ls="--", lw=1, label="target: first due message")
    left.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(figures))])
    left.set_xticklabels([label for _key, label in figures], fontsize=8)
    left.set_ylabel("seconds after the fresh worker started")
    left.set_title("Takeover by a worker with an empty data directory after SIGKILL", fontsize=9)
    left.legend(fontsize=8)
    parked = payload["variants"][names[-1]]
    timeline = parked.get("timeline", [])
    points = [(t, v) for t, v, _cpu in timeline if v is not None]
    if points:
        right.step([t for t, _v in points], [v for _t, v in points], where="post", color="tab:blue")
    for label, key, colour in (
        ("adopted", "adopted_s", "tab:green"),
        ("first due ran", "first_due_run_s", "tab:red"),
        ("first due time", "first_due_at_s", "tab:grey"),
    ):
        value = parked["summary"].get(key)
        if value is not None:
            right.axvline(value, color=colour, ls="--", lw=1, label=f"{label} ({value:.1f} s)")
    right.set_xlabel("seconds after the fresh worker started")
    right.set_ylabel("fresh worker's rebound_scheduled_waiting")
    right.set_title(
        f"{parked['summary']['parked']} parked, {parked['summary']['changelog_mib']} MiB of changelog to read",
        fontsize=9,
    )
    right.legend(fontsize=8)
    return fig


def _hot_key_and_recovery_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    if name == "hot-key":
        for variant, result in payload["variants"].items():
            for phase in ("park", "settle"):
                s = result["summary"][phase]
                rows.append(
                    (
                        variant,
                        f"{phase} CPU ms/msg first/last bucket",
                        f"{s['cpu_ms_per_msg_first']}/{s['cpu_ms_per_msg_last']} "
                        f"(x{s['cpu_ms_per_msg_last_vs_first']})",
                    )
                )
                rows.append(
                    (
                        variant,
                        f"{phase} changelog B/msg first/last",
                        f"{s['changelog_bytes_per_msg_first']}/{s['changelog_bytes_per_msg_last']}",
                    )
                )
        rows.append(("all", "verdict", payload["verdict"]))
    elif name == "recovery":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            rows.append((variant, "parked / adopted", f"{s['parked']} / {s['adopted_parked']}"))
            rows.append((variant, "joined / changelog read s", f"{s['group_joined_s']} / {s['changelog_read_s']}"))
            rows.append((variant, "adopted s / first new msg s", f"{s['adopted_s']} / {s['first_new_message_s']}"))
            if s.get("first_due_run_s") is not None:
                rows.append((variant, "first due message ran s", f"{s['first_due_run_s']}"))
            rows.append((variant, "changelog read", f"{s['changelog_records']} records, {s['changelog_mib']} MiB"))
        rows.append(("all", "verdict", payload["verdict"]))
    return rows


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("scenario", "variant", "figure", "value")]
    for name, payload in results.items():
        for variant, figure, value in _rows(name, payload):
            rows.append((name, variant, figure, value))
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    return "\n".join("  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)) for row in rows)


def _ordering_and_breaker_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    if name == "key-order":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            rows.append((f"ordering={variant}", "free keys msg/s", f"{s['free_keys_per_s']}"))
            rows.append((f"ordering={variant}", "held / blocked keys", f"{s['held']} / {s['blocked_keys']}"))
        rows.append(("key", "vs none", f"{payload['summary']['key_vs_none']}"))
    elif name == "breaker-outage":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            rows.append((variant, "succeeded / dead-lettered", f"{s['succeeded']} / {s['dead_lettered']}"))
            rows.append((variant, "handler calls", f"{s['handler_calls']}"))
            if s["breaker_opens"] is not None:
                rows.append(
                    (
                        variant,
                        "opens / probes / held s",
                        f"{s['breaker_opens']} / {s['breaker_probes']} / {s['breaker_held_s']}",
                    )
                )
    return rows


def _park_rate_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    if name != "park-rate":
        return []
    rows = []
    for variant, result in payload["variants"].items():
        s = result["summary"]
        rows.append((variant, "forward / park msg/s", f"{s['forward_per_s']} / {s['park_per_s']}"))
        rows.append((variant, "all parked after s", f"{s['all_parked_after_s']}"))
    return rows


def _rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = _ordering_and_breaker_rows(name, payload) + _scale_and_lateness_rows(name, payload)
    rows += _hot_key_and_recovery_rows(name, payload) + _spark_read_rows(name, payload)
    rows += _rebalance_memory_rows(name, payload) + _park_rate_rows(name, payload)
    if name in _OWN_MODULES:
        rows += _own_rows(name, payload)
    if name == "head-of-line":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            lat = s["healthy_latency_ms"]
            bound = " (lower bound)" if s["healthy_latency_is_lower_bound"] else ""
            rows.append((variant, "healthy done", f"{s['healthy_done']}/{s['healthy_total']}"))
            rows.append((variant, "healthy msg/s", f"{s['healthy_throughput_per_s']}"))
            rows.append((variant, "healthy latency p50/p99 ms", f"{lat['p50']}/{lat['p99']}{bound}"))
            rows.append((variant, "retried done", f"{s['retried_done']}/{s['retried_total']}"))
    elif name == "mixed-delays":
        short, long = payload["params"]["retry_sequence_s"]
        for variant, result in payload["variants"].items():
            s = result["summary"]
            for delay in (short, long):
                d = s[f"retry_{delay}s_lateness_ms"]
                late = f"{d['p50']}/{d['p99']}/{d['max']}"
                rows.append((variant, f"{delay}s retry late p50/p99/max ms", late))
            rows.append((variant, "healthy p99 ms", f"{s['healthy_latency_ms']['p99']}"))
            rows.append((variant, "done", f"{s['done']}/{s['total']}"))
    elif name == "long-delay":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            rows.append(
                (
                    variant,
                    "revoked/assigned after ready",
                    f"{s['revocations_after_ready']}/{s['assignments_after_ready']}",
                )
            )
            rows.append((variant, "duplicate calls", f"{s['duplicate_calls']}"))
            rows.append((variant, "done", f"{s['done']}/{s['total']}"))
            late = s["retry_lateness_ms"]
            rows.append((variant, "retry late p50/p99/max ms", f"{late['p50']}/{late['p99']}/{late['max']}"))
    elif name == "concurrency":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            cpu = s["cpu_pct_one_core"]
            rows.append((variant, "msg/s", f"{s['messages_per_s']} (ideal {s['ideal_per_s']})"))
            rows.append((variant, "CPU % worker/broker", f"{cpu['worker']}/{cpu['broker']}"))
            rows.append((variant, "in flight mean/max", f"{s['in_flight_mean']}/{s['in_flight_max']}"))
            rows.append((variant, "order violations", f"{s['order']['violations']} ({s['messages']} done)"))
        rows.append(("all", "verdict", payload["verdict"]))
    elif name == "noop-ratio":
        rows += _noop_ratio_rows(payload)
    elif name == "healthy-throughput":
        for variant, result in payload["variants"].items():
            rows.append((variant, "msg/s", f"{result['summary']['messages_per_s']}"))
    elif name == "release-lag":
        s = payload["summary"]["lag_ms"]
        rows.append(
            ("rebound", "lag ms min/p50/p90/p99/max", f"{s['min']}/{s['p50']}/{s['p90']}/{s['p99']}/{s['max']}")
        )
        rows.append(("rebound", "verdict", payload["verdict"]))
    elif name == "parked-memory":
        for lv in payload["levels"]:
            rows.append(
                ("rebound", f"{lv['parked']} parked", f"RSS {lv['rss_mib']} MiB, idle CPU {lv['idle_cpu_pct']}%")
            )
        for row in payload["tick_micro"]:
            rows.append(("schedule", f"pop_due {row['parked']} parked {row['due']} due", f"{row['pop_due_us']} µs"))
    return rows


def _rebalance_memory_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    if name != "rebalance-memory":
        return []
    rows = []
    for variant, s in payload["summary"].items():
        rows.append((variant, "RSS MiB alone / peak", f"{s['rss_mib_alone_max']} / {s['rss_mib_peak']}"))
        rows.append((variant, "most held of a partition", f"{s['held_most_per_partition']}"))
    return rows


def _scale_parked(payload: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = payload["levels"]
    parked = [max(1, lv["parked"]) for lv in levels]
    samples = payload["raw"]["fill_samples"]
    if samples:
        left.plot(
            [max(1, s["parked"]) for s in samples],
            [s["rss_mib"] for s in samples],
            color="tab:blue",
            alpha=0.35,
            lw=1,
            label="worker VmRSS while filling",
        )
    left.plot(parked, [lv["rss_mib"] for lv in levels], marker="o", color="tab:blue", label="worker VmRSS (idle)")
    left.plot(parked, [lv["hwm_mib"] for lv in levels], marker="^", ls="--", color="tab:blue", label="worker VmHWM")
    left.plot(parked, [lv["broker_rss_mib"] for lv in levels], marker="s", color="tab:brown", label="broker VmRSS")
    left.plot(parked, [lv["data_dir_mib"] for lv in levels], marker="x", color="tab:green", label="data dir on disk")
    left.axhline(payload["params"]["target_rss_mib"], color="red", ls=":", lw=1, label="target: worker 1 GiB")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("messages parked (log; 0 drawn at 1)")
    left.set_ylabel("MiB (log)")
    left.set_title("Memory and disk by parked messages", fontsize=9)
    left.legend(fontsize=7)
    names = [f"{lv['parked']:,}" for lv in levels]
    bars = right.bar(names, [lv["idle_cpu_cores"] * 100 for lv in levels], color="tab:red")
    right.bar_label(bars, fmt="%.1f%%", fontsize=8)
    right.set_ylabel("worker CPU while idle (% of one core)", color="tab:red")
    right.set_xlabel("messages parked")
    rates = [lv.get("park_rate_per_s") for lv in levels]
    right2 = right.twinx()
    right2.plot(
        [n for n, r in zip(names, rates, strict=True) if r],
        [r for r in rates if r],
        marker="o",
        color="black",
        label="park rate filling the level",
    )
    right2.set_ylabel("messages parked per second")
    right2.set_ylim(bottom=0)
    right2.legend(fontsize=7, loc="upper right")
    right.set_ylim(bottom=0, top=max(5.0, 2 * max(lv["idle_cpu_cores"] * 100 for lv in levels)))
    right.set_title("Idle CPU at each level, and the rate it was filled at", fontsize=9)
    return fig


def _release_lateness(payload: dict[str, Any]) -> Any:
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.4))
    p = payload["params"]
    colours = ["tab:blue", "tab:grey"]
    right2 = right.twinx()
    for (name, result), colour in zip(payload["variants"].items(), colours, strict=False):
        late = result["summary"]["lateness_ms"]
        label = f"{name}: p50 {late['p50']} / p99 {late['p99']} / max {late['max']} ms"
        _cdf(left, [max(1, v) for v in result["raw"]["lateness_ms"]], label, colour)
        seconds = [t["second"] for t in result["timeline"]]
        middle.plot(seconds, [max(1, t["p99"] or 1) for t in result["timeline"]], color=colour, label=f"{name} p99")
        middle.plot(
            seconds, [max(1, t["p50"] or 1) for t in result["timeline"]], color=colour, ls=":", label=f"{name} p50"
        )
        rates = result["calls_per_s"]
        right.plot(range(len(rates)), rates, color=colour, label=f"{name}: releases run")
        cpu = result.get("cpu_timeline", [])
        right2.plot(
            [r["t_s"] for r in cpu], [r["other"] for r in cpu], color=colour, ls="--", lw=1, label=f"{name}: other"
        )
    left.axvline(p["target_p99_ms"], color="red", ls="--", lw=1, label=f"target p99 {p['target_p99_ms']} ms")
    left.set_xscale("log")
    left.set_xlabel("handler call time - due time (ms, log)")
    left.set_ylabel("fraction of releases")
    left.set_title(
        f"{p['rate_per_s']:.0f} due/s for {p['window_s']} s; {p['parked_total']:,} parked vs the stream alone",
        fontsize=9,
    )
    left.legend(fontsize=7)
    middle.axhline(p["target_p99_ms"], color="red", ls="--", lw=1)
    middle.set_yscale("log")
    middle.set_xlabel("due time (s after the first due time)")
    middle.set_ylabel("lateness of the messages due in that second (ms, log)")
    middle.set_title("Lateness through the window", fontsize=9)
    middle.legend(fontsize=7)
    right.axhline(p["rate_per_s"], color="red", ls=":", lw=1)
    right.set_xlabel("s after the first due time")
    right.set_ylabel("releases run per second (solid)")
    right.set_ylim(bottom=0)
    right2.set_ylabel("CPU of other processes, cores (dashed)")
    right2.set_ylim(0, 2)
    right.set_title("Release rate, and what else used the 2 cores", fontsize=9)
    right.legend(fontsize=7, loc="lower left")
    return fig


def _scale_and_lateness_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    if name == "scale-parked":
        for lv in payload["levels"]:
            rate = f", parked at {lv['park_rate_per_s']}/s" if lv.get("park_rate_per_s") else ""
            rows.append(
                (
                    "rebound",
                    f"{lv['parked']} parked",
                    f"RSS {lv['rss_mib']} MiB (peak {lv['hwm_mib']}), idle {lv['idle_cpu_cores']} cores, "
                    f"disk {lv['data_dir_mib']} MiB, broker {lv['broker_rss_mib']} MiB{rate}",
                )
            )
        rows.append(("rebound", "verdict", payload["verdict"]))
    elif name == "release-lateness":
        for variant, result in payload["variants"].items():
            s = result["summary"]
            late = s["lateness_ms"]
            rows.append(
                (
                    variant,
                    "lateness ms p50/p95/p99/max",
                    f"{late['p50']}/{late['p95']}/{late['p99']}/{late['max']} ({s['negative']} negative)",
                )
            )
            rows.append((variant, "released / parked at start", f"{s['released']} / {s['parked_at_window_start']}"))
        rows.append(("all", "verdict", payload["verdict"]))
    return rows


def _spark_read(payload: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(payload["variants"])
    rates = [payload["variants"][n]["summary"]["mb_per_s"] for n in names]
    bars = ax.bar(names, rates, color=["tab:orange", "tab:grey"][: len(names)])
    ax.bar_label(
        bars,
        labels=[
            f"{r:.0f} MB/s\n{payload['variants'][n]['summary']['seconds']} s" for n, r in zip(names, rates, strict=True)
        ],
    )
    raw = payload["variants"]["raw-aiokafka"]["summary"]["mb_per_s"]
    target = payload["summary"]["target"]
    ax.axhline(
        raw / target,
        color="red",
        ls="--",
        lw=1,
        label=f"target: Spark time <= {target} x raw (Spark bar above the line)",
    )
    ax.set_ylabel("value MB/s (count + sum of value lengths)")
    p = payload["params"]
    ax.set_title(
        f"{p['messages']:,} records of {p['record_bytes']} B, {p['partitions']} partitions, Spark {p['spark_master']}\n"
        f"Spark / raw aiokafka time: {payload['summary']['spark_vs_raw_time']}",
        fontsize=9,
    )
    ax.set_ylim(top=max(rates) * 1.25)
    ax.legend(fontsize=8)
    return fig


def _noop_ratio_rows(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = [
        (variant, "msg/s", f"{result['summary']['messages_per_s']}") for variant, result in payload["variants"].items()
    ]
    s = payload["summary"]
    for key, baseline in (("stock", "stock-faust"), ("bare", "bare-faust")):
        if s.get(f"rebound_vs_{key}") is not None:
            rows.append(("rebound", f"vs {baseline}", f"{s[f'rebound_vs_{key}']}"))
        if s.get(f"rebound_c1_vs_{key}") is not None:
            rows.append(("rebound-c1", f"vs {baseline}", f"{s[f'rebound_c1_vs_{key}']}"))
    rows.append(("rebound", f"target vs {s.get('target_against', 'bare-faust')}", f"{s['target_met']}"))
    return rows


def _spark_read_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    if name != "spark-read":
        return []
    rows = []
    for variant, result in payload["variants"].items():
        s = result["summary"]
        rows.append((variant, "s / MB/s", f"{s['seconds']} / {s['mb_per_s']}"))
    summary = payload["summary"]
    rows.append(("spark", "vs raw (time)", f"{summary['spark_vs_raw_time']} (target {summary['target']})"))
    return rows


_OWN_MODULES = {  # a scenario whose module builds its own table rows (``rows(payload)``)
    "failure-path": "bench.scenarios.failure_path",
    "release-burst": "bench.scenarios.release_burst",
    "http-adaptive": "bench.scenarios.http_adaptive",
    "http-overhead": "bench.scenarios.http_overhead",
    "failure-mixed": "bench.scenarios.failure_mixed",
}


def _own_chart(module: str) -> Any:
    """A scenario that draws its own chart (``chart(payload)`` in its module), imported only when drawn."""

    def draw_it(payload: dict[str, Any]) -> Any:
        return importlib.import_module(module).chart(payload)

    return draw_it


def _own_rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = importlib.import_module(_OWN_MODULES[name]).rows(payload)
    return rows
