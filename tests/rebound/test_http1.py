"""The push handler's HTTP/1.1 wire format, pure: the request's bytes and the response parser, fed in any pieces."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebound.http1 import MAX_HEAD_BYTES, MalformedResponse, RequestHead, ResponseParser


def parse(*pieces: bytes, keep: int = 256, limit: int = 65_536, eof: bool = False) -> ResponseParser:
    parser = ResponseParser(keep=keep, limit=limit)
    for piece in pieces:
        parser.feed(piece)
    if eof:
        parser.feed_eof()
    return parser


def outcome(parser: ResponseParser) -> tuple[object, ...]:
    return (parser.done, parser.status, parser.reason, parser.retry_after, parser.body, parser.reusable)


def test_a_content_length_response_in_one_piece() -> None:
    parser = parse(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Length: 4\r\n\r\nbusy")
    assert outcome(parser) == (True, 503, "Service Unavailable", "7", b"busy", True)
    assert parser.received == 75 and not parser.truncated


def test_nothing_received_is_told_apart_from_a_partial_head() -> None:
    parser = ResponseParser(keep=0, limit=10)
    assert parser.received == 0 and not parser.feed_eof()
    parser = ResponseParser(keep=0, limit=10)
    assert not parser.feed(b"HTTP/1.1 20")
    assert not parser.feed_eof() and parser.received == 11 and not parser.head_done


CHUNKED = (
    b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\nRetry-After: 3\r\n\r\n"
    b"5;name=value\r\nhello\r\n1A\r\n, and a second chunk of 26\r\n0\r\nX-Trailer: t\r\n\r\n"
)
RESPONSES = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nDate: Sat, 05 Dec 2026 21:00:00 GMT\r\n\r\nok",
    b"HTTP/1.1 204 No Content\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\n",
    CHUNKED,
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno!",
]


@pytest.mark.parametrize("response", RESPONSES)
def test_a_response_split_byte_by_byte_reads_as_in_one_piece(response: bytes) -> None:
    whole = parse(response)
    assert whole.done
    assert outcome(parse(*(response[i : i + 1] for i in range(len(response))))) == outcome(whole)


@given(st.sampled_from(RESPONSES), st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_a_response_split_anywhere_reads_as_in_one_piece(response: bytes, cuts: list[int]) -> None:
    points = sorted({0, len(response), *(cut % (len(response) + 1) for cut in cuts)})
    pieces = [response[a:b] for a, b in itertools.pairwise(points)]
    assert outcome(parse(*pieces)) == outcome(parse(response))


def with_bare_lf(response: bytes, which: list[bool] | None = None) -> bytes:
    """``response`` with its CRLFs (all framing: no body of :data:`RESPONSES` has one) as bare LFs: all of them, or
    the ones ``which`` says (cycled)."""
    lines = response.split(b"\r\n")
    ends = [b"\n" if which is None or which[i % len(which)] else b"\r\n" for i in range(len(lines) - 1)]
    return b"".join(line + end for line, end in zip(lines, [*ends, b""], strict=True))


@pytest.mark.parametrize("response", RESPONSES)
def test_bare_lf_line_endings_read_as_crlf_ones(response: bytes) -> None:
    """RFC 9112 2.2: a recipient may take a bare LF as a line's end, in the status line, the headers, chunk sizes
    and trailers, as h11 does."""
    bare = with_bare_lf(response)
    assert b"\r" not in bare
    assert outcome(parse(bare)) == outcome(parse(response))
    assert outcome(parse(*(bare[i : i + 1] for i in range(len(bare))))) == outcome(parse(response))


@given(
    st.sampled_from(RESPONSES),
    st.lists(st.booleans(), min_size=1, max_size=8),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_mixed_line_endings_split_anywhere_read_as_crlf_ones(
    response: bytes, which: list[bool], cuts: list[int]
) -> None:
    mixed = with_bare_lf(response, which)
    points = sorted({0, len(mixed), *(cut % (len(mixed) + 1) for cut in cuts)})
    pieces = [mixed[a:b] for a, b in itertools.pairwise(points)]
    assert outcome(parse(*pieces)) == outcome(parse(response))


def test_chunked_bodies_with_extensions_and_trailers() -> None:
    parser = parse(CHUNKED, keep=8)
    assert outcome(parser) == (True, 500, "Internal Server Error", "3", b"hello, a", True)
    assert parser.body_bytes == 31


def test_interim_responses_are_skipped_and_101_is_final() -> None:
    assert parse(RESPONSES[3]).status == 404
    switched = parse(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")
    assert (switched.done, switched.status, switched.reusable) == (True, 101, False)


def test_a_body_to_the_close_is_complete_only_at_the_close() -> None:
    parser = parse(b"HTTP/1.1 502 Bad Gateway\r\n\r\nupstream ", b"gone")
    assert parser.head_done and not parser.done
    assert parser.feed_eof() and parser.done and not parser.truncated and not parser.reusable
    assert parser.body == b"upstream gone"


def test_a_body_cut_short_keeps_its_status_and_what_arrived() -> None:
    parser = parse(b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n0123456789", eof=True)
    assert (parser.done, parser.truncated, parser.reusable, parser.body) == (True, True, False, b"0123456789")


def test_connection_close_and_http_1_0_are_not_kept() -> None:
    assert not parse(b"HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n").reusable
    assert not parse(b"HTTP/1.1 200 OK\r\nConnection: upgrade, close\r\nContent-Length: 0\r\n\r\n").reusable
    assert not parse(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n").reusable
    assert parse(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n").reusable


def test_transfer_encoding_wins_over_content_length_and_the_connection_is_not_kept() -> None:
    parser = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
    assert (parser.done, parser.body, parser.reusable) == (True, b"ok", False)
    other = parse(b"HTTP/1.1 500 x\r\nTransfer-Encoding: gzip\r\n\r\nraw")
    assert not other.done and other.feed_eof() and other.body == b"raw"


def test_bytes_past_the_end_make_the_connection_unusable() -> None:
    parser = parse(b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\n\r\n")
    assert parser.done and not parser.reusable
    parser = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert parser.done and not parser.reusable and parser.body == b"ok"


def test_a_body_past_the_limit_ends_the_reading_and_the_connection() -> None:
    parser = parse(b"HTTP/1.1 500 x\r\nContent-Length: 1000\r\n\r\n", b"z" * 600, keep=4, limit=512)
    assert (parser.done, parser.reusable, parser.body) == (True, False, b"zzzz")
    chunked = parse(b"HTTP/1.1 500 x\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n", b"z" * 600, keep=0, limit=512)
    assert chunked.done and not chunked.reusable


def test_repeated_equal_content_lengths_are_one_and_folded_lines_continue_a_value() -> None:
    assert parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok").body == b"ok"
    folded = parse(b"HTTP/1.1 503 x\r\nRetry-After:\r\n 120\r\nContent-Length: 0\r\n\r\n")
    assert folded.retry_after == "120"


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 2000 Nope\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"\x15\x03\x01\x00\x02\x02\x50\r\n\r\n",  # a TLS alert: http:// to a TLS port
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded first\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXY",
        b"HTTP/1.1 200 OK\rContent-Length: 0\n\n",  # a bare CR ends no line
        b"HTTP/1.1 200 OK\nX: a\rb\nContent-Length: 0\n\n",
        b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n2\nok\rX",
    ],
)
def test_what_is_not_http_1_is_malformed(head: bytes) -> None:
    with pytest.raises(MalformedResponse):
        parse(head)


def test_a_header_section_without_an_end_is_malformed_at_the_bound() -> None:
    parser = ResponseParser(keep=0, limit=10)
    parser.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(MalformedResponse, match="header section"):
        for _ in range(MAX_HEAD_BYTES // 1000 + 2):
            parser.feed(b"X: " + b"y" * 995 + b"\r\n")


def test_the_request_head_in_order_with_content_length() -> None:
    head = RequestHead(
        target="/events?a=1", host="svc:8080", fixed={"User-Agent": "rebound"}, trailing={"Accept": "*/*"}
    )
    built = head.build({"Idempotency-Key": "g:t:0:1", "Rebound-Tier": "\u00e9t\u00e9"}, 5)
    assert built == (
        b"POST /events?a=1 HTTP/1.1\r\nHost: svc:8080\r\nUser-Agent: rebound\r\nIdempotency-Key: g:t:0:1\r\n"
        b"Rebound-Tier: \xc3\xa9t\xc3\xa9\r\nAccept: */*\r\nContent-Length: 5\r\n\r\n"
    )


@pytest.mark.parametrize("value", ["a\r\nInjected: 1", "a\nb", "a\x00", "a\x7f"])
def test_a_control_character_in_a_header_is_refused_before_sending(value: str) -> None:
    head = RequestHead(target="/", host="h", fixed={}, trailing={})
    with pytest.raises(ValueError, match="control character"):
        head.build({"Rebound-Tier": value}, 0)
    with pytest.raises(ValueError, match="control character"):
        RequestHead(target="/", host="h", fixed={"Authorization": f"Bearer {value}"}, trailing={})
