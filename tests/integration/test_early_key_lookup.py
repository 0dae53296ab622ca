"""A key lookup while a fresh worker starts must not make the broker create a changelog topic (``app/views.py``).

Brokers that create topics on a metadata request (Tansu, and Kafka's default) gave ``retry_state-changelog`` their
default partition count when ``/retry/keys/<key>`` asked for its metadata before Faust declared it; every later table
write then failed with Faust's ``PartitionsMismatch``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from app.views import NO_OWNER_YET, TABLES_STARTING
from tests.integration.conftest import Deployment


def get(port: int, path: str) -> tuple[int, dict[str, str], Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read() or b"null")


async def partition_count(bootstrap: str, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (description,) = await admin.describe_topics([topic])
        return len(description["partitions"])
    finally:
        await admin.close()


def test_a_key_lookup_during_start_up_answers_503_and_leaves_the_changelog_co_partitioned(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=2)
    worker = deployment.start_worker("early")
    answers: list[tuple[int, dict[str, str], Any]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            answers.append(get(worker.web_port, "/retry/keys/early"))
            if answers[-1][0] == 404:  # routed and looked up: the worker's tables are up
                break
        except OSError:  # the web server is not listening yet
            pass
        time.sleep(0.05)
    assert answers and answers[-1][0] == 404, answers[-3:]
    bootstrap = deployment.broker.bootstrap
    assert asyncio.run(partition_count(bootstrap, f"{deployment.app_id}-retry_state-changelog")) == 2
    time.sleep(2)
    assert "PartitionsMismatch" not in worker.log_text(), worker.log_text()[-3000:]
    early = [(headers, body) for status, headers, body in answers if status == 503]
    assert early, "no lookup landed before the worker's tables started"
    assert all(headers.get("Retry-After") for headers, _ in early), early
    assert {body["error"] for _, body in early} <= {TABLES_STARTING, NO_OWNER_YET}, early
