"""How a message key is named from outside, and named back (pure, no I/O).

The key views, the admin actions on a key and the command line take a key as text (its UTF-8 bytes), or, with
``key_encoding=base64``, by its bytes in base64. Keys are bytes, and many are not UTF-8 text: a schema-registry key is
a 0 byte, a four-byte schema id and the encoded key, and the text a view shows for such a key (:func:`key_text`,
undecodable bytes as ``\\xff``) is not the key (``\\`` is also a byte a key may hold). So a view answering about a key
names it back both ways (:func:`key_names`): its text, and its base64 whenever the text cannot be sent back as it is.

Base64 rather than hex: bytes in JSON are base64 elsewhere too (the admin and release commands carry table keys that
way), it is two thirds the length of hex, and its URL-safe alphabet (RFC 4648 section 5: ``-`` and ``_`` for ``+`` and
``/``) needs no escaping in a URL path.

What is read and what is written back: a view names a key back by one base64 name, :func:`base64_of_key` (URL-safe,
padded). Reading is looser, so that a value copied from a tool writing standard base64 works too: each ``-``/``_`` may
be written ``+``/``/`` (``/`` percent-encoded in a path: ``%2F``), the two alphabets mixed in one name, and the
padding may be left out: ``2**k`` spellings for a name holding ``k`` of ``-`` and ``_``, twice that when it is padded.
Each spelling names exactly one key: its last character's unused bits must be zero (no stray trailing bits), so no
two keys share one. As text, a key is named by its UTF-8 text, one name; over HTTP a key that is not UTF-8 has no
text name (on the command line an argument's bytes that are not UTF-8 reach Python as lone surrogates, which
:func:`key_of_name` turns back into those bytes).
"""

from __future__ import annotations

import base64
import binascii
import string

from rebound.attempts import key_text

KEY_ENCODING_PARAM = "key_encoding"
"""The query parameter of the key views and admin actions saying how the path's key is written."""
TEXT = "text"
BASE64 = "base64"
KEY_ENCODINGS = (TEXT, BASE64)
PARTITION_PARAM = "partition"
"""The query parameter naming the partition of the main topics that holds the key (routing by it, not by the key's
hash): for keys a producer placed with another partitioner than murmur2."""

_URL_SAFE = frozenset(string.ascii_letters + string.digits + "-_")


class KeyNameError(ValueError):
    """A key name that names no key, or a partition that is none of the main topics' (the views answer 400 with its
    message, the command line exits 2)."""


def key_of_name(name: str, encoding: str | None = None) -> bytes:
    """The key's bytes: ``name``'s UTF-8 bytes as text (the default, as before ``key_encoding`` existed), or the
    bytes ``name`` is the base64 of. As text, the bytes Python keeps as lone surrogates (a command-line argument that
    is not UTF-8: ``surrogateescape``) are those bytes again."""
    if encoding is None or encoding == TEXT:
        try:
            return name.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError as exc:
            raise KeyNameError(f"not a key's text: {name!r} holds a lone surrogate") from exc
    if encoding == BASE64:
        return key_of_base64(name)
    raise KeyNameError(f"{KEY_ENCODING_PARAM} must be one of {', '.join(KEY_ENCODINGS)}, not {encoding!r}")


def key_of_base64(text: str) -> bytes:
    """The bytes ``text`` is the canonical base64 of, in either alphabet, padded or not; else :class:`KeyNameError`."""
    body = text.rstrip("=")
    padding = len(text) - len(body)
    normal = body.replace("+", "-").replace("/", "_")
    if not normal:
        raise KeyNameError("an empty key has no name: give the base64 of at least one byte")
    bad = sorted(set(normal) - _URL_SAFE)
    if bad:
        raise KeyNameError(f"not base64: {bad[0]!r} is not a base64 character (in {text!r})")
    missing = -len(normal) % 4
    if missing == 3 or padding not in (0, missing):
        raise KeyNameError(f"not base64: {text!r} has a length no base64 of a key has")
    try:
        key = base64.urlsafe_b64decode(normal + "=" * missing)
    except binascii.Error as exc:  # (already excluded above; kept so that no input ever escapes as another error)
        raise KeyNameError(f"not base64: {text!r} ({exc})") from exc
    if base64_of_key(key).rstrip("=") != normal:
        raise KeyNameError(f"not the canonical base64 of a key: {text!r} has stray trailing bits")
    return key


def base64_of_key(key: bytes) -> str:
    """The name of ``key`` with ``key_encoding=base64``: URL-safe base64, padded."""
    return base64.urlsafe_b64encode(key).decode("ascii")


DOT_SEGMENTS = (b".", b"..")
"""Keys whose text is a dot segment: a URL drops them from its path (``/retry/keys/..`` is ``/retry/``)."""


def needs_base64(key: bytes) -> bool:
    """Whether ``key``'s text does not name it well enough to be sent back: not UTF-8 (the text shows the bytes as
    escapes), holding a control character (a terminal, a form or a copy drops or mangles them: a schema-registry
    key starts with a 0 byte even when the rest is text), or a dot segment (:data:`DOT_SEGMENTS`)."""
    if key in DOT_SEGMENTS:
        return True
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return any(ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F for char in text)


def key_names(key: bytes) -> dict[str, str]:
    """How a view names a key: ``key`` (its text, :func:`key_text`) and, when :func:`needs_base64`, ``key_base64``
    (to send back with ``key_encoding=base64``)."""
    names = {"key": str(key_text(key))}
    if needs_base64(key):
        names["key_base64"] = base64_of_key(key)
    return names


def partition_of_param(text: str | None, partitions: int) -> int | None:
    """The partition ``?partition=`` names (None: not given), one of the main topics' ``partitions``: decimal digits
    only, ``0 <= N < partitions``; else :class:`KeyNameError`."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) >= partitions:
        raise KeyNameError(
            f"{PARTITION_PARAM} must be an integer from 0 to {partitions - 1} ({partitions} partitions), not {text!r}"
        )
    return int(text)
