"""redrive (dry run, execute, a second run, the lock) and inventory with ``--out s3a://...`` on a local S3 server
(moto): every small file goes through fsspec, none to the driver's disk."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest
from conftest import create_topics, produce, unique
from test_pipeline_redrive_safety import arrived, dead_letter

from pipeline.__main__ import main
from pipeline.ledger import acquire_lock, read_audit, read_ledger, read_lock
from pipeline.storage import Location

pytestmark = [pytest.mark.broker, pytest.mark.spark]


def test_redrive_and_inventory_write_everything_to_s3(spark, broker, s3_server, tmp_path, monkeypatch) -> None:
    items = unique("items")
    failed = f"{items}.failed"
    create_topics(broker.bootstrap, {items: 1, failed: 1})
    produce(
        broker.bootstrap,
        failed,
        [
            dead_letter(b"k1", b"v1", original_offset=1, original_topic=items),
            dead_letter(b"k2", None, original_offset=2, reason="too-large", original_topic=items),
            dead_letter(b"k3", b"v3", original_offset=3, original_topic=items),
        ],
    )
    out = f"s3a://{s3_server.bucket()}/rebound/out"
    monkeypatch.chdir(tmp_path)  # anything written to a relative local path would land here
    common = ["--bootstrap", broker.bootstrap, "--main-topics", items, "--out", out]

    dry = main(["redrive", *common], spark=spark)
    assert dry["plan"].startswith(f"{out}/redrive/plans/")
    plan = [json.loads(line) for line in Location(dry["plan"]).read_text().splitlines()]
    assert [(p["key"], p["action"]) for p in plan] == [("k1", "send"), ("k2", "skipped_value_left_out"), ("k3", "send")]

    location = Location(out)
    acquire_lock(location, {"run_id": "other", "user": "ann", "host": "h", "pid": 1})
    with pytest.raises(SystemExit, match="held by run other"):
        main(["redrive", *common, "--execute"], spark=spark)
    done = main(["redrive", *common, "--execute", "--plan", dry["plan"], "--break-lock"], spark=spark)
    assert done["sent"] == 2 and not read_lock(location)
    assert [(r.key, r.value) for r in arrived(spark, broker, items)] == [(b"k1", b"v1"), (b"k3", b"v3")]
    assert sorted(r["failed_offset"] for r in read_ledger(location)) == [0, 2]
    assert (location / "redrive" / "ledger").glob("*.jsonl")[0].url.startswith(f"{out}/redrive/ledger/")
    again = main(["redrive", *common, "--execute"], spark=spark)
    assert again["sent"] == 0 and again["counts"]["skipped_already_redriven"] == 2
    statuses = [(a["status"], a["dry_run"]) for a in read_audit(location)]
    assert statuses.count(("finished", False)) == 2 and ("failed", False) in statuses

    inv = main(["inventory", *common], spark=spark)
    assert inv["summary"]["topics"][failed] == {**inv["summary"]["topics"][failed], "depth": 3, "redriven": 2}
    summary = json.loads((location / "inventory" / "summary.json").read_text())
    assert summary["topics"][failed]["redriven"] == 2
    redriven = pd.read_parquet(io.BytesIO((location / "inventory" / "redriven.parquet").read_bytes()))
    assert sorted(redriven["key_text"]) == ["k1", "k3"]
    assert list(tmp_path.iterdir()) == []
