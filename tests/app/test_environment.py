"""Settings from the environment (``app/environment.py``): the ``REBOUND_*`` variables over ``.env`` over the defaults,
each parsed from its text exactly as when the core's settings read the environment themselves."""

from __future__ import annotations

import builtins
import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from app.environment import environment_values, settings_from_environment
from app.handlers import load_handler
from app.http_handler import HttpHandler
from rebound.errors import ConfigurationError
from rebound.settings import load_settings, reveal


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No inherited REBOUND_* variable and no stray .env file; the working directory is the test's own."""
    for name in list(os.environ):
        if name.upper().startswith("REBOUND_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path / ".env"


def test_nothing_set_is_the_defaults() -> None:
    assert environment_values() == {}
    assert settings_from_environment() == load_settings()


def test_the_environment_wins_over_dotenv(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    clean_env.write_text("REBOUND_APP_ID=from-dotenv\n")
    monkeypatch.setenv("REBOUND_APP_ID", "from-env")
    assert settings_from_environment().app_id == "from-env"


def test_dotenv_wins_over_the_default(clean_env: Path) -> None:
    clean_env.write_text("REBOUND_APP_ID=from-dotenv\nREBOUND_WEB_PORT=7001\n")
    settings = settings_from_environment()
    assert (settings.app_id, settings.web_port) == ("from-dotenv", 7001)
    assert settings.broker == "kafka://127.0.0.1:9092"  # not in the file: the default


def test_each_source_fills_what_the_others_leave(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    clean_env.write_text("REBOUND_APP_ID=from-dotenv\nREBOUND_WEB_PORT=7001\nREBOUND_DATA_DIR=/from/dotenv\n")
    monkeypatch.setenv("REBOUND_WEB_PORT", "7002")
    monkeypatch.setenv("REBOUND_DATA_DIR", "/from/env")
    settings = settings_from_environment(data_dir="/given")
    assert (settings.app_id, settings.web_port, settings.data_dir) == ("from-dotenv", 7002, "/given")
    assert settings.web_host == "127.0.0.1"


def test_another_env_file_or_none(monkeypatch: pytest.MonkeyPatch, clean_env: Path, tmp_path: Path) -> None:
    clean_env.write_text("REBOUND_APP_ID=from-dotenv\n")
    other = tmp_path / "worker.env"
    other.write_text("REBOUND_APP_ID=from-other\n")
    assert settings_from_environment(env_file=other).app_id == "from-other"
    assert settings_from_environment(env_file=None).app_id == "rebound"


def test_a_secret_is_parsed_from_its_text_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBOUND_ADMIN_TOKEN", "t0k3n")
    monkeypatch.setenv("REBOUND_HEADER_SECRET", "h-secret")
    settings = settings_from_environment()
    assert reveal(settings.admin_token) == "t0k3n" and reveal(settings.header_secret) == "h-secret"
    assert "t0k3n" not in repr(settings) and "h-secret" not in str(settings.model_dump())
    monkeypatch.setenv("REBOUND_ADMIN_TOKEN", "  ")
    assert settings_from_environment().admin_token is None  # empty: admin actions off, as unset


def test_a_list_is_comma_separated_text_never_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBOUND_MAIN_TOPICS", " orders , items,orders ")
    monkeypatch.setenv("REBOUND_PERMANENT_ERRORS", "ValueError, ItemGone ,")
    settings = settings_from_environment()
    assert settings.topics == ("orders", "items")
    assert settings.classifier.permanent_names == frozenset({"ValueError", "ItemGone"})
    monkeypatch.setenv("REBOUND_MAIN_TOPICS", '["a","b"]')  # pydantic-settings decodes JSON only for complex fields
    with pytest.raises(ConfigurationError, match=r"""REBOUND_MAIN_TOPICS: '\["a"' is not a valid Kafka topic name"""):
        settings_from_environment()


def test_numbers_flags_and_auto_are_parsed_from_text(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "REBOUND_WEB_ENABLED": "off",
        "REBOUND_PARTITIONS": "8",
        "REBOUND_TIMER_INTERVAL": "0.5",
        "REBOUND_CONCURRENCY": " AUTO ",
        "REBOUND_RETRY_SEQUENCE": "exp:1s..8s",
    }.items():
        monkeypatch.setenv(name, value)
    settings = settings_from_environment()
    assert settings.web_enabled is False and settings.partitions == 8 and settings.timer_interval == 0.5
    assert settings.concurrency == "auto"
    assert settings.policy.delays_ms == (1_000, 2_000, 4_000, 8_000)


def test_a_variables_name_is_read_in_any_case(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    monkeypatch.setenv("rebound_app_id", "lower")
    clean_env.write_text("Rebound_Web_Port=7005\n")
    settings = settings_from_environment()
    assert (settings.app_id, settings.web_port) == ("lower", 7005)


def test_unknown_rebound_variables_and_the_files_others_are_ignored(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    monkeypatch.setenv("REBOUND_TEST_KAFKA", "mock")  # the tests' own variable, not a setting
    monkeypatch.setenv("REBOUND_NO_SUCH_SETTING", "1")
    clean_env.write_text("REBOUND_ALSO_UNKNOWN=x\nOTHER=y\nREBOUND_APP_ID=shop\n")
    assert environment_values() == {"app_id": "shop"}
    assert settings_from_environment() == load_settings(app_id="shop")


def test_a_bad_value_names_its_variable_with_the_cores_message(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    monkeypatch.setenv("REBOUND_CONCURRENCY", "-3")
    clean_env.write_text("REBOUND_WEB_PORT=http\n")
    with pytest.raises(ConfigurationError) as raised:
        settings_from_environment()
    problems = str(raised.value).split("; ")
    assert "REBOUND_CONCURRENCY='-3': must be greater than or equal to 1" in problems
    assert any(problem.startswith("REBOUND_WEB_PORT='http': must be a valid integer") for problem in problems)
    monkeypatch.setenv("REBOUND_PARTITIONS", "")  # set but empty is a value, not unset (env_ignore_empty is off)
    with pytest.raises(ConfigurationError, match="REBOUND_PARTITIONS='': must be a valid integer"):
        settings_from_environment(concurrency=4, web_port=1)


def test_a_url_handler_without_settings_takes_the_rest_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_handler`` given only the URL (no settings) configures the HTTP handler from the environment."""
    monkeypatch.setenv("REBOUND_HTTP_TOKEN", "from-env-token")
    monkeypatch.setenv("REBOUND_HTTP_MAX_HEADER_BYTES", "4096")
    handler = load_handler("http://127.0.0.1:9/events")
    assert isinstance(handler, HttpHandler)
    assert handler.config.token == "from-env-token"
    assert (handler.config.url, handler.config.max_header_bytes) == ("http://127.0.0.1:9/events", 4096)


def test_a_bad_value_from_dotenv_is_said_to_come_from_the_file(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    """Reported: ``REBOUND_CONCURRENCY='-3': must be ...`` with the variable set nowhere in the environment: the
    one-line error did not say the value was the ``.env`` file's. It names the file by its path now, and says so of
    a value the environment sets over the file's (the file is then not where to fix it)."""
    clean_env.write_text("REBOUND_CONCURRENCY=-3\nREBOUND_APP_ID=ok\n")
    path = clean_env.resolve()
    with pytest.raises(ConfigurationError) as raised:
        settings_from_environment()
    assert str(raised.value) == (
        f"REBOUND_CONCURRENCY='-3': must be greater than or equal to 1 (REBOUND_CONCURRENCY is set in {path})"
    )  # a good value of the file is not mentioned
    clean_env.write_text("rebound_main_topics=bad topic\n")  # (a variable's name in any case)
    with pytest.raises(
        ConfigurationError, match=rf"topic name \(REBOUND_MAIN_TOPICS is set in {re.escape(str(path))}\)"
    ):
        settings_from_environment()
    clean_env.write_text("REBOUND_CONCURRENCY=-3\n")

    monkeypatch.setenv("REBOUND_CONCURRENCY", "0")
    with pytest.raises(ConfigurationError) as raised:
        settings_from_environment()
    assert f"(REBOUND_CONCURRENCY is set in the environment, which overrides {path})" in str(raised.value)

    monkeypatch.delenv("REBOUND_CONCURRENCY")
    clean_env.write_text("REBOUND_RELEASE_MODE=republish\n")  # a rule across variables names the file's one
    with pytest.raises(ConfigurationError, match=rf"\(REBOUND_RELEASE_MODE is set in {re.escape(str(path))}\)"):
        settings_from_environment()


def test_a_bad_value_from_the_environment_or_an_argument_names_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBOUND_CONCURRENCY", "-3")
    with pytest.raises(ConfigurationError) as raised:
        settings_from_environment()
    assert str(raised.value) == "REBOUND_CONCURRENCY='-3': must be greater than or equal to 1"


def test_the_file_is_parsed_once(clean_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Review: ``origins`` parsed the file a second time, so python-dotenv's warning about a line it cannot parse
    was printed twice."""
    clean_env.write_text("REBOUND_APP_ID=ok\nnot a statement\nREBOUND_WEB_PORT=7001\n")
    with caplog.at_level(logging.WARNING, logger="dotenv"):
        settings = settings_from_environment()
    assert (settings.app_id, settings.web_port) == ("ok", 7001)
    assert [r.getMessage() for r in caplog.records] == ["python-dotenv could not parse statement starting at line 2"]


def test_a_file_that_is_not_utf8_is_a_configuration_error_naming_it(clean_env: Path) -> None:
    """Review: a ``.env`` saved as Latin-1 gave a ``UnicodeDecodeError`` traceback, not the one-line error."""
    clean_env.write_bytes("REBOUND_APP_ID=shop\nREBOUND_HANDLER=caf\u00e9:handle\n".encode("latin-1"))
    with pytest.raises(ConfigurationError) as raised:
        settings_from_environment()
    assert str(raised.value) == f"{clean_env.resolve()} is not UTF-8 text (byte 0xe9 on line 2): save it as UTF-8"


def test_a_file_that_cannot_be_read_is_a_configuration_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    clean_env.write_text("REBOUND_APP_ID=shop\n")
    opened = io.open

    def refused(file: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(file).name == ".env":
            raise PermissionError(13, "Permission denied", str(file))
        return opened(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", refused)
    monkeypatch.setattr(builtins, "open", refused)
    with pytest.raises(ConfigurationError) as raised:
        settings_from_environment()
    assert str(raised.value) == f"{clean_env.resolve()} cannot be read: Permission denied"
