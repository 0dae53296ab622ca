"""How keys and times are shown to a person (``rebound/display.py``): the command line and the audit log lines."""

from __future__ import annotations

import base64
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebound.display import key_label, logged_key, printable, utc_time


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        (b"item-42", "'item-42'"),
        (b"it's", "'it\\'s'"),
        (b"C:\\dir", "'C:\\\\dir'"),
        (b"retry-\xff\xfe", "'retry-\\xff\\xfe' (base64 cmV0cnkt__4=)"),
        (b"\x1b[31mred", "'\\x1b[31mred' (base64 G1szMW1yZWQ=)"),
        ("line\u2028break".encode(), "'line\\u2028break' (base64 bGluZeKAqGJyZWFr)"),
        ("no\u00a0break".encode(), "'no\\xa0break' (base64 bm_CoGJyZWFr)"),
        ("zero\u200bwidth".encode(), "'zero\\u200bwidth' (base64 emVyb-KAi3dpZHRo)"),
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


_LOGGED = re.compile(r"'((?:[^'\\]|\\.)*)'(?: \(base64 ([-_A-Za-z0-9]+=*)\))?")
_UNQUOTED = {"\\\\": "\\", "\\'": "'"}


@given(st.one_of(st.binary(max_size=12), st.text(max_size=12).map(lambda text: text.encode("utf-8", "surrogatepass"))))
def test_an_audit_lines_key_names_exactly_one_key(key: bytes) -> None:
    """Review of the audit lines: the base64 was added for control characters only (a ``U+00A0`` or ``U+2028`` key
    was shown escaped, not named back), and ``'`` and ``\\`` were not escaped, so a key holding ``' (base64 ...)``
    read as another key. Now the quoted text is read back by Python's quoting, and either the base64 follows or the
    text, its ``\\\\`` and ``\\'`` undone, is the key."""
    shown = logged_key(key)
    match = _LOGGED.fullmatch(shown)
    assert match is not None, shown
    quoted, named = match.groups()
    if named is not None:
        assert base64.urlsafe_b64decode(named) == key
    else:
        text = re.sub(r"\\.", lambda escape: _UNQUOTED[escape.group()], quoted)  # (any other escape: KeyError)
        assert text.encode("utf-8") == key
    assert printable(shown) == shown


def test_a_key_holding_a_base64_label_does_not_read_as_another_key() -> None:
    bad = logged_key(b"retry-\xff")
    assert bad == "'retry-\\xff' (base64 cmV0cnkt_w==)"
    forged = logged_key(b"retry-\\xff' (base64 cmV0cnkt_w==)")
    assert forged == "'retry-\\\\xff\\' (base64 cmV0cnkt_w==)'" and not forged.startswith(bad)


def test_a_time_is_utc_iso_8601_to_the_second() -> None:
    assert utc_time(1_746_093_600_999) == "2025-05-01T10:00:00Z"
    assert utc_time(-1) == "1969-12-31T23:59:59Z"  # rounded down, as after it
    assert utc_time(253_402_300_799_999) == "9999-12-31T23:59:59Z"
    assert utc_time(-62_135_596_800_000) == "0001-01-01T00:00:00Z"


@pytest.mark.parametrize("ms", [10**20, 2**63, -(10**17), 253_402_300_800_000, -62_135_596_800_001])
def test_a_number_that_is_no_time_of_the_years_1_to_9999_is_shown_as_it_is(ms: int) -> None:
    """Review: ``time.gmtime`` raised for out-of-range values (``OSError`` 75 for 1e17 s, ``OverflowError`` past
    ``time_t``) and printed 5-digit or 9-digit years below that; an admin command's ``requested_at`` is any int."""
    assert utc_time(ms) == str(ms)
