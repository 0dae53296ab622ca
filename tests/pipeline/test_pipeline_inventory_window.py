"""inventory with --since/--until through the real job on the embedded broker: only the window is counted, and the
ledger (immutable chunk objects) marks what was redriven."""

from __future__ import annotations

import datetime as dt

import pytest
from conftest import create_topics, produce, unique
from test_pipeline_redrive_safety import dead_letter

from pipeline.__main__ import main

pytestmark = [pytest.mark.broker, pytest.mark.spark]

HOUR = 3_600_000


def test_inventory_counts_only_the_window_and_reads_the_ledger(spark, broker, tmp_path) -> None:
    items = unique("items")
    failed = f"{items}.failed"
    create_topics(broker.bootstrap, {items: 1, failed: 1})
    start = int(dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC).timestamp() * 1000)
    produce(
        broker.bootstrap,
        failed,
        [
            dead_letter(b"early", b"v", original_offset=1, reason="exhausted", ts=start, original_topic=items),
            dead_letter(b"in-1", b"v", original_offset=2, reason="expired", ts=start + HOUR, original_topic=items),
            dead_letter(
                b"in-2", b"v", original_offset=3, reason="exhausted", ts=start + 2 * HOUR, original_topic=items
            ),
            dead_letter(b"late", b"v", original_offset=4, reason="expired", ts=start + 3 * HOUR, original_topic=items),
        ],
    )
    common = ["--bootstrap", broker.bootstrap, "--main-topics", items, "--out", str(tmp_path)]
    # redrive's own window: in-2 is at the --until bound, which is exclusive
    sent = main(
        ["redrive", *common, "--execute", "--key-pattern", "^in-", "--until", str(start + 2 * HOUR)], spark=spark
    )
    assert sent["counts"] == {"send": 1}

    window = ["--since", "2024-05-01T11:00", "--until", str(start + 3 * HOUR)]
    inv = main(["inventory", *common, *window], spark=spark)
    assert inv["summary"]["topics"][failed]["depth"] == 2
    assert inv["summary"]["topics"][failed]["redriven"] == 1
    assert inv["summary"]["window"] == {"since": "2024-05-01T11:00:00+00:00", "until": "2024-05-01T13:00:00+00:00"}
    reasons = {r["reason"]: (r["records"], r["redriven"]) for r in inv["tables"]["by_reason"].to_dict("records")}
    assert reasons == {"expired": (1, 1), "exhausted": (1, 0)}
    assert list(inv["tables"]["redriven"]["key_text"]) == ["in-1"]

    everything = main(["inventory", *common], spark=spark)
    assert everything["summary"]["topics"][failed]["depth"] == 4
    with pytest.raises(SystemExit, match=r"--since .* must be before --until"):
        main(["inventory", *common, "--since", "2024-05-02", "--until", "2024-05-01"], spark=spark)


def test_inventory_counts_redriven_by_original_message_as_redrive_decides(spark, broker, tmp_path) -> None:
    """Two consumer groups dead-lettered the same original message; redrive sends it once (the newest dead letter),
    so the other dead letter is redriven too, and inventory must say so (it counted failed records before)."""
    items = unique("items")
    failed = f"{items}.failed"
    create_topics(broker.bootstrap, {items: 1, failed: 1})
    produce(
        broker.bootstrap,
        failed,
        [
            dead_letter(b"same", b"v", original_offset=5, group="billing", original_topic=items),
            dead_letter(b"same", b"v", original_offset=5, group="search", original_topic=items),
            dead_letter(b"other", b"v", original_offset=6, reason="expired", original_topic=items),
        ],
    )
    common = ["--bootstrap", broker.bootstrap, "--main-topics", items, "--out", str(tmp_path)]
    sent = main(["redrive", *common, "--execute", "--reason", "exhausted"], spark=spark)
    assert sent["counts"] == {"send": 1, "skipped_duplicate_of_message": 1}

    inv = main(["inventory", *common], spark=spark)
    assert inv["summary"]["topics"][failed] == {"depth": 3, "redriven": 2, "oldest_age_s": pytest.approx(0, abs=600)}
    assert sorted(inv["tables"]["redriven"]["key_text"]) == ["same", "same"]
