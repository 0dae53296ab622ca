"""Two workers of one app on the embedded broker: cluster-wide backlog, key routing, admin dead-letter."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from demo.harness import Tail, produce
from tests.integration.conftest import Deployment, deploy

pytestmark = pytest.mark.broker
__all__ = ["deploy"]

TOKEN = "s3cret-token"
KEYS = [f"web-{index}" for index in range(8)]


def call(port: int, path: str, *, method: str = "GET", token: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None
    )
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def wait_for(what: str, check: Callable[[], Any], timeout: float, workers: list[Any]) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ValueError) as exc:  # web server not up yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.3)
    logs = "\n".join(worker.log_text()[-3000:] for worker in workers)
    raise AssertionError(f"{what}: not met in {timeout}s (last: {last!r})\n{logs}")


def owned(worker: Any) -> list[int]:
    """The partitions ``worker`` says it owns (none while its web view does not answer)."""
    status, body = call(worker.web_port, "/retry/backlog?scope=worker")
    return body["owned_partitions"] if status == 200 else []


def two_workers_each_owning_a_partition(deployment: Deployment) -> list[Any]:
    """Two workers started on ``deployment`` (two partitions), once each owns one."""
    workers = [deployment.start_worker("one"), deployment.start_worker("two")]
    wait_for("each worker owns one partition", lambda: all(owned(worker) for worker in workers), 40, workers)
    return workers


def test_two_workers_share_backlog_route_keys_and_admin_dead_letters(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="40s", REBOUND_ADMIN_TOKEN=TOKEN)
    workers = two_workers_each_owning_a_partition(deployment)
    one, two = workers
    asyncio.run(
        produce(
            deployment.broker.bootstrap,
            deployment.topic,
            [(key.encode(), json.dumps({"succeed_on": 5}).encode(), []) for key in KEYS],
        )
    )
    tier = f"{deployment.topic}.retry.40s"

    def cluster_total(worker: Any) -> Any:
        _, body = call(worker.web_port, "/retry/backlog")
        if body["tiers"][tier]["waiting"] == len(KEYS) and len(body["workers"]) == 2:
            return body
        return None

    views = [wait_for(f"cluster backlog on {w.web_port}", lambda w=w: cluster_total(w), 30, workers) for w in workers]
    for body in views:
        assert body["scope"] == "cluster" and body["partitions_missing"] == [] and body["stale_workers"] == []
        assert body["tiers"][tier]["overdue"] == 0 and 0 < body["tiers"][tier]["next_release_in_ms"] <= 40_000
    local = [call(w.web_port, "/retry/backlog?scope=worker")[1]["tiers"][tier]["waiting"] for w in workers]
    assert sum(local) == len(KEYS) and all(local), local  # parked on both workers

    # Keys owned by the other worker are answered through the table route.
    one_id = views[0]["this_worker"]
    answers = {key: call(one.web_port, f"/retry/keys/{key}") for key in KEYS}
    assert all(status == 200 and body["found"] for status, body in answers.values()), answers
    remote = [key for key, (_, body) in answers.items() if body["worker"] != one_id]
    assert remote, answers
    victim = remote[0]
    assert "value" not in answers[victim][1]["pending"][0]

    # Admin: refused without (or with a wrong) token, done with it, even when asked on the non-owning worker.
    path = f"/retry/admin/keys/{victim}/dead-letter"
    assert call(one.web_port, path, method="POST")[0] == 401
    assert call(one.web_port, path, method="POST", token="wrong")[0] == 401
    status, done = call(one.web_port, path, method="POST", token=TOKEN)
    assert status == 200 and done["count"] == 1, done
    assert call(two.web_port, f"/retry/keys/{victim}")[0] == 404

    async def failed_with_admin_reason() -> list[Any]:
        async with Tail(deployment.broker.bootstrap, [f"{deployment.topic}.failed"]) as tail:
            await tail.until(lambda seen: any(r.key == victim.encode() for r in seen), 20)
            return tail.records

    records = asyncio.run(failed_with_admin_reason())
    [dead] = [record for record in records if record.key == victim.encode()]
    assert dead.headers["rebound.reason"] == b"admin"
    assert dead.value == json.dumps({"succeed_on": 5}).encode()

    _, failed = call(two.web_port, "/retry/failed")
    summary = failed["topics"][f"{deployment.topic}.failed"]
    assert summary["depth"] == 1 and summary["by_reason"] == {"admin": 1}
    assert summary["latest"][0]["key"] == victim and "value" not in summary["latest"][0]

    html = fetch_text(one.web_port, "/dashboard/")
    assert "/retry/backlog" in html and "/retry/failed" in html and "/metrics" in html
    # Self-contained: nothing external (the SVG namespace is a name, never fetched).
    assert not any(scheme in html.replace("http://www.w3.org/2000/svg", "") for scheme in ("http://", "https://"))
    scraped = [metric_samples(fetch_text(w.web_port, "/metrics")) for w in workers]
    in_tier = frozenset({"topic": deployment.topic, "tier": "40s"}.items())
    assert scraped[1][("rebound_parked_total", in_tier)] == local[1]
    assert scraped[1][("rebound_tier_waiting", in_tier)] == local[1] - 1  # less the key dead-lettered above
    dead_lettered = frozenset({"action": "dead-letter"}.items())
    assert sum(s[("rebound_admin_actions_total", dead_lettered)] for s in scraped) == 1


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def fetch_text(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as response:
        return str(response.read().decode("utf-8"))
