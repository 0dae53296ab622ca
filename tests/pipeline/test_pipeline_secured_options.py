"""The common Kafka settings reach the clients the jobs really use, on the embedded broker.

The embedded broker speaks plaintext only, so the proof is by contrast: the same job succeeds with harmless
settings from a properties file and fails to connect when the file says ``security.protocol=SSL`` — which can only
happen if the setting reached the aiokafka client.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import create_topics, produce, unique

from pipeline.__main__ import main
from pipeline.common import KAFKA_PROPERTIES_ENV

pytestmark = [pytest.mark.broker, pytest.mark.spark]


def _failed_record(main_topic: str) -> dict:
    headers = [
        ("rebound.reason", b"exhausted"),
        ("rebound.original-topic", main_topic.encode()),
        ("rebound.original-partition", b"0"),
        ("rebound.original-offset", b"7"),
        ("rebound.error-class", b"TimeoutError"),
    ]
    return {"key": b"k1", "value": b"v1", "headers": headers}


def test_properties_file_settings_reach_the_source(spark, broker, tmp_path: Path, monkeypatch) -> None:
    main_topic = unique("secured")
    create_topics(broker.bootstrap, {main_topic: 1, f"{main_topic}.failed": 1})
    produce(broker.bootstrap, f"{main_topic}.failed", [_failed_record(main_topic)])
    props = tmp_path / "client.properties"
    props.write_text("client.id=rebound-pipeline-test\nrequest.timeout.ms=20000\nlinger.ms=5\n")
    monkeypatch.setenv(KAFKA_PROPERTIES_ENV, str(props))
    argv = ["inventory", "--bootstrap", broker.bootstrap, "--main-topics", main_topic, "--out", str(tmp_path / "out")]

    result = main(argv, spark=spark)
    assert result["summary"]["topics"][f"{main_topic}.failed"]["depth"] == 1

    props.write_text("security.protocol=SSL\nrequest.timeout.ms=3000\n")
    with pytest.raises(Exception, match=r"(?i)bootstrap|connect|ssl"):
        main(argv, spark=spark)
