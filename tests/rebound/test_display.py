"""How keys and times are shown to a person (``rebound/display.py``): the command line and the audit log lines."""

from __future__ import annotations

import pytest

from rebound.display import key_label, logged_key, printable, utc_time


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        (b"item-42", "'item-42'"),
        (b"it's", "'it's'"),
        (b"retry-\xff\xfe", "'retry-\\xff\\xfe' (base64 cmV0cnkt__4=)"),
        (b"\x1b[31mred", "'\\x1b[31mred' (base64 G1szMW1yZWQ=)"),
        ("line\u2028break".encode(), "'line\\u2028break'"),
        (None, "None"),
    ],
)
def test_an_audit_line_names_a_key_as_quoted_escaped_text_with_its_base64_when_the_text_does_not_name_it(
    key: bytes | None, shown: str
) -> None:
    assert logged_key(key) == shown
    assert printable(shown) == shown  # nothing left that a terminal or a log reader would act on


def test_the_command_line_label_is_the_same_text_unquoted() -> None:
    assert key_label("a\x00b", "YQBi") == "a\\x00b (base64 YQBi)"
    assert key_label("plain") == "plain"


def test_a_time_is_utc_iso_8601_to_the_second() -> None:
    assert utc_time(1_746_093_600_999) == "2025-05-01T10:00:00Z"
