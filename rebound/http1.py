"""HTTP/1.1 on the wire for the push handler's own client, without I/O: a request's bytes and a response parser.

``app/http_client.py`` writes what :class:`RequestHead` builds and feeds :class:`ResponseParser` what the socket gives,
in whatever pieces it comes. Only what the handler needs is read: the status, the reason, ``Retry-After``, the body's
framing (``Content-Length``, ``chunked``, or to the connection's close) and whether the connection can be kept
(``Connection: close``, HTTP/1.0, a body over the drain bound, bytes past the response's end). The body's first bytes
are kept for an error message, the rest only counted. A line ends in CRLF or a bare LF (:data:`_END_OF_HEAD`).
Anything that is not an HTTP/1.x response raises :class:`MalformedResponse`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_HEAD_BYTES = 65_536
"""The largest response header section (status line and headers) read; a longer one is malformed."""
MAX_CHUNK_LINE_BYTES = 4096
"""The longest chunk-size line (with its extensions) or trailer line read."""

_FORBIDDEN_HEADER_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""Control characters no header name or value may carry (a CR or LF would start a header of the value's own)."""
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([^\r\n]*))?")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([^\r\n]*?)[ \t]*")
_HTTP_1 = b"HTTP/1."
_END_OF_HEAD = re.compile(rb"\n\r?\n")
"""The empty line that ends a header section; each line ends in CRLF or a bare LF (RFC 9112 2.2 lets a recipient
take LF alone, as h11 does). Searched from the LF, not an optional CR, so the regex engine skips ahead to each LF (a
CR before it is taken off the head where the match is found)."""
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


class MalformedResponse(ValueError):
    """The service's bytes are not an HTTP/1.x response: a bad status line or header line, a header section over
    :data:`MAX_HEAD_BYTES`, conflicting ``Content-Length`` values, broken chunked framing."""


class RequestHead:
    """The request line and headers of every POST to one URL, all but the per-call headers built once.

    Header order: ``Host``, ``User-Agent``, the call's headers, ``Accept``, ``Accept-Encoding``, ``Content-Length``.
    Values are sent as UTF-8; a control character in any of them (a CR or LF would add a header) raises
    ``ValueError``, before anything is sent."""

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, *, target: str, host: str, fixed: Mapping[str, str], trailing: Mapping[str, str]) -> None:
        for name, value in (*fixed.items(), *trailing.items(), ("Host", host)):
            _check(name, value)
        _check("request target", target)
        self._prefix = f"POST {target} HTTP/1.1\r\nHost: {host}\r\n" + "".join(
            f"{n}: {v}\r\n" for n, v in fixed.items()
        )
        self._suffix = "".join(f"{n}: {v}\r\n" for n, v in trailing.items()) + "Content-Length: "

    def build(self, headers: Mapping[str, str], body_length: int) -> bytes:
        if _FORBIDDEN_HEADER_CHARS.search("".join(headers.values()) + "".join(headers)) is not None:
            raise ValueError("a control character in a request header: potential header injection, not sent")
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        return f"{self._prefix}{lines}{self._suffix}{body_length}\r\n\r\n".encode()


def _check(name: str, value: str) -> None:
    if _FORBIDDEN_HEADER_CHARS.search(name) is not None or _FORBIDDEN_HEADER_CHARS.search(value) is not None:
        raise ValueError(f"a control character in {name}: potential header injection")


