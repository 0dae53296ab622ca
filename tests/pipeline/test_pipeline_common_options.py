"""The common job flags for secured clusters: ``--kafka-properties`` / ``$REBOUND_PIPELINE_KAFKA_PROPERTIES`` and
``--kafka-option``, and how they reach the data source's ``kafka.*`` options."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.__main__ import build_parser
from pipeline.common import KAFKA_PROPERTIES_ENV, config_from_args, kafka_source_options, parse_properties

CLIENT_PROPERTIES = """\
# the file a team already hands to kafka-console-consumer
security.protocol=SASL_SSL
sasl.mechanism = SCRAM-SHA-512
sasl.plain.username: rebound
sasl.plain.password=p=ss\\
word

! another comment style
ssl.cafile=/etc/kafka/ca.pem
"""


def _config(argv: list[str]):
    return config_from_args(build_parser().parse_args(argv))


def test_properties_syntax_of_client_files() -> None:
    assert parse_properties(CLIENT_PROPERTIES) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.plain.username": "rebound",
        "sasl.plain.password": "p=ssword",
        "ssl.cafile": "/etc/kafka/ca.pem",
    }
    with pytest.raises(SystemExit, match="expected name=value"):
        parse_properties("just-a-name\n")


def test_file_then_flags_and_the_source_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    props = tmp_path / "client.properties"
    props.write_text(CLIENT_PROPERTIES)
    monkeypatch.delenv(KAFKA_PROPERTIES_ENV, raising=False)
    cfg = _config(
        [
            "inventory",
            "--bootstrap",
            "k1:9093",
            "--kafka-properties",
            str(props),
            "--kafka-option",
            "sasl.mechanism=PLAIN",
        ]
    )
    assert cfg.kafka_options["sasl.mechanism"] == "PLAIN"  # the flag wins over the file
    assert cfg.kafka_options["security.protocol"] == "SASL_SSL"
    options = kafka_source_options(cfg)
    assert options["kafka.bootstrap.servers"] == "k1:9093"
    assert options["kafka.ssl.cafile"] == "/etc/kafka/ca.pem"
    assert options["kafka.sasl.plain.password"] == "p=ssword"


def test_environment_variable_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    props = tmp_path / "client.properties"
    props.write_text("security.protocol=SSL\n")
    monkeypatch.setenv(KAFKA_PROPERTIES_ENV, str(props))
    assert _config(["redrive"]).kafka_options == {"security.protocol": "SSL"}
    monkeypatch.delenv(KAFKA_PROPERTIES_ENV)
    assert _config(["redrive"]).kafka_options == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kafka-option", "security.protocol"], "expects NAME=VALUE"),
        (["--kafka-option", "bootstrap.servers=x:1"], "--bootstrap"),
        (["--kafka-properties", "/nonexistent/client.properties"], "no such file"),
    ],
)
def test_mistakes_are_refused_by_name(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KAFKA_PROPERTIES_ENV, raising=False)
    with pytest.raises(SystemExit, match=message):
        _config(["facts", *argv])


def test_one_set_of_settings_serves_consumers_and_producers() -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from pipeline.kafka_source.client import client_kwargs
    from pipeline.kafka_source.options import KafkaOptionError

    common = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "linger.ms": "5"}
    consumer = client_kwargs(common, AIOKafkaConsumer)
    producer = client_kwargs(common, AIOKafkaProducer)
    assert "linger_ms" not in consumer  # a producer setting, skipped for the consumer as the Java client does
    assert producer["linger_ms"] == 5
    # TLS without ssl.* settings trusts the system's CAs instead of making aiokafka refuse to start.
    assert consumer["ssl_context"].verify_mode.name == "CERT_REQUIRED"
    with pytest.raises(KafkaOptionError, match=r"'sasl\.mechansim' is not supported"):
        client_kwargs({"sasl.mechansim": "PLAIN"}, AIOKafkaConsumer)  # a typo is still an error
