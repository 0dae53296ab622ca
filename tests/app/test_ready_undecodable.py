"""``/ready`` while a partition is stopped at a record batch that cannot be decoded (``app/views.py``)."""

from __future__ import annotations

from types import SimpleNamespace

from app.views import ready_answer, undecodable_now
from rebound.undecodable import UndecodableBatches


def test_ready_is_503_and_names_each_stopped_partition() -> None:
    batches = UndecodableBatches()
    batches.failed("items", 3, 1500, 1502, "CorruptRecordException('Invalid CRC')", now=0.0, now_ms=9)
    app = SimpleNamespace(_consumer=SimpleNamespace(_thread=SimpleNamespace(undecodable=batches)))
    body, status = ready_answer(
        rebalancing=False, has_partitions=True, pause_state_known=True, undecodable=undecodable_now(app)
    )
    assert status == 503
    assert body == {
        "ready": False,
        "rebalancing": False,
        "pause_state_known": True,
        "undecodable": [
            {
                "topic": "items",
                "partition": 3,
                "offset": 1500,
                "next_offset": 1502,
                "error": "CorruptRecordException('Invalid CRC')",
                "since_ms": 9,
                "failures": 1,
            }
        ],
    }
    batches.decoded("items", 3, 1500)
    assert ready_answer(
        rebalancing=False, has_partitions=True, pause_state_known=True, undecodable=undecodable_now(app)
    ) == ({"ready": True, "rebalancing": False, "pause_state_known": True}, 200)


def test_a_worker_without_a_started_consumer_reports_nothing_stopped() -> None:
    assert undecodable_now(SimpleNamespace()) == []
