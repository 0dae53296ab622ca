"""The settings the REBOUND_* variables configure: defaults, values given as the environment's text, strict errors
naming the variable. The core reads no environment (``tests/rebound/test_settings_pure.py``); reading it, and the
``.env`` file, is ``app/environment.py``'s (``tests/app/test_environment.py``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rebound.errors import ConfigurationError
from rebound.routing import Classification
from rebound.settings import ENV_PREFIX, Settings, load_settings, reveal


def from_variables(**variables: str) -> Settings:
    """The settings ``REBOUND_X=text`` gives, as text, the way the environment gives it."""
    return load_settings(**{name.removeprefix(ENV_PREFIX).lower(): value for name, value in variables.items()})


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


def test_values_as_text() -> None:
    settings = from_variables(
        REBOUND_RETRY_SEQUENCE="1s,10s",
        REBOUND_MAIN_TOPICS=" orders , items,orders ",
        REBOUND_WEB_PORT="7070",
        REBOUND_MAX_RETRY_DURATION="1m",
        REBOUND_ADMIN_TOKEN="t0k3n",
        REBOUND_APP_ID="shop",
    )
    assert settings.policy.delays_ms == (1_000, 10_000)
    assert settings.policy.max_duration_ms == 60_000
    assert settings.policy.tier_labels == ("1s", "10s")
    assert settings.topics == ("orders", "items")  # trimmed, de-duplicated, in order
    assert settings.web_port == 7070
    assert reveal(settings.admin_token) == "t0k3n"
    assert "t0k3n" not in repr(settings) and "t0k3n" not in str(settings.model_dump())
    assert settings.app_id == "shop"


def test_exponential_sequence() -> None:
    assert from_variables(REBOUND_RETRY_SEQUENCE="exp:1s..8s").policy.delays_ms == (1_000, 2_000, 4_000, 8_000)


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
        ("REBOUND_WEB_PORT", "0"),  # Faust refuses port 0 (its Port setting is 1 to 65,535), after Rebound's checks
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
def test_invalid_values_name_the_variable(variable, value) -> None:
    with pytest.raises(ConfigurationError, match=variable):
        from_variables(**{variable: value})


def test_handler_is_read_and_an_empty_one_is_unset() -> None:
    assert from_variables(REBOUND_HANDLER="shop.handlers:handle").handler == "shop.handlers:handle"
    assert from_variables(REBOUND_HANDLER="  ").handler is None  # the worker then says REBOUND_HANDLER is not set


def test_a_malformed_handler_says_what_the_form_is() -> None:
    with pytest.raises(ConfigurationError) as raised:
        from_variables(REBOUND_HANDLER="shop.handlers.handle")
    assert str(raised.value).startswith("REBOUND_HANDLER='shop.handlers.handle' is not of the form package.module:")
    assert "for example REBOUND_HANDLER=myservice.handlers:handle" in str(raised.value)


@pytest.mark.parametrize(
    "value",
    [".h:handle", "h..x:handle", "h.:handle", "h:", ":handle", "1h:handle", "h:1handle", "h:handle.x", "my-svc:handle"],
)
def test_a_handler_must_be_dotted_identifiers_then_a_name(value) -> None:
    """Not only one ':': a relative module (``.h``, a TypeError from importlib) or an empty part (``h..x``) is refused
    as the setting it is, before anything is imported."""
    with pytest.raises(ConfigurationError) as raised:
        from_variables(REBOUND_HANDLER=value)
    assert str(raised.value).startswith(f"REBOUND_HANDLER={value!r} is not of the form package.module:callable")


@pytest.mark.parametrize(
    ("value", "read"),
    [("h:handle", "h:handle"), ("shop_2.handlers.v1:_handle", "shop_2.handlers.v1:_handle"), (" a.b:c ", "a.b:c")],
)
def test_well_formed_handlers_are_accepted(value, read) -> None:
    assert from_variables(REBOUND_HANDLER=value).handler == read


@pytest.mark.parametrize("value", ["rocksdb://", "memory://"])
def test_the_supported_table_stores_are_accepted(value) -> None:
    assert from_variables(REBOUND_STORE=value).store == value


@pytest.mark.parametrize("value", ["bogus://", "aerospike://", "rocksdb", "", "redis://localhost"])
def test_an_unsupported_table_store_is_refused(value) -> None:
    with pytest.raises(ConfigurationError) as raised:
        from_variables(REBOUND_STORE=value)
    message = str(raised.value)
    assert message.startswith(f"REBOUND_STORE={value!r} is not a table store Rebound supports"), message
    assert "rocksdb://" in message and "memory://" in message


def test_type_and_range_errors_show_the_variable_its_value_and_the_rule() -> None:
    with pytest.raises(ConfigurationError) as raised:
        from_variables(REBOUND_CONCURRENCY="-3", REBOUND_WEB_PORT="http", REBOUND_UNKNOWN_ERRORS="sometimes")
    problems = str(raised.value).split("; ")
    assert "REBOUND_CONCURRENCY='-3': must be greater than or equal to 1" in problems
    assert "REBOUND_UNKNOWN_ERRORS='sometimes': must be 'retryable' or 'permanent'" in problems
    assert any(problem.startswith("REBOUND_WEB_PORT='http': must be a valid integer") for problem in problems)


def test_a_secrets_value_is_never_shown_in_an_error() -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_HEADER_SECRET") as raised:
        load_settings(header_secret=98765432)
    assert "98765432" not in str(raised.value)


def test_empty_sequence_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_RETRY_SEQUENCE"):
        from_variables(REBOUND_RETRY_SEQUENCE="")


def test_republish_needs_a_secret() -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_HEADER_SECRET"):
        from_variables(REBOUND_RELEASE_MODE="republish")
    settings = from_variables(REBOUND_RELEASE_MODE="republish", REBOUND_HEADER_SECRET="s")
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
def test_bootstrap_servers_strips_scheme(broker, servers) -> None:
    assert from_variables(REBOUND_BROKER=broker).bootstrap_servers == servers


@pytest.mark.parametrize(
    ("broker", "handed_to_faust"),
    [
        ("127.0.0.1:28904,", "127.0.0.1:28904"),
        (" kafka://a:1 , b:2 ,", "kafka://a:1;b:2"),
        ("kafka://a:1;;b:2", "kafka://a:1;b:2"),
        ("a:1", "a:1"),
    ],
)
def test_the_broker_list_faust_gets_has_no_empty_entry(broker: str, handed_to_faust: str) -> None:
    """Found trying it as a new user: ``REBOUND_BROKER=127.0.0.1:28904,`` passed the check (empty entries skipped), but
    the raw string went to Faust, whose list made the empty entry ``kafka:``, that is ``127.0.0.1:9092``: a worker could
    bootstrap from a local Kafka that is not the configured one."""
    assert from_variables(REBOUND_BROKER=broker).broker == handed_to_faust


@pytest.mark.parametrize("broker", ["http://127.0.0.1:9092", "kafka://a:1,https://b:2", "", " , "])
def test_a_broker_url_that_is_not_kafka_is_a_configuration_error(broker: str) -> None:
    """Found trying it as a new user: ``http://`` passed the settings and the worker died in Faust's set-up with a
    58-line chained traceback."""
    with pytest.raises(ConfigurationError, match="REBOUND_BROKER"):
        from_variables(REBOUND_BROKER=broker)


def test_classifier_from_settings() -> None:
    class ItemGone(Exception):
        pass

    classifier = from_variables(
        REBOUND_PERMANENT_ERRORS="ValueError, ItemGone ,",
        REBOUND_RETRYABLE_ERRORS="UnicodeError",
        REBOUND_UNKNOWN_ERRORS="permanent",
    ).classifier
    assert classifier.permanent_names == frozenset({"ValueError", "ItemGone"})
    assert classifier.classify(ItemGone()) is Classification.PERMANENT
    assert classifier.classify(ValueError()) is Classification.PERMANENT
    assert classifier.classify(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x")) is Classification.RETRYABLE
    assert classifier.classify(OSError()) is Classification.PERMANENT


def test_handler_timeout_seconds() -> None:
    assert from_variables(REBOUND_HANDLER_TIMEOUT="1500ms").handler_timeout_s == 1.5


def test_the_settings_class_takes_values_directly() -> None:
    assert Settings(web_host="0.0.0.0").web_host == "0.0.0.0"


def test_the_revocation_drain_defaults_to_a_quarter_of_the_rebalance_timeout() -> None:
    assert load_settings().revoke_drain_s == 15.0  # 60 s rebalance timeout; 60 - 30 - 1 - 3 would allow 26
    short = {"REBOUND_REBALANCE_TIMEOUT": "4", "REBOUND_HEARTBEAT_INTERVAL": "0.5", "REBOUND_HANDLER_TIMEOUT": "1s"}
    assert from_variables(**short).revoke_drain_s == 1.0
    assert from_variables(**short, REBOUND_REVOKE_DRAIN="0").revoke_drain_s == 0.0


def test_the_default_drain_shrinks_to_what_the_handler_timeout_leaves_of_the_rebalance() -> None:
    """A record started at the end of the drain may run for the handler timeout and its grace: the group evicts a
    member whose revocation takes longer than the rebalance timeout."""
    assert from_variables(REBOUND_HANDLER_TIMEOUT="50s").revoke_drain_s == 6.0  # 60 - 50 - 1 - 3
    assert from_variables(REBOUND_HANDLER_TIMEOUT="2m").revoke_drain_s == 0.0


def test_a_revocation_drain_the_group_would_not_wait_for_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"REBOUND_REVOKE_DRAIN .* REBOUND_HANDLER_TIMEOUT"):
        from_variables(REBOUND_REBALANCE_TIMEOUT="10", REBOUND_REVOKE_DRAIN="5")
    fits = from_variables(REBOUND_REBALANCE_TIMEOUT="10", REBOUND_REVOKE_DRAIN="5", REBOUND_HANDLER_TIMEOUT="1s")
    assert fits.revoke_drain_s == 5.0  # 5 + 1 + 1 + 3 = 10: just fits
    none = from_variables(REBOUND_REBALANCE_TIMEOUT="10", REBOUND_REVOKE_DRAIN="0", REBOUND_HANDLER_TIMEOUT="2m")
    assert none.revoke_drain_s == 0.0  # no drain fits any budget


@pytest.mark.parametrize("value", ["", "  ", "0s"])
def test_an_empty_or_zero_ended_memory_is_refused_at_start_up(value) -> None:
    """Every settle reads it: accepted empty, each release failed with a ConfigurationError (repeated dead letters)."""
    with pytest.raises(ConfigurationError, match="REBOUND_ENDED_MEMORY"):
        from_variables(REBOUND_ENDED_MEMORY=value)
