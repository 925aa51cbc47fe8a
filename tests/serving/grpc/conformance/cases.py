"""The conformance cases: RFC 9113 (HTTP/2), RFC 7541 (HPACK) and gRPC over HTTP/2, one
``Case`` each: a name, the bytes a client sends after the handshake (built on the connection's
``Wire``), the answer the server owes (``expect``), and a note where the RFC leaves a choice or
where the answer is the project's own (the gRPC refusals, as ``serving/grpc`` documents them).

The rules are the RFCs' and the gRPC protocol spec's; h2spec's case list was read for which
rules are worth a case, none of its code is here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from h2.errors import ErrorCodes
from hyperframe.frame import SettingsFrame as S

from kserve_trio.core.errors import StatusCode
from tests.edge.h2_attacker import PREFACE, settings
from tests.serving.grpc.conformance.expect import (
    Outcome,
    StreamError,
    connection_error,
    either_error,
    error_or_ignored,
    grpc,
    ping_ack,
    served,
    stream_error,
)
from tests.serving.grpc.conformance.frames import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INFER,
    PADDED,
    PING,
    PRIORITY,
    PUSH_PROMISE,
    READY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    AwaitEnd,
    Wire,
    echo_request,
    hpack_int,
    literal,
    settings_payload,
)
from tests.serving.grpc.h2_peer import grpc_frame

PROTOCOL = ErrorCodes.PROTOCOL_ERROR
FLOW_CONTROL = ErrorCodes.FLOW_CONTROL_ERROR
STREAM_CLOSED = ErrorCodes.STREAM_CLOSED
FRAME_SIZE = ErrorCodes.FRAME_SIZE_ERROR
COMPRESSION = ErrorCodes.COMPRESSION_ERROR
MAX_WINDOW = 2**31 - 1
UNKNOWN_TYPE = 0xBE

Step = bytes | AwaitEnd


@dataclass(frozen=True)
class Case:
    """One case (module docstring); ``handshake=False``: the case writes the preface itself."""

    name: str
    send: Callable[[Wire], Sequence[Step]]
    expect: Outcome
    note: str = ""
    handshake: bool = True


# ---------------------------------------------------------------------------------- helpers


def held(w: Wire, sid: int = 1) -> bytes:
    """A ModelInfer call left open on both sides: its message announced 100 bytes long and
    10 of them sent, so the server waits for the rest."""
    return w.request(sid, INFER) + w.data(sid, struct.pack(">BI", 0, 100) + bytes(10))


def echo(
    w: Wire, *, extra: Iterable[tuple[str, str]] = (), without: Sequence[str] = ()
) -> list[Step]:
    """A whole echo call on stream 1, its HEADERS with ``extra`` fields, ``without`` some."""
    return [
        w.request(1, INFER, extra=extra, without=without),
        w.data(1, echo_request(), end=True),
    ]


def over_stream_window(w: Wire) -> list[Step]:
    """A call whose DATA passes the stream window the server advertised by one byte, in the
    largest frames it allows (the message announced longer still)."""
    body = struct.pack(">BI", 0, 1 << 24) + bytes(w.initial_window + 1 - 5)
    step = w.max_frame_size
    frames = [w.data(1, body[i : i + step]) for i in range(0, len(body), step)]
    return [w.request(1, INFER), *frames]


def request_of(*fields: tuple[str, str]) -> Callable[[Wire], Sequence[Step]]:
    """A request of exactly ``fields`` (HEADERS with END_STREAM on stream 1)."""
    return lambda w: [w.fields_request(fields)]


def with_extra(
    *extra: tuple[str, str], without: Sequence[str] = ()
) -> Callable[[Wire], Sequence[Step]]:
    """A ServerReady request with ``extra`` fields after the usual ones (END_STREAM)."""
    return lambda w: [w.request(1, READY, end=True, extra=extra, without=without)]


def bad_block(block: bytes | Callable[[Wire], bytes]) -> Callable[[Wire], Sequence[Step]]:
    """HEADERS (END_STREAM, END_HEADERS) carrying ``block`` as the header block."""
    return lambda w: [w.headers(1, block(w) if callable(block) else block, end=True)]


def opened_block(w: Wire, then: Callable[[bytes], Sequence[Step]]) -> list[Step]:
    """HEADERS on stream 1 carrying the first 5 bytes of a ModelInfer request's header block
    (no END_HEADERS), then ``then(rest of the block)``."""
    block = w.block(w.request_fields(INFER))
    return [w.headers(1, block[:5], end_headers=False), *then(block[5:])]


M, SCH, P, A = ":method", ":scheme", ":path", ":authority"
GRPC = ("content-type", "application/grpc")
TE = ("te", "trailers")
GOOD = [(M, "POST"), (SCH, "http"), (P, READY), (A, "127.0.0.1"), GRPC, TE]
"""A well-formed request's fields, for the cases that break one rule of them."""
HUFFMAN_FIELD = b"\x00" + hpack_int(1, 7) + b"x"
"""The start of a literal field named ``x``; a Huffman-coded value follows."""


