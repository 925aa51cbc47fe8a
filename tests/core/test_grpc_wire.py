"""The gRPC wire rules (``core.protocol.grpc_wire``), written once for the server and the client."""

from __future__ import annotations

import base64

import pytest

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol.grpc_wire import (
    PREFIX,
    custom_metadata,
    decode_bin,
    decode_message,
    encode_bin,
    encode_message,
    format_timeout,
    message_prefix,
    metadata_headers,
    parse_timeout,
    status_from_http,
    status_from_reset,
    status_trailers,
    valid_bin,
    valid_timeout,
)
from kserve_trio.http2 import ErrorCode


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        (1e-10, b"1n"),
        (0.05, b"50000000n"),
        (0.5, b"500000u"),
        (3.0, b"3000000u"),
        (1000.0, b"1000000m"),
        (100_000.0, b"100000S"),
        (1e9, b"16666667M"),
        (1e11, b"27777778H"),
        (1e13, b"99999999H"),
    ],
)
def test_format_timeout_uses_the_finest_unit_that_fits_eight_digits(seconds, header):
    assert format_timeout(seconds).encode() == header


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_format_timeout_refuses_a_non_positive_value(bad):
    with pytest.raises(ValueError, match="a grpc-timeout must be positive"):
        format_timeout(bad)


def test_grpc_message_is_percent_decoded_utf8():
    assert decode_message(b"100%25 sure") == "100% sure"
    assert decode_message(b"caf%C3%A9%0Aline") == "café\nline"
    assert decode_message(b"bad %FF byte") == "bad \ufffd byte"


@pytest.mark.parametrize(
    ("http", "status"),
    [
        (400, StatusCode.INTERNAL),
        (401, StatusCode.UNAUTHENTICATED),
        (403, StatusCode.PERMISSION_DENIED),
        (404, StatusCode.UNIMPLEMENTED),
        (429, StatusCode.UNAVAILABLE),
        (502, StatusCode.UNAVAILABLE),
        (503, StatusCode.UNAVAILABLE),
        (504, StatusCode.UNAVAILABLE),
        (500, StatusCode.UNKNOWN),
    ],
)
def test_http_status_mapping(http, status):
    assert status_from_http(http) is status


def test_reset_code_mapping():
    codes = ErrorCode
    assert status_from_reset(codes.CANCEL) is StatusCode.CANCELLED
    assert status_from_reset(codes.REFUSED_STREAM) is StatusCode.UNAVAILABLE
    assert status_from_reset(codes.ENHANCE_YOUR_CALM) is StatusCode.RESOURCE_EXHAUSTED
    assert status_from_reset(codes.INADEQUATE_SECURITY) is StatusCode.PERMISSION_DENIED
    assert status_from_reset(codes.INTERNAL_ERROR) is StatusCode.INTERNAL


def test_metadata_headers_lowercase_keys_and_base64_binary_values():
    headers = metadata_headers({"X-Tag": "abc", "trace-bin": b"\x00\xff\x10"})
    assert headers == [(b"x-tag", b"abc"), (b"trace-bin", base64.b64encode(b"\x00\xff\x10"))]


@pytest.mark.parametrize("key", [":path", "grpc-timeout", "content-type", "te", "a b", "ключ", ""])
def test_metadata_headers_refuse_reserved_or_invalid_keys(key):
    with pytest.raises(ValueError, match="invalid or reserved metadata key"):
        metadata_headers({key: "v"})


@pytest.mark.parametrize("value", ["café", "line\nbreak", b"bytes"])
def test_metadata_headers_refuse_non_ascii_text_values(value):
    with pytest.raises(ValueError, match="needs a printable ASCII string value"):
        metadata_headers({"x-k": value})


@pytest.mark.parametrize("value", ["1n", "99999999H", "5S", "250m", "7u", "3M"])
def test_a_written_timeout_parses_back_to_at_least_what_was_asked(value):
    assert valid_timeout(value)
    seconds = parse_timeout(value)
    assert parse_timeout(format_timeout(seconds)) >= seconds


@pytest.mark.parametrize("bad", ["", "1", "S", "123456789S", "1s", "-1S", "1.5S", " 1S"])
def test_a_malformed_timeout_is_refused(bad):
    assert not valid_timeout(bad)
    with pytest.raises(ValueError, match="malformed grpc-timeout"):
        parse_timeout(bad)


def test_the_prefix_carries_the_flag_and_the_length():
    assert message_prefix(False, 5) == b"\x00\x00\x00\x00\x05"
    assert PREFIX.unpack(message_prefix(True, 1 << 20)) == (1, 1 << 20)


def test_messages_round_trip_percent_encoded():
    for text in ("plain", "100% sure", "café\nline", "tab\there"):
        encoded = encode_message(text)
        assert encoded.isascii() and "\n" not in encoded
        assert decode_message(encoded) == text


def test_bin_metadata_is_sent_unpadded_and_read_padded_or_not():
    raw = b"\x00\xff\x10\x01"
    sent = encode_bin(raw)
    assert not sent.endswith(b"=")
    assert decode_bin(sent) == raw == decode_bin(base64.b64encode(raw))
    assert valid_bin("AAEC") and valid_bin("AAE") and not valid_bin("A*B")


def test_custom_metadata_leaves_the_protocols_headers_out_and_decodes_bin_values():
    headers = [
        (":path", "/x"),
        ("grpc-timeout", "1S"),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
        ("x-tag", "a"),
        ("x-tag", "second"),
        ("trace-bin", "AAEC"),
    ]
    assert custom_metadata(headers) == {"x-tag": "a", "trace-bin": b"\x00\x01\x02"}


def test_status_trailers_are_a_whole_response_when_nothing_was_sent():
    only = status_trailers(StatusCode.NOT_FOUND, "no model", trailers_only=True)
    assert only[0] == (b":status", b"200") and (b"grpc-status", b"5") in only
    after = status_trailers(StatusCode.OK)
    assert after == [(b"grpc-status", b"0")]
