"""A bare Faust agent: no-op handler, one output record per input (as Rebound emits one attempt event per message).

``BENCH_TOPIC`` in, ``BENCH_TOPIC.done`` out (value: processing time, epoch ms). The ceiling for any Faust app on
this broker and machine.
"""

from __future__ import annotations

import os
import time

from bench.baselines._app import make_app, raw_topic

app = make_app()
source = raw_topic(app, os.environ["BENCH_TOPIC"])
done = raw_topic(app, os.environ["BENCH_TOPIC"] + ".done")


@app.agent(source)
async def bare(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        await done.send(
            key=event.key, value=str(time.time_ns() // 1_000_000).encode(), partition=event.message.partition
        )
