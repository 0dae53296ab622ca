"""No-op ratio: Rebound's healthy throughput as a fraction of a bare Faust agent's, with and without concurrency.

The ``healthy-throughput`` measurement (``bench/scenarios/throughput.py``, whose ``run_variant`` this reuses): a
backlog produced before the worker starts, all succeeding, rate from the first to the last output record. Three runs
on one broker, one after the other: Rebound at its default concurrency (``REBOUND_CONCURRENCY`` left unset), Rebound
with ``REBOUND_CONCURRENCY=1``, and the bare Faust agent doing the least a healthy message costs (consume, call a
no-op, produce one small record). The figure is the ratio Rebound / bare, default and at 1; the target is 0.9. It
is reported, never enforced: the machine is shared, and one run's ratio moves by several hundredths.
"""

from __future__ import annotations

import os
from typing import Any

from bench.scenarios.base import PARTITIONS, Context
from bench.scenarios.throughput import run_variant
from rebound.embedded_broker import EmbeddedBroker

TARGET = 0.9
VARIANTS: dict[str, dict[str, str]] = {
    "rebound": {},  # the worker's default concurrency
    "rebound-c1": {"REBOUND_CONCURRENCY": "1"},
    "bare-faust": {},
}


def default_concurrency() -> int | None:
    """What the worker runs with when the variable is unset (None: this Rebound has no such setting yet)."""
    from rebound.settings import Settings

    field = Settings.model_fields.get("concurrency")
    return None if field is None else field.default


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=20_000, quick=2_000)
    inherited = os.environ.get("REBOUND_CONCURRENCY")
    if inherited is not None:
        print(f"  noop-ratio: REBOUND_CONCURRENCY={inherited} in the environment is the 'default' run's", flush=True)
    variants = {}
    for variant, env in VARIANTS.items():
        variants[variant] = run_variant(ctx, broker, variant, count, **env)
        print(f"  noop-ratio {variant}: {variants[variant]['summary']}", flush=True)
    bare = max(1e-9, variants["bare-faust"]["summary"]["messages_per_s"])
    ratio = variants["rebound"]["summary"]["messages_per_s"] / bare
    ratio_c1 = variants["rebound-c1"]["summary"]["messages_per_s"] / bare
    return {
        "params": {
            "messages": count,
            "partitions": PARTITIONS,
            "default_concurrency": default_concurrency(),
            "inherited_REBOUND_CONCURRENCY": inherited,
        },
        "variants": variants,
        "summary": {
            "rebound_vs_bare": round(ratio, 2),
            "rebound_c1_vs_bare": round(ratio_c1, 2),
            "target": TARGET,
            "target_met": ratio >= TARGET,
        },
    }