def hpack_error(name: str, block: bytes | Callable[[Wire], bytes], note: str = "") -> Case:
    """A header block HPACK cannot decode: a connection error COMPRESSION_ERROR."""
    return Case(name, bad_block(block), connection_error(COMPRESSION), note)


def malformed(name: str, send: Callable[[Wire], Sequence[Step]], note: str = "") -> Case:
    """A malformed request: a stream error PROTOCOL_ERROR, the connection goes on."""
    return Case(name, send, stream_error(PROTOCOL), note)


# ---------------------------------------------------------------------------------- the table

CASES: tuple[Case, ...] = (
    # --- the connection preface
    Case(
        "invalid_preface_ends_the_connection",
        lambda w: [b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + settings()],
        connection_error(PROTOCOL),
        "a server may also just close: the client has not spoken HTTP/2",
        handshake=False,
    ),
    Case(
        "preface_not_followed_by_settings_is_a_protocol_error",
        lambda w: [PREFACE + w.ping()],
        connection_error(PROTOCOL),
        handshake=False,
    ),
    # --- frame size, unknown types and flags, the reserved bit
    Case(
        "data_frame_over_max_frame_size",
        lambda w: [w.request(1, INFER), w.head(DATA, 0, 1, w.max_frame_size + 1) + bytes(1024)],
        either_error(FRAME_SIZE),
        "a frame that cannot alter the connection's state may be a stream error",
    ),
    Case(
        "headers_frame_over_max_frame_size",
        lambda w: [w.head(HEADERS, END_HEADERS, 1, w.max_frame_size + 1) + bytes(1024)],
        connection_error(FRAME_SIZE),
        "a frame carrying a field block is always a connection error",
    ),
    Case(
        "unknown_frame_type_is_ignored",
        lambda w: [w.frame(UNKNOWN_TYPE, 0xFF, 0, b"an extension frame")],
        served(),
    ),
    Case(
        "unknown_frame_type_on_an_idle_stream_is_ignored",
        lambda w: [w.frame(UNKNOWN_TYPE, 0, 9, b"x")],
        served(),
    ),
    Case(
        "unknown_frame_type_inside_a_header_block",
        lambda w: opened_block(w, lambda rest: [w.frame(UNKNOWN_TYPE, 0, 1, b"x")]),
        connection_error(PROTOCOL),
    ),
    Case(
        "undefined_ping_flags_are_ignored",
        lambda w: [w.ping(b"flagged!", flags=0xFE)],
        ping_ack(b"flagged!"),
    ),
    Case(
        "undefined_headers_flags_are_ignored",
        lambda w: [
            w.frame(HEADERS, END_HEADERS | 0xD2, 1, w.block(w.request_fields(INFER))),
            w.data(1, echo_request(), end=True),
        ],
        grpc(StatusCode.OK),
    ),
    Case(
        "reserved_stream_id_bit_is_ignored",
        lambda w: [w.ping(b"reserved", stream=1 << 31)],
        ping_ack(b"reserved"),
    ),
    # --- stream states
    Case(
        "data_on_an_idle_stream",
        lambda w: [w.data(1, grpc_frame(b""), end=True)],
        connection_error(PROTOCOL),
    ),
    Case("rst_stream_on_an_idle_stream", lambda w: [w.rst(1)], connection_error(PROTOCOL)),
    Case(
        "window_update_on_an_idle_stream",
        lambda w: [w.window_update(1, 100)],
        connection_error(PROTOCOL),
    ),
    Case(
        "continuation_without_headers",
        lambda w: [w.continuation(1, w.block(GOOD))],
        connection_error(PROTOCOL),
    ),
    Case(
        "data_on_a_half_closed_remote_stream",
        lambda w: [*echo(w), w.data(1, b"after END_STREAM")],
        either_error(STREAM_CLOSED),
        "one write: the call cannot be answered before its frames are read, so the stream is "
        "half-closed (remote); the RFC names a stream error, which any endpoint may make a "
        "connection error",
    ),
    Case(
        "headers_on_a_half_closed_remote_stream",
        lambda w: [*echo(w), w.headers(1, w.block([("x-late", "1")]), end=True)],
        either_error(STREAM_CLOSED),
        "as for DATA on a half-closed (remote) stream",
    ),
    Case(
        "data_after_the_client_reset_the_stream",
        lambda w: [held(w), w.rst(1), w.data(1, b"after RST_STREAM")],
        error_or_ignored(STREAM_CLOSED),
        "the stream is closed: RFC 9113 lets the receiver end the connection STREAM_CLOSED or "
        "not (it need not remember closed streams)",
    ),
    Case(
        "data_on_a_closed_stream",
        lambda w: [*echo(w), AwaitEnd(1), w.data(1, b"after the answer")],
        error_or_ignored(STREAM_CLOSED),
        "as for DATA after the client reset the stream",
    ),
    Case(
        "even_stream_id_from_the_client",
        lambda w: [w.request(2, end=True)],
        connection_error(PROTOCOL),
    ),
    Case(
        "stream_id_going_backwards",
        lambda w: [w.request(5, end=True), w.request(3, end=True)],
        connection_error(PROTOCOL),
    ),
    Case(
        "closed_stream_id_reused",
        lambda w: [*echo(w), AwaitEnd(1), w.request(1, end=True)],
        connection_error(PROTOCOL, STREAM_CLOSED),
        "a new stream id not above the last one (PROTOCOL_ERROR) and HEADERS on a closed "
        "stream (STREAM_CLOSED) both apply",
    ),
    # --- PRIORITY
    Case(
        "priority_on_stream_zero",
        lambda w: [w.frame(PRIORITY, 0, 0, struct.pack(">LB", 1, 15))],
        connection_error(PROTOCOL),
    ),
    Case(
        "priority_of_wrong_length",
        lambda w: [w.frame(PRIORITY, 0, 1, bytes(4))],
        stream_error(FRAME_SIZE),
    ),
    Case(
        "priority_depending_on_its_own_stream",
        lambda w: [w.priority(3, 3)],
        either_error(PROTOCOL, stream=3),
        "the RFC names a stream error; nghttp2 ends the connection, which any endpoint may do "
        "with a stream error",
    ),
    Case(
        "headers_depending_on_their_own_stream",
        lambda w: [w.headers(1, w.block(GOOD), end=True, depends_on=1)],
        either_error(PROTOCOL),
        "as for PRIORITY depending on its own stream",
    ),
    Case("priority_on_an_idle_stream_is_accepted", lambda w: [w.priority(9, 0)], served()),
    Case(
        "headers_with_priority_are_served",
        lambda w: [
            w.headers(1, w.block(w.request_fields(INFER)), depends_on=0),
            w.data(1, echo_request(), end=True),
        ],
        grpc(StatusCode.OK),
    ),
    # --- DATA
    Case("data_on_stream_zero", lambda w: [w.data(0, b"x")], connection_error(PROTOCOL)),
    Case(
        "data_padding_longer_than_the_payload",
        lambda w: [w.request(1, INFER), w.frame(DATA, PADDED, 1, bytes([10]) + b"abc")],
        connection_error(PROTOCOL),
    ),
    Case(
        "data_padding_as_long_as_the_payload",
        lambda w: [w.request(1, INFER), w.frame(DATA, PADDED, 1, bytes([4]) + b"abc")],
        connection_error(PROTOCOL),
    ),
    Case(
        "padded_data_is_served",
        lambda w: [w.request(1, INFER), w.data(1, echo_request(), end=True, pad=32)],
        grpc(StatusCode.OK),
    ),
    Case(
        "empty_data_frames_are_served",
        lambda w: [w.request(1, INFER), w.data(1, b""), w.data(1, echo_request(), end=True)],
        grpc(StatusCode.OK),
    ),
    Case(
        "data_past_the_stream_window",
        over_stream_window,
        either_error(FLOW_CONTROL),
        "the stream window is passed (so is the connection's, when it is no larger): either",
    ),
    Case(
        "content_length_larger_than_the_data",
        lambda w: echo(w, extra=[("content-length", str(len(echo_request()) + 10))]),
        stream_error(PROTOCOL),
    ),
    Case(
        "content_length_smaller_than_the_data",
        lambda w: echo(w, extra=[("content-length", "1")]),
        stream_error(PROTOCOL),
    ),
    # --- HEADERS and CONTINUATION
    Case(
        "headers_on_stream_zero",
        lambda w: [w.headers(0, w.block(GOOD), end=True)],
        connection_error(PROTOCOL),
    ),
    Case(
        "headers_padding_longer_than_the_payload",
        lambda w: [w.frame(HEADERS, END_HEADERS | END_STREAM | PADDED, 1, b"\xff" + w.block(GOOD))],
        connection_error(PROTOCOL),
    ),
    Case(
        "padded_headers_are_served",
        lambda w: [
            w.headers(1, w.block(w.request_fields(INFER)), pad=32),
            w.data(1, echo_request(), end=True),
        ],
        grpc(StatusCode.OK),
    ),
    Case(
        "header_block_in_continuations_is_served",
        lambda w: opened_block(
            w,
            lambda rest: [
                w.continuation(1, rest[:3], end_headers=False),
                w.continuation(1, rest[3:]),
                w.data(1, echo_request(), end=True),
            ],
        ),
        grpc(StatusCode.OK),
    ),
    Case(
        "continuation_after_end_headers",
        lambda w: [w.request(1, INFER), w.continuation(1, w.block([("x-late", "1")]))],
        connection_error(PROTOCOL),
    ),
    Case(
        "continuation_on_another_stream",
        lambda w: opened_block(w, lambda rest: [w.continuation(3, rest)]),
        connection_error(PROTOCOL),
    ),
    Case(
        "continuation_on_stream_zero",
        lambda w: opened_block(w, lambda rest: [w.continuation(0, rest)]),
        connection_error(PROTOCOL),
    ),
    Case(
        "data_inside_a_header_block",
        lambda w: opened_block(w, lambda rest: [w.data(1, b"x")]),
        connection_error(PROTOCOL),
    ),
    Case(
        "ping_inside_a_header_block",
        lambda w: opened_block(w, lambda rest: [w.ping()]),
        connection_error(PROTOCOL),
    ),
    Case(
        "headers_inside_a_header_block",
        lambda w: opened_block(w, lambda rest: [w.headers(3, w.block(GOOD), end=True)]),
        connection_error(PROTOCOL),
    ),
    # --- RST_STREAM
    Case("rst_stream_on_stream_zero", lambda w: [w.rst(0)], connection_error(PROTOCOL)),
    Case(
        "rst_stream_of_wrong_length",
        lambda w: [held(w), w.frame(RST_STREAM, 0, 1, bytes(3))],
        connection_error(FRAME_SIZE),
    ),
    Case(
        "rst_stream_ends_an_open_call_and_the_connection_serves_on",
        lambda w: [held(w), w.rst(1)],
        served(),
    ),
    # --- SETTINGS
    Case("settings_on_a_stream", lambda w: [w.settings(stream=1)], connection_error(PROTOCOL)),
    Case(
        "settings_length_not_a_multiple_of_six",
        lambda w: [w.frame(SETTINGS, 0, 0, settings_payload((S.MAX_CONCURRENT_STREAMS, 100))[:5])],
        connection_error(FRAME_SIZE),
    ),
    Case(
        "settings_ack_with_a_payload",
        lambda w: [w.frame(SETTINGS, ACK, 0, settings_payload((S.MAX_CONCURRENT_STREAMS, 100)))],
        connection_error(FRAME_SIZE),
    ),
    Case(
        "settings_enable_push_not_zero_or_one",
        lambda w: [w.settings((S.ENABLE_PUSH, 2))],
        connection_error(PROTOCOL),
    ),
    Case(
        "settings_initial_window_size_over_the_maximum",
        lambda w: [w.settings((S.INITIAL_WINDOW_SIZE, MAX_WINDOW + 1))],
        connection_error(FLOW_CONTROL),
    ),
    Case(
        "settings_max_frame_size_below_the_minimum",
        lambda w: [w.settings((S.MAX_FRAME_SIZE, (1 << 14) - 1))],
        connection_error(PROTOCOL),
    ),
    Case(
        "settings_max_frame_size_over_the_maximum",
        lambda w: [w.settings((S.MAX_FRAME_SIZE, 1 << 24))],
        connection_error(PROTOCOL),
    ),
    Case(
        "unknown_settings_are_ignored",
        lambda w: [w.settings((0xFF, 1), (0x4242, 7))],
        served(settings_acks=2),
    ),
    Case(
        "settings_of_every_defined_parameter_are_acknowledged",
        lambda w: [
            w.settings(
                (S.HEADER_TABLE_SIZE, 4096),
                (S.ENABLE_PUSH, 0),
                (S.MAX_CONCURRENT_STREAMS, 100),
                (S.INITIAL_WINDOW_SIZE, 1 << 20),
                (S.MAX_FRAME_SIZE, 1 << 15),
                (S.MAX_HEADER_LIST_SIZE, 1 << 16),
            )
        ],
        served(settings_acks=2),
    ),
    Case(
        "initial_window_size_change_overflowing_an_open_stream",
        lambda w: [
            held(w),
            w.window_update(1, MAX_WINDOW - (1 << 16) + 1),
            w.settings((S.INITIAL_WINDOW_SIZE, 1 << 16)),
        ],
        connection_error(FLOW_CONTROL),
        "the stream's send window is 2^31-1 after the WINDOW_UPDATE; the new initial size adds 1",
    ),
    # --- PING and GOAWAY
    Case("ping_is_answered_with_its_data", lambda w: [w.ping(b"opaque!!")], ping_ack(b"opaque!!")),
    Case("ping_on_a_stream", lambda w: [w.ping(stream=1)], connection_error(PROTOCOL)),
    Case(
        "ping_of_wrong_length",
        lambda w: [w.frame(PING, 0, 0, b"seven!!")],
        connection_error(FRAME_SIZE),
    ),
    Case(
        "ping_ack_from_the_client_is_not_answered",
        lambda w: [w.ping(b"unasked!", flags=ACK), w.ping(b"asked!!!")],
        ping_ack(b"asked!!!", unanswered=(b"unasked!",)),
    ),
    Case(
        "goaway_on_a_stream",
        lambda w: [w.frame(GOAWAY, 0, 1, struct.pack(">LL", 0, 0))],
        connection_error(PROTOCOL),
    ),
    # --- WINDOW_UPDATE
    Case(
        "window_update_of_zero_on_the_connection",
        lambda w: [w.window_update(0, 0)],
        connection_error(PROTOCOL),
    ),
    Case(
        "window_update_of_zero_on_a_stream",
        lambda w: [held(w), w.window_update(1, 0)],
        stream_error(PROTOCOL),
    ),
    Case(
        "window_update_of_wrong_length",
        lambda w: [w.frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01")],
        connection_error(FRAME_SIZE),
    ),
    Case(
        "window_update_overflowing_the_connection_window",
        lambda w: [w.window_update(0, MAX_WINDOW)],
        connection_error(FLOW_CONTROL),
    ),
    Case(
        "window_update_overflowing_a_stream_window",
        lambda w: [held(w), w.window_update(1, MAX_WINDOW)],
        stream_error(FLOW_CONTROL),
    ),
    Case(
        "window_update_on_a_half_closed_remote_stream_is_accepted",
        lambda w: [*echo(w), w.window_update(1, 1000)],
        grpc(StatusCode.OK),
    ),
    # --- PUSH_PROMISE
    Case(
        "push_promise_from_the_client",
        lambda w: [
            held(w),
            w.frame(PUSH_PROMISE, END_HEADERS, 1, struct.pack(">L", 2) + w.block(GOOD)),
        ],
        connection_error(PROTOCOL),
    ),
    # --- HTTP requests: pseudo-header fields
    malformed("request_without_method", request_of(*GOOD[1:])),
    malformed("request_without_scheme", request_of(GOOD[0], *GOOD[2:])),
    malformed("request_without_path", request_of(*GOOD[:2], *GOOD[3:])),
    malformed("request_with_an_empty_path", request_of(*GOOD[:2], (P, ""), *GOOD[3:])),
    malformed(
        "request_path_not_starting_with_a_slash",
        request_of(*GOOD[:2], (P, READY[1:]), *GOOD[3:]),
    ),
    malformed(
        "request_with_a_status_pseudo_header", request_of(*GOOD[:4], (":status", "200"), *GOOD[4:])
    ),
    malformed(
        "request_with_an_unknown_pseudo_header", request_of(*GOOD[:4], (":foo", "bar"), *GOOD[4:])
    ),
    malformed("pseudo_header_after_a_regular_header", request_of(*GOOD[:2], GRPC, *GOOD[2:4], TE)),
    malformed("duplicated_method", request_of(*GOOD[:1], *GOOD)),
    malformed("duplicated_path", request_of(*GOOD[:3], (P, READY), *GOOD[3:])),
    malformed(
        "pseudo_header_in_trailers",
        lambda w: [
            w.request(1, INFER),
            w.data(1, echo_request()),
            w.headers(1, w.block([(P, READY)]), end=True),
        ],
    ),
    # --- HTTP requests: field names and values
    malformed("uppercase_header_name", with_extra(("X-Upper", "1"))),
    malformed("header_name_with_a_space", with_extra(("x bad", "1"))),
    malformed("header_value_with_a_line_feed", with_extra(("x-lf", "a\nb"))),
    malformed("header_value_with_a_carriage_return", with_extra(("x-cr", "a\rb"))),
    malformed("header_value_with_a_nul", with_extra(("x-nul", "a\x00b"))),
    malformed("header_value_with_leading_whitespace", with_extra(("x-ws", " a"))),
    malformed("connection_header", with_extra(("connection", "keep-alive"))),
    malformed("keep_alive_header", with_extra(("keep-alive", "timeout=5"))),
    malformed("proxy_connection_header", with_extra(("proxy-connection", "keep-alive"))),
    malformed("transfer_encoding_header", with_extra(("transfer-encoding", "chunked"))),
    malformed("upgrade_header", with_extra(("upgrade", "h2c"))),
    malformed("te_other_than_trailers", with_extra(("te", "gzip"), without=["te"])),
    # --- HTTP requests: trailers
    malformed(
        "trailers_without_end_stream",
        lambda w: [
            w.request(1, INFER),
            w.data(1, echo_request()),
            w.headers(1, w.block([("x-trailer", "1")])),
        ],
    ),
    malformed(
        "second_headers_without_end_stream",
        lambda w: [w.request(1, INFER), w.headers(1, w.block([("x-more", "1")]))],
    ),
    Case(
        "trailers_with_end_stream_are_served",
        lambda w: [
            w.request(1, INFER),
            w.data(1, echo_request()),
            w.headers(1, w.block([("x-trailer", "1")]), end=True),
        ],
        grpc(StatusCode.OK),
    ),
    # --- HPACK
    hpack_error("hpack_index_zero", b"\x80"),
    hpack_error(
        "hpack_index_past_the_tables",
        hpack_int(62, 7, 0x80),
        "61 static entries, an empty dynamic table",
    ),
    hpack_error(
        "hpack_name_index_past_the_tables", hpack_int(62, 6, 0x40) + hpack_int(1, 7) + b"x"
    ),
    hpack_error(
        "hpack_table_size_update_over_the_setting",
        lambda w: hpack_int(w.header_table_size + 1, 5, 0x20),
        "one more than the SETTINGS_HEADER_TABLE_SIZE the server sent (4096 when absent)",
    ),
    hpack_error("hpack_table_size_update_after_a_field", b"\x82" + hpack_int(0, 5, 0x20)),
    hpack_error(
        "hpack_huffman_string_with_eos", HUFFMAN_FIELD + hpack_int(4, 7, 0x80) + b"\xff" * 4
    ),
    hpack_error(
        "hpack_huffman_padding_over_seven_bits",
        HUFFMAN_FIELD + hpack_int(2, 7, 0x80) + b"\x1f\xff",
        "'a' (5 bits) and 11 bits of padding",
    ),
    hpack_error(
        "hpack_huffman_padding_not_ones",
        HUFFMAN_FIELD + hpack_int(1, 7, 0x80) + b"\x18",
        "'a' (5 bits) padded with zeros",
    ),
    hpack_error("hpack_integer_overflow", b"\xff" + b"\xff" * 10 + b"\x7f"),
    hpack_error("hpack_integer_cut_short", b"\xff\x80"),
    hpack_error(
        "hpack_string_longer_than_the_block",
        b"\x00" + hpack_int(1, 7) + b"x" + hpack_int(100, 7) + b"abc",
    ),
    hpack_error("hpack_field_cut_short", literal(b"x-cut", b"value")[:-2]),
    Case(
        "hpack_table_size_updates_at_the_block_start_are_served",
        lambda w: [
            w.headers(
                1,
                hpack_int(0, 5, 0x20)
                + hpack_int(w.header_table_size, 5, 0x20)
                + w.block(w.request_fields(INFER)),
            ),
            w.data(1, echo_request(), end=True),
        ],
        grpc(StatusCode.OK),
    ),
    # --- gRPC over HTTP/2 (the statuses the server documents)
    Case(
        "grpc_method_other_than_post",
        lambda w: [w.request(1, READY, end=True, method="GET")],
        grpc(StatusCode.UNIMPLEMENTED, http=405),
    ),
    Case(
        "grpc_without_content_type",
        with_extra(without=["content-type"]),
        grpc(StatusCode.UNKNOWN, http=415),
        "the gRPC spec asks 415 so that no HTTP client takes the answer for a success",
    ),
    Case(
        "grpc_content_type_not_grpc",
        with_extra(("content-type", "text/plain"), without=["content-type"]),
        grpc(StatusCode.UNKNOWN, http=415),
    ),
    Case(
        "grpc_content_type_with_a_subtype_is_served",
        lambda w: echo(
            w, without=["content-type"], extra=[("content-type", "application/grpc+proto")]
        ),
        grpc(StatusCode.OK),
    ),
    Case(
        "grpc_without_te_trailers",
        with_extra(without=["te"]),
        grpc(StatusCode.UNKNOWN, http=400),
    ),
    Case(
        "grpc_unknown_method",
        lambda w: [w.request(1, "/inference.GRPCInferenceService/NoSuchRpc", end=True)],
        grpc(StatusCode.UNIMPLEMENTED),
    ),
    Case(
        "grpc_unknown_service",
        lambda w: [w.request(1, "/no.such.Service/Rpc", end=True)],
        grpc(StatusCode.UNIMPLEMENTED),
    ),
    Case(
        "grpc_compressed_flag_other_than_zero_or_one",
        lambda w: [w.request(1, INFER), w.data(1, grpc_frame(b"", flag=2), end=True)],
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_compressed_message_without_grpc_encoding",
        lambda w: [w.request(1, INFER), w.data(1, grpc_frame(b"abc", flag=1), end=True)],
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_unknown_grpc_encoding",
        lambda w: echo(w, extra=[("grpc-encoding", "no-such-codec")]),
        grpc(StatusCode.UNIMPLEMENTED),
    ),
    Case(
        "grpc_message_length_over_the_receive_cap",
        lambda w: [w.request(1, INFER), w.data(1, struct.pack(">BI", 0, 0xFFFFFFFF))],
        grpc(StatusCode.RESOURCE_EXHAUSTED),
        "announced 4 GiB, over any receive cap the server can have",
    ),
    Case(
        "grpc_stream_ending_inside_the_message_prefix",
        lambda w: [w.request(1, INFER), w.data(1, b"\x00\x00\x00", end=True)],
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_stream_ending_inside_the_message",
        lambda w: [w.request(1, INFER), w.data(1, struct.pack(">BI", 0, 10) + b"abcd", end=True)],
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_unary_call_without_a_message",
        lambda w: [w.request(1, INFER, end=True)],
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_timeout_with_an_unknown_unit",
        lambda w: echo(w, extra=[("grpc-timeout", "1x")]),
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_timeout_of_more_than_eight_digits",
        lambda w: echo(w, extra=[("grpc-timeout", "123456789S")]),
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
    Case(
        "grpc_timeout_already_passed",
        lambda w: echo(w, extra=[("grpc-timeout", "0n")]),
        grpc(StatusCode.DEADLINE_EXCEEDED),
    ),
    Case(
        "grpc_binary_metadata_not_base64",
        lambda w: echo(w, extra=[("x-data-bin", "!!not base64!!")]),
        grpc(StatusCode.INVALID_ARGUMENT),
    ),
)


__all__ = ["CASES", "Case"]


# ---------------------------------------------------------------------------------- engines

IGNORED_BY_LIBNGHTTP2 = {
    "stream_id_going_backwards": (
        "libnghttp2 cannot remember every stream it has seen close, so it ignores frames on a "
        "stream id below the highest one rather than guess"
    ),
    "closed_stream_id_reused": "the same: a HEADERS on a stream id seen before is ignored",
    "priority_on_stream_zero": "RFC 9113 deprecates RFC 7540's priorities; libnghttp2 ignores PRIORITY",
    "priority_depending_on_its_own_stream": "the same: PRIORITY frames are not acted on",
}
"""Cases whose frames libnghttp2 deliberately ignores: on ``ngh2`` the case passes when the
connection serves on (or when it answers the RFC's error)."""

CONNECTION_ERROR_BY_LIBNGHTTP2 = frozenset(
    {
        "priority_of_wrong_length",
        "window_update_of_zero_on_a_stream",
        "window_update_overflowing_a_stream_window",
    }
)
"""Stream errors libnghttp2 answers as connection errors (RFC 9113 5.4.1: an endpoint may)."""


def expected_on(case: Case, engine: str) -> Outcome:
    """What ``case`` must get from a server on HTTP/2 ``engine``: the RFC's answer, except
    where an engine takes a choice the RFC leaves it (RFC 9113 5.4.1: any stream error may be
    treated as a connection error, which h2 does for every malformed request)."""
    expect = case.expect
    if engine == "ngh2" and case.name in IGNORED_BY_LIBNGHTTP2:
        codes = getattr(expect, "codes", ())
        return error_or_ignored(*codes)
    relax = engine == "h2" or (engine == "ngh2" and case.name in CONNECTION_ERROR_BY_LIBNGHTTP2)
    if relax and isinstance(expect, StreamError) and not expect.either:
        return either_error(*expect.codes, stream=expect.stream)
    return expect
