"""Settings from REBOUND_* environment variables: defaults, overrides, strict errors naming the variable."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from rebound.errors import ConfigurationError
from rebound.routing import Classification
from rebound.settings import Settings, load_settings, reveal


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No inherited REBOUND_* variable and no stray .env file may leak into a test."""
    for name in list(os.environ):
        if name.upper().startswith("REBOUND_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_defaults_match_the_design_table() -> None:
    settings = load_settings()
    assert settings.broker == "kafka://127.0.0.1:9092"
    assert settings.app_id == "rebound"
    assert settings.main_topics == "items"
    assert settings.topics == ("items",)
    assert settings.retry_sequence == "5m,5m,30m,30m,30m,1h"
    assert settings.max_retry_duration == ""
    assert settings.handler is None  # required by the worker (app/handlers.py), with no default: no demo handler
    assert settings.web_port == 6066
    assert settings.web_host == "127.0.0.1"
    assert settings.data_dir == "./data"
    assert settings.admin_token is None
    assert settings.show_payloads is False
    assert settings.policy.delays_ms == (300_000, 300_000, 1_800_000, 1_800_000, 1_800_000, 3_600_000)
    assert settings.policy.max_duration_ms is None
    assert settings.policy.tier_labels == ("5m", "30m", "1h")
    assert settings.bootstrap_servers == "127.0.0.1:9092"
    assert settings.handler_timeout_s == 30.0
    assert settings.classifier.default is Classification.RETRYABLE


def test_env_overrides(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_RETRY_SEQUENCE", "1s,10s")
    monkeypatch.setenv("REBOUND_MAIN_TOPICS", " orders , items,orders ")
    monkeypatch.setenv("REBOUND_WEB_PORT", "7070")
    monkeypatch.setenv("REBOUND_MAX_RETRY_DURATION", "1m")
    monkeypatch.setenv("REBOUND_ADMIN_TOKEN", "t0k3n")
    monkeypatch.setenv("REBOUND_APP_ID", "shop")
    settings = load_settings()
    assert settings.policy.delays_ms == (1_000, 10_000)
    assert settings.policy.max_duration_ms == 60_000
    assert settings.policy.tier_labels == ("1s", "10s")
    assert settings.topics == ("orders", "items")  # trimmed, de-duplicated, in order
    assert settings.web_port == 7070
    assert reveal(settings.admin_token) == "t0k3n"
    assert "t0k3n" not in repr(settings) and "t0k3n" not in str(settings.model_dump())
    assert settings.app_id == "shop"


def test_exponential_sequence_from_env(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_RETRY_SEQUENCE", "exp:1s..8s")
    assert load_settings().policy.delays_ms == (1_000, 2_000, 4_000, 8_000)


def test_dotenv_in_working_directory_is_read(tmp_path) -> None:
    (tmp_path / ".env").write_text("REBOUND_APP_ID=from-dotenv\nREBOUND_WEB_PORT=7001\n")
    settings = load_settings()
    assert settings.app_id == "from-dotenv"
    assert settings.web_port == 7001


def test_environment_wins_over_dotenv(monkeypatch, tmp_path) -> None:
    (tmp_path / ".env").write_text("REBOUND_APP_ID=from-dotenv\n")
    monkeypatch.setenv("REBOUND_APP_ID", "from-env")
    assert load_settings().app_id == "from-env"


def test_overrides_as_arguments() -> None:
    assert load_settings(app_id="x", web_port=1).web_port == 1


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("REBOUND_RETRY_SEQUENCE", "5m,,5m"),
        ("REBOUND_RETRY_SEQUENCE", "0s"),
        ("REBOUND_RETRY_SEQUENCE", "1.5m"),
        ("REBOUND_RETRY_SEQUENCE", "exp:1h..1s"),
        ("REBOUND_MAX_RETRY_DURATION", "-1h"),
        ("REBOUND_MAX_RETRY_DURATION", "10"),
        ("REBOUND_MAIN_TOPICS", " , "),
        ("REBOUND_MAIN_TOPICS", "items,items.retry.5m"),
        ("REBOUND_MAIN_TOPICS", "items.failed"),
        ("REBOUND_WEB_PORT", "http"),
        ("REBOUND_WEB_PORT", "70000"),
        ("REBOUND_WEB_PORT", "-1"),
        ("REBOUND_HANDLER", "demo.handler"),
        ("REBOUND_HANDLER", "a:b:c"),
        ("REBOUND_HANDLER_TIMEOUT", "0s"),
        ("REBOUND_UNKNOWN_ERRORS", "sometimes"),
        ("REBOUND_RELEASE_MODE", "teleport"),
        ("REBOUND_PARTITIONS", "0"),
        ("REBOUND_TIMER_INTERVAL", "0"),
        ("REBOUND_SHOW_PAYLOADS", "perhaps"),
    ],
)
def test_invalid_values_name_the_variable(monkeypatch, variable, value) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable):
        load_settings()


