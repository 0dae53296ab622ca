"""Naming a key from outside (text, or base64 of its bytes) and naming it back (``rebound/key_names.py``)."""

from __future__ import annotations

import base64

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rebound.headers import Provenance
from rebound.key_names import (
    BASE64,
    TEXT,
    KeyNameError,
    base64_of_key,
    key_names,
    key_of_base64,
    key_of_name,
    needs_base64,
    partition_of_param,
)
from rebound.state import escaped_key, table_key

SCHEMA_REGISTRY_KEY = b"\x00\x00\x00\x00\x07" + b"\x10\xff\xfeitem"
"""A schema-registry key: magic byte 0, schema id 7, then the encoded key (here not UTF-8)."""


@given(st.binary(min_size=1))
@example(b"retry-\xff\xfe")
@example(SCHEMA_REGISTRY_KEY)
@example(b"a\\xffb")  # a backslash the text form could not tell from an escape
@example(b"\xfb\xff")  # "+/" in standard base64, "-_" in URL-safe
def test_any_bytes_round_trip_through_their_base64_name(key: bytes) -> None:
    name = base64_of_key(key)
    assert key_of_name(name, BASE64) == key
    assert key_of_base64(name.rstrip("=")) == key  # padding optional
    assert key_of_base64(base64.b64encode(key).decode()) == key  # the standard alphabet too
    assert all(c.isalnum() or c in "-_=" for c in name)  # nothing to escape in a URL path


@given(st.binary(min_size=1))
def test_a_view_s_names_always_lead_back_to_the_key(key: bytes) -> None:
    names = key_names(key)
    if "key_base64" in names:
        assert key_of_name(names["key_base64"], BASE64) == key
    else:
        assert key_of_name(names["key"], TEXT) == key


@given(
    st.text(min_size=1).filter(
        lambda t: t not in (".", "..") and not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in t)
    )
)
def test_plain_text_keys_are_named_as_before(text: str) -> None:
    key = text.encode("utf-8")
    assert key_of_name(text) == key_of_name(text, TEXT) == key
    assert key_names(key) == {"key": text}  # no base64: the text names it


@pytest.mark.parametrize(
    ("key", "text"),
    [
        (b"retry-\xff\xfe", "retry-\\xff\\xfe"),
        (SCHEMA_REGISTRY_KEY, "\x00\x00\x00\x00\x07\x10\\xff\\xfeitem"),
        (b"\x00\x00\x00\x00\x07item-42", "\x00\x00\x00\x00\x07item-42"),  # valid UTF-8, but a 0 byte in front
    ],
)
def test_keys_the_text_does_not_name_get_their_base64(key: bytes, text: str) -> None:
    assert needs_base64(key)
    assert key_names(key) == {"key": text, "key_base64": base64_of_key(key)}


def test_the_reported_key_by_name() -> None:
    assert base64_of_key(b"retry-\xff\xfe") == "cmV0cnkt__4="
    assert key_of_name("cmV0cnkt__4=", BASE64) == key_of_name("cmV0cnkt//4", BASE64) == b"retry-\xff\xfe"


def test_a_command_line_argument_s_undecodable_bytes_are_the_key_s_bytes() -> None:
    argument = b"retry-\xff\xfe".decode("utf-8", errors="surrogateescape")  # how Python hands such argv over
    assert key_of_name(argument) == b"retry-\xff\xfe"


@pytest.mark.parametrize(
    ("name", "encoding", "says"),
    [
        ("", BASE64, "empty key"),
        ("===", BASE64, "empty key"),
        ("ab$d", BASE64, "'$' is not a base64 character"),
        ("ab.d", BASE64, "'.' is not a base64 character"),
        ("abcde", BASE64, "length"),  # 5 characters: no bytes encode to that
        ("ab=", BASE64, "length"),  # one padding character where two are due
        ("abc==", BASE64, "length"),
        ("QR==", BASE64, "stray trailing bits"),  # "QQ==" is b"A"; "QR" would be b"A" too
        ("a", "hex", "key_encoding must be one of text, base64"),
        ("\ud800", TEXT, "lone surrogate"),
    ],
)
def test_names_that_name_no_key_are_refused_saying_why(name: str, encoding: str, says: str) -> None:
    with pytest.raises(KeyNameError, match=says.replace("$", r"\$").replace(".", r"\.")):
        key_of_name(name, encoding)


@given(st.text(max_size=12))
def test_any_text_is_a_key_or_a_key_name_error(name: str) -> None:
    try:
        key = key_of_name(name, BASE64)
    except KeyNameError:
        return
    assert base64_of_key(key).rstrip("=") == name.rstrip("=").replace("+", "-").replace("/", "_")


@pytest.mark.parametrize(
    ("name", "other"), [("QR==", "QQ"), ("cmV0cnkt__5", "cmV0cnkt__4"), ("cmV0cnkt//7=", "cmV0cnkt__4")]
)
def test_a_name_with_stray_bits_is_refused_without_naming_the_key_it_is_close_to(name: str, other: str) -> None:
    """Pasting a suggested name back would act on a key the operator never named: the error says only what is
    wrong."""
    with pytest.raises(KeyNameError, match="stray trailing bits") as refused:
        key_of_name(name, BASE64)
    message = str(refused.value).replace(repr(name), "")
    assert other not in message and other.replace("_", "/") not in message


@given(st.binary(min_size=1))
@example(b"\x00items/0/7")  # the null key of the record below, as a real key's bytes
@example(b"\x01x")
@example(b"\x00")
@example("ключ".encode())
def test_the_names_a_view_gives_lead_to_the_table_key_the_record_is_stored_under(key: bytes) -> None:
    """A key named from outside (text or base64, as :func:`key_names` names it back) is looked for under the table
    key its record was parked under (the views and admin actions read ``escaped_key`` of the named bytes), never a
    null key's."""
    provenance = Provenance("items", 0, 7, 0, 0)
    names = key_names(key)
    named = key_of_name(names["key_base64"], BASE64) if "key_base64" in names else key_of_name(names["key"], TEXT)
    assert escaped_key(named) == table_key(key, provenance) != table_key(None, provenance)


@pytest.mark.parametrize("key", [b".", b".."])
def test_a_key_that_is_a_dot_segment_is_named_in_base64(key: bytes) -> None:
    """A URL drops ``.`` and ``..`` path segments (``/retry/keys/..`` is ``/retry/``): their text names no key."""
    assert needs_base64(key)
    assert key_names(key) == {"key": key.decode(), "key_base64": base64_of_key(key)}
    assert not needs_base64(b"...") and not needs_base64(b"a..")


def test_a_partition_is_an_integer_of_the_main_topic_s_partitions() -> None:
    assert partition_of_param(None, 3) is None  # not given: routed by the key's bytes
    assert [partition_of_param(text, 3) for text in ("0", "1", "2")] == [0, 1, 2]


@pytest.mark.parametrize("text", ["3", "-1", "", "x", "1.0", " 1", "1 ", "+1", "\u0661"])
def test_a_partition_that_names_none_of_the_main_topic_s_is_refused(text: str) -> None:
    with pytest.raises(KeyNameError, match=r"partition must be an integer from 0 to 2 \(3 partitions\), not "):
        partition_of_param(text, 3)
