"""A bare Faust agent: no-op handler, one output record per input (as Rebound emits one attempt event per message).

``BENCH_TOPIC`` in, ``BENCH_TOPIC.done`` out (value: processing time, epoch ms). The ceiling for any Faust app on
this broker and machine.

The app is ``_app.py``'s (Faust on Rebound's app and consumer classes: ``noop-ratio``'s ``bare-faust``), or with
``BENCH_STOCK_FAUST=1`` stock Faust's (``stock.py``: a plain ``faust.App``, Faust's consumer and producer path, only
the fetch wait set: ``noop-ratio``'s ``stock-faust``), which also prints the classes it runs once its consumer
fetches (and stops if any is not Faust's). The agent is the same in both.
"""

from __future__ import annotations

import os
import time

from bench.baselines._app import make_app, raw_topic
from bench.baselines.stock import make_stock_app, watch_path

STOCK = os.environ.get("BENCH_STOCK_FAUST") == "1"

app = make_stock_app() if STOCK else make_app()
source = raw_topic(app, os.environ["BENCH_TOPIC"])
done = raw_topic(app, os.environ["BENCH_TOPIC"] + ".done")


@app.agent(source)
async def bare(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        await done.send(
            key=event.key, value=str(time.time_ns() // 1_000_000).encode(), partition=event.message.partition
        )


if STOCK:
    watch_path(app)