class ResponseParser:
    """One response to a POST, fed in pieces (:meth:`feed`, then :meth:`feed_eof` if the connection ends first).

    Interim 1xx responses (``100 Continue``, ``103 Early Hints``) are skipped; ``101`` is final and ends the connection's
    use. 204, 304 and 1xx have no body. ``Transfer-Encoding`` whose last coding is ``chunked`` is read chunk by chunk
    (trailers skipped), any other ``Transfer-Encoding`` (or one on HTTP/1.0) to the connection's close, as is a
    response with no ``Content-Length``; ``Transfer-Encoding`` wins over ``Content-Length`` and the connection is then
    not kept. Body bytes are counted up to ``limit``: past it the response counts as complete and the connection is
    not kept (:attr:`reusable`); the first ``keep`` are kept (:attr:`body`)."""

    __slots__ = (
        "_buffer",
        "_chunk_left",
        "_keep",
        "_kept",
        "_left",
        "_limit",
        "_scanned",
        "_state",
        "body_bytes",
        "reason",
        "received",
        "retry_after",
        "reusable",
        "status",
        "truncated",
    )

    def __init__(self, *, keep: int, limit: int) -> None:
        self._keep = keep
        self._limit = limit
        self._state = _HEAD
        self._buffer = bytearray()
        self._scanned = 0
        self._kept: list[bytes] = []
        self._left = 0
        self._chunk_left = 0
        self.received = 0
        """Bytes of the response received so far, framing included: 0 means nothing of it arrived."""
        self.status = 0
        self.reason = ""
        self.retry_after: str | None = None
        self.reusable = False
        """The response ended where its framing said, with nothing after it, and the service keeps the connection."""
        self.truncated = False
        """The connection ended before the body's announced end (the status stands)."""
        self.body_bytes = 0

    @property
    def head_done(self) -> bool:
        """The status line and headers are in: the status is the answer, whatever happens to the body."""
        return self._state != _HEAD

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def body(self) -> bytes:
        """The body's first ``keep`` bytes."""
        return b"".join(self._kept)

    def feed(self, data: bytes) -> bool:
        """Take the next bytes of the connection; True once the response is complete (or past the body's bound)."""
        self.received += len(data)
        if self._state == _HEAD:
            data = self._read_head(data)
            if self._state == _HEAD:
                return False
        if self._state == _LENGTH:
            return self._read_length(data)
        if self._state == _UNTIL_CLOSE:
            self._count(data)
            if self.body_bytes >= self._limit:
                self._state = _DONE
            return self._state == _DONE
        if self._state == _DONE:
            if data:
                self.reusable = False  # bytes past the response's end: the connection's state is unknown
            return True
        return self._read_chunked(data)

    def feed_eof(self) -> bool:
        """The connection ended. True when the response is complete all the same (a body read to the close, or one
        already complete); a response whose head is in but whose body was cut short is complete and
        :attr:`truncated`. False when the head is not in: no answer."""
        if self._state == _HEAD:
            return False
        if self._state != _DONE:
            self.truncated = self._state != _UNTIL_CLOSE
            self._state = _DONE
        self.reusable = False
        return True

    # ---------------------------------------------------------------------------------------------------- the head

    def _read_head(self, data: bytes) -> bytes:
        while True:
            if self._buffer:  # the head came in pieces: gathered in place, searched from where the last search ended
                buffer = self._buffer
                buffer += data
                found = _END_OF_HEAD.search(buffer, self._scanned)
                if found is not None:
                    data = bytes(buffer)
            else:
                found = _END_OF_HEAD.search(data)
                if found is None:
                    self._buffer = buffer = bytearray(data)
            if found is None:
                if not _HTTP_1.startswith(bytes(buffer[:7])):  # not waiting for the end of what is no HTTP
                    raise MalformedResponse(f"not an HTTP/1.x response: {bytes(buffer[:60])!r}")
                if len(buffer) > MAX_HEAD_BYTES:
                    raise MalformedResponse(f"no end of the header section within {MAX_HEAD_BYTES} bytes")
                self._scanned = max(0, len(buffer) - 2)
                return b""
            end = found.start()
            if end and data[end - 1] == 13:  # (the CR of the last line's CRLF)
                end -= 1
            if end > MAX_HEAD_BYTES:
                raise MalformedResponse(f"a header section over {MAX_HEAD_BYTES} bytes")
            self._buffer = bytearray()
            self._scanned = 0
            rest = data[found.end() :]
            if self._parse_head(data[:end]):
                return rest
            data = rest  # an interim 1xx response: the final one follows
            if not data:
                return b""

    def _parse_head(self, head: bytes) -> bool:
        """The status line and headers; False for an interim 1xx response (skipped)."""
        lines = head.split(b"\r\n")
        if len(lines) != head.count(b"\n") + 1:  # a bare LF ends some line
            lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]
        match = _STATUS_LINE.fullmatch(lines[0])
        if match is None:
            raise MalformedResponse(f"not an HTTP/1.x status line: {lines[0][:60]!r}")
        minor, code, reason = match.groups()
        status = int(code)
        if 100 <= status < 200 and status != 101:
            return False
        length: int | None = None
        codings: list[bytes] = []
        connection = b""
        retry_after: bytes | None = None
        for name, value in _fields(lines):
            lowered = name.lower()
            if lowered == b"content-length":
                length = _content_length(value, length)
            elif lowered == b"transfer-encoding":
                codings.extend(coding.strip(b" \t").lower() for coding in value.split(b","))
            elif lowered == b"connection":
                connection += b"," + value.lower()
            elif lowered == b"retry-after" and retry_after is None:
                retry_after = value
        self.status = status
        self.reason = reason.decode("utf-8", "replace") if reason else ""
        self.retry_after = None if retry_after is None else retry_after.decode("utf-8", "replace")
        tokens = {token.strip(b" \t") for token in connection.split(b",")}
        keep_alive = b"keep-alive" in tokens if minor == b"0" else b"close" not in tokens
        self.reusable = keep_alive and status != 101
        if status in (101, 204, 304):
            self._state = _DONE
        elif codings:
            if codings[-1] == b"chunked" and minor == b"1":
                self._state = _CHUNK_SIZE
                if length is not None:  # both: Transfer-Encoding wins, and the connection is not kept (RFC 9112 6.1)
                    self.reusable = False
            else:
                self._state = _UNTIL_CLOSE
                self.reusable = False
        elif length is not None:
            self._left = length
            self._state = _LENGTH if length else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self.reusable = False
        return True

    # ---------------------------------------------------------------------------------------------------- the body

    def _count(self, data: bytes) -> None:
        room = self._keep - self.body_bytes  # (the kept bytes are the body's first ones)
        if room > 0 and data:
            self._kept.append(data[:room])
        self.body_bytes += len(data)

    def _read_length(self, data: bytes) -> bool:
        left = self._left
        if len(data) > left:
            self.reusable = False  # bytes past the response's end
            data = data[:left]
        self._count(data)
        self._left = left - len(data)
        if self._left == 0:
            self._state = _DONE
        elif self.body_bytes >= self._limit:
            self._state = _DONE
            self.reusable = False
        return self._state == _DONE

    def _read_chunked(self, data: bytes) -> bool:
        if self._buffer:
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer = bytearray()
        position = 0
        while position < len(data) or self._state == _DONE:
            state = self._state
            if state == _DONE:
                if position < len(data):
                    self.reusable = False
                return True
            if state == _CHUNK_DATA:
                piece = data[position : position + self._chunk_left]
                self._count(piece)
                position += len(piece)
                self._chunk_left -= len(piece)
                if self._chunk_left == 0:
                    self._state = _CHUNK_END
                elif self.body_bytes >= self._limit:
                    self._state = _DONE
                    self.reusable = False
                continue
            if state == _CHUNK_END:
                ending = _line_end(data[position : position + 2])
                if not ending:
                    break
                position += ending
                self._state = _CHUNK_SIZE
                if self.body_bytes >= self._limit:
                    self._state = _DONE
                    self.reusable = False
                continue
            end = data.find(b"\n", position)
            if end < 0:
                if len(data) - position > MAX_CHUNK_LINE_BYTES:
                    raise MalformedResponse(f"a chunk-size or trailer line over {MAX_CHUNK_LINE_BYTES} bytes")
                break
            line = data[position:end]
            if line.endswith(b"\r"):  # CRLF, or a bare LF
                line = line[:-1]
            position = end + 1
            if state == _CHUNK_SIZE:
                size = line.split(b";", 1)[0].strip(b" \t")
                if _HEX.fullmatch(size) is None:
                    raise MalformedResponse(f"not a chunk size: {line[:40]!r}")
                self._chunk_left = int(size, 16)
                self._state = _CHUNK_DATA if self._chunk_left else _TRAILERS
            elif not line:  # _TRAILERS: the empty line ends the message
                self._state = _DONE
        self._buffer = bytearray(data[position:])
        return self._state == _DONE


