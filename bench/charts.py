"""PNG charts (matplotlib, Agg: no display on a build machine) and the summary table printed after a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def draw(name: str, payload: dict[str, Any], path: Path) -> None:
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
    bars = ax.bar(names, rates, color=[COLOURS.get(n.split("-c")[0], "tab:cyan") for n in names])
    ax.bar_label(bars, fmt="%.0f")
    s = payload["summary"]
    bare = payload["variants"]["bare-faust"]["summary"]["messages_per_s"]
    ax.axhline(bare * s["target"], color="red", ls="--", lw=1, label=f"target: {s['target']} of bare Faust")
    ax.set_ylabel("messages/s (drain of a backlog)")
    default = payload["params"]["default_concurrency"]
    default_text = "no such setting" if default is None else str(default)
    ax.set_title(
        f"No-op handler, {payload['params']['messages']} messages\nRebound / bare Faust: {s['rebound_vs_bare']}"
        f" at the default concurrency ({default_text}), {s['rebound_c1_vs_bare']} at concurrency 1",
        fontsize=9,
    )
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


def _rows(name: str, payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = _ordering_and_breaker_rows(name, payload)
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
        for variant, result in payload["variants"].items():
            rows.append((variant, "msg/s", f"{result['summary']['messages_per_s']}"))
        s = payload["summary"]
        rows.append(("rebound", "vs bare (default concurrency)", f"{s['rebound_vs_bare']} (target {s['target']})"))
        rows.append(("rebound-c1", "vs bare", f"{s['rebound_c1_vs_bare']}"))
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
