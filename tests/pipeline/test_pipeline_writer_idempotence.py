"""The writer (the sink's tasks and redrive) uses an idempotent producer where the broker can start one.

The librdkafka mock cluster hands out producer ids; the embedded Tansu broker answers InitProducerId with an unknown
error, so there the writer must warn and carry on without idempotence unless idempotence was asked for explicitly.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiokafka.errors import UnknownError
from conftest import unique

from pipeline.kafka_source.client import KafkaWriter

pytestmark = [pytest.mark.broker]


def test_idempotent_where_the_broker_hands_out_producer_ids(mock_kafka: Any) -> None:
    topic = unique("idempotent")
    mock_kafka.server.create_topics([topic], 1)
    with KafkaWriter(mock_kafka.bootstrap) as writer:
        writer.send(topic, value=b"v")
        writer.flush()
        assert writer.idempotent
        assert writer.sent == 1


def test_falls_back_with_a_warning_on_a_broker_without_producer_ids(broker, caplog: pytest.LogCaptureFixture) -> None:
    topic = unique("plain")
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source.client"), KafkaWriter(broker.bootstrap) as w:
        w.send(topic, value=b"v")
        w.flush()
        assert not w.idempotent
        assert w.sent == 1
    assert "cannot start an idempotent producer" in caplog.text
    # aiokafka's own ERROR for the refused InitProducerId is not repeated next to the warning.
    assert not [r for r in caplog.records if r.name == "aiokafka.producer.sender" and r.levelno >= logging.ERROR]


def test_explicit_idempotence_fails_instead_of_falling_back(broker) -> None:
    with pytest.raises(UnknownError):
        KafkaWriter(broker.bootstrap, {"enable.idempotence": "true"})
    with KafkaWriter(broker.bootstrap, {"enable.idempotence": "false"}) as writer:
        assert not writer.idempotent