def _line_end(start: bytes) -> int:
    """The length of the line end ``start`` begins with: 2 for CRLF, 1 for a bare LF, 0 for a CR alone (the rest
    has yet to come); anything else after a chunk's data is malformed."""
    if start[:1] == b"\n":
        return 1
    if start == b"\r\n":
        return 2
    if start == b"\r":
        return 0
    raise MalformedResponse("a chunk not followed by CRLF or LF")


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The header lines as (name, value) pairs; a folded line (obs-fold, RFC 9112 5.2) continues the previous value."""
    fields: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            if not fields:
                raise MalformedResponse(f"a folded line before any header: {line[:60]!r}")
            name, value = fields[-1]
            fields[-1] = (name, (value + b" " + line.strip(b" \t")).strip(b" \t"))
            continue
        header = _HEADER_LINE.fullmatch(line)
        if header is None:
            raise MalformedResponse(f"not a header line: {line[:60]!r}")
        name, value = header.groups()
        fields.append((name, value))
    return fields


def _content_length(value: bytes, known: int | None) -> int:
    """``Content-Length``'s value, which a list (``5, 5``) or a second header may repeat, never contradict."""
    length = known
    for part in (piece.strip(b" \t") for piece in value.split(b",")):
        if not part.isdigit() or len(part) > 18 or (length is not None and int(part) != length):
            raise MalformedResponse(f"Content-Length {value[:40]!r}")
        length = int(part)
    assert length is not None
    return length


__all__ = ["MAX_HEAD_BYTES", "MalformedResponse", "RequestHead", "ResponseParser"]