def test_handler_is_read_and_an_empty_one_is_unset(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_HANDLER", "shop.handlers:handle")
    assert load_settings().handler == "shop.handlers:handle"
    monkeypatch.setenv("REBOUND_HANDLER", "  ")
    assert load_settings().handler is None  # the worker then says REBOUND_HANDLER is not set


def test_a_malformed_handler_says_what_the_form_is(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_HANDLER", "shop.handlers.handle")
    with pytest.raises(ConfigurationError) as raised:
        load_settings()
    assert str(raised.value).startswith("REBOUND_HANDLER='shop.handlers.handle' is not of the form package.module:")
    assert "for example REBOUND_HANDLER=myservice.handlers:handle" in str(raised.value)


@pytest.mark.parametrize(
    "value",
    [".h:handle", "h..x:handle", "h.:handle", "h:", ":handle", "1h:handle", "h:1handle", "h:handle.x", "my-svc:handle"],
)
def test_a_handler_must_be_dotted_identifiers_then_a_name(monkeypatch, value) -> None:
    """Not only one ':': a relative module (``.h``, a TypeError from importlib) or an empty part (``h..x``) is refused
    as the setting it is, before anything is imported."""
    monkeypatch.setenv("REBOUND_HANDLER", value)
    with pytest.raises(ConfigurationError) as raised:
        load_settings()
    assert str(raised.value).startswith(f"REBOUND_HANDLER={value!r} is not of the form package.module:callable")


@pytest.mark.parametrize(
    ("value", "read"),
    [("h:handle", "h:handle"), ("shop_2.handlers.v1:_handle", "shop_2.handlers.v1:_handle"), (" a.b:c ", "a.b:c")],
)
def test_well_formed_handlers_are_accepted(monkeypatch, value, read) -> None:
    monkeypatch.setenv("REBOUND_HANDLER", value)
    assert load_settings().handler == read


@pytest.mark.parametrize("value", ["rocksdb://", "memory://"])
def test_the_supported_table_stores_are_accepted(monkeypatch, value) -> None:
    monkeypatch.setenv("REBOUND_STORE", value)
    assert load_settings().store == value


@pytest.mark.parametrize("value", ["bogus://", "aerospike://", "rocksdb", "", "redis://localhost"])
def test_an_unsupported_table_store_is_refused(monkeypatch, value) -> None:
    monkeypatch.setenv("REBOUND_STORE", value)
    with pytest.raises(ConfigurationError) as raised:
        load_settings()
    message = str(raised.value)
    assert message.startswith(f"REBOUND_STORE={value!r} is not a table store Rebound supports"), message
    assert "rocksdb://" in message and "memory://" in message


def test_type_and_range_errors_show_the_variable_its_value_and_the_rule(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_CONCURRENCY", "-3")
    monkeypatch.setenv("REBOUND_WEB_PORT", "http")
    monkeypatch.setenv("REBOUND_UNKNOWN_ERRORS", "sometimes")
    with pytest.raises(ConfigurationError) as raised:
        load_settings()
    problems = str(raised.value).split("; ")
    assert "REBOUND_CONCURRENCY='-3': must be greater than or equal to 1" in problems
    assert "REBOUND_UNKNOWN_ERRORS='sometimes': must be 'retryable' or 'permanent'" in problems
    assert any(problem.startswith("REBOUND_WEB_PORT='http': must be a valid integer") for problem in problems)


def test_a_secrets_value_is_never_shown_in_an_error() -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_HEADER_SECRET") as raised:
        load_settings(header_secret=98765432)
    assert "98765432" not in str(raised.value)


def test_empty_sequence_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_RETRY_SEQUENCE", "")
    with pytest.raises(ConfigurationError, match="REBOUND_RETRY_SEQUENCE"):
        load_settings()


def test_republish_needs_a_secret(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_RELEASE_MODE", "republish")
    with pytest.raises(ConfigurationError, match="REBOUND_HEADER_SECRET"):
        load_settings()
    monkeypatch.setenv("REBOUND_HEADER_SECRET", "s")
    settings = load_settings()
    assert settings.release_mode == "republish"
    assert reveal(settings.header_secret) == "s"


def test_settings_are_frozen() -> None:
    settings = load_settings()
    with pytest.raises(ValidationError):
        settings.app_id = "other"
    with pytest.raises(ValidationError):
        settings.web_port = 1
    assert settings.app_id == "rebound"


def test_derived_values_are_cached() -> None:
    settings = load_settings()
    assert settings.policy is settings.policy
    assert settings.classifier is settings.classifier


@pytest.mark.parametrize(
    ("broker", "servers"),
    [
        ("kafka://127.0.0.1:9092", "127.0.0.1:9092"),
        ("kafka://a:9092;b:9093", "a:9092,b:9093"),
        ("kafka://a:9092,kafka://b:9093", "a:9092,b:9093"),
        ("a:9092", "a:9092"),
        (" kafka://a:1 , b:2 ,", "a:1,b:2"),
    ],
)
def test_bootstrap_servers_strips_scheme(monkeypatch, broker, servers) -> None:
    monkeypatch.setenv("REBOUND_BROKER", broker)
    assert load_settings().bootstrap_servers == servers


def test_classifier_from_settings(monkeypatch) -> None:
    class ItemGone(Exception):
        pass

    monkeypatch.setenv("REBOUND_PERMANENT_ERRORS", "ValueError, ItemGone ,")
    monkeypatch.setenv("REBOUND_RETRYABLE_ERRORS", "UnicodeError")
    monkeypatch.setenv("REBOUND_UNKNOWN_ERRORS", "permanent")
    classifier = load_settings().classifier
    assert classifier.permanent_names == frozenset({"ValueError", "ItemGone"})
    assert classifier.classify(ItemGone()) is Classification.PERMANENT
    assert classifier.classify(ValueError()) is Classification.PERMANENT
    assert classifier.classify(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x")) is Classification.RETRYABLE
    assert classifier.classify(OSError()) is Classification.PERMANENT


def test_handler_timeout_seconds(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_HANDLER_TIMEOUT", "1500ms")
    assert load_settings().handler_timeout_s == 1.5


def test_settings_class_reads_env_directly(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_WEB_HOST", "0.0.0.0")
    assert Settings().web_host == "0.0.0.0"


def test_the_revocation_drain_defaults_to_a_quarter_of_the_rebalance_timeout(monkeypatch) -> None:
    assert load_settings().revoke_drain_s == 15.0  # 60 s rebalance timeout; 60 - 30 - 1 - 3 would allow 26
    monkeypatch.setenv("REBOUND_REBALANCE_TIMEOUT", "4")
    monkeypatch.setenv("REBOUND_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("REBOUND_HANDLER_TIMEOUT", "1s")
    assert load_settings().revoke_drain_s == 1.0
    monkeypatch.setenv("REBOUND_REVOKE_DRAIN", "0")
    assert load_settings().revoke_drain_s == 0.0


def test_the_default_drain_shrinks_to_what_the_handler_timeout_leaves_of_the_rebalance(monkeypatch) -> None:
    """A record started at the end of the drain may run for the handler timeout and its grace: the group evicts a
    member whose revocation takes longer than the rebalance timeout."""
    monkeypatch.setenv("REBOUND_HANDLER_TIMEOUT", "50s")
    assert load_settings().revoke_drain_s == 6.0  # 60 - 50 - 1 - 3
    monkeypatch.setenv("REBOUND_HANDLER_TIMEOUT", "2m")
    assert load_settings().revoke_drain_s == 0.0


def test_a_revocation_drain_the_group_would_not_wait_for_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("REBOUND_REBALANCE_TIMEOUT", "10")
    monkeypatch.setenv("REBOUND_REVOKE_DRAIN", "5")
    with pytest.raises(ConfigurationError, match=r"REBOUND_REVOKE_DRAIN .* REBOUND_HANDLER_TIMEOUT"):
        load_settings()
    monkeypatch.setenv("REBOUND_HANDLER_TIMEOUT", "1s")
    assert load_settings().revoke_drain_s == 5.0  # 5 + 1 + 1 + 3 = 10: just fits
    monkeypatch.setenv("REBOUND_HANDLER_TIMEOUT", "2m")
    monkeypatch.setenv("REBOUND_REVOKE_DRAIN", "0")
    assert load_settings().revoke_drain_s == 0.0  # no drain fits any budget


@pytest.mark.parametrize("value", ["", "  ", "0s"])
def test_an_empty_or_zero_ended_memory_is_refused_at_start_up(monkeypatch, value) -> None:
    """Every settle reads it: accepted empty, each release failed with a ConfigurationError (repeated dead letters)."""
    monkeypatch.setenv("REBOUND_ENDED_MEMORY", value)
    with pytest.raises(ConfigurationError, match="REBOUND_ENDED_MEMORY"):
        load_settings()
