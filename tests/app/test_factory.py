"""The Faust app is configured by REBOUND_* settings only: Faust's own unprefixed variables cannot weaken it."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.factory import create_faust_app
from rebound.settings import load_settings


def test_fausts_unprefixed_environment_variables_do_not_override_rebound(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in {
        "PRODUCER_ACKS": "1",
        "APP_WEB_TABLES_ENABLED": "true",
        "WEB_TABLES_ENABLED": "true",
        "TOPIC_PARTITIONS": "8",
        "TOPIC_ALLOW_DECLARE": "true",
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(data_dir=str(tmp_path), provision_topics=False, store="memory://")
    conf = create_faust_app(settings, partitions=2).conf
    assert conf.producer_acks == -1
    assert conf.web_tables_enabled is False
    assert conf.web_router_enabled is False
    assert conf.topic_partitions == 2
    assert conf.topic_allow_declare is False
