"""gRPC message compression rules: algorithms, caps on the decompressed size, reply choice."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve_trio.core.errors import InvalidArgument, ResourceExhausted, Unimplemented
from kserve_trio.core.protocol import compression as c
from tests.serving.bomb import zero_bomb as _bomb


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@given(payload=st.binary(max_size=4096))
@settings(max_examples=60, deadline=None)
def test_round_trip(algorithm, payload):
    assert c.decompress(c.compress(payload, algorithm), algorithm, 1 << 20) == payload


def test_reads_what_other_implementations_send():
    payload = b"kserve" * 1000
    assert c.decompress(gzip.compress(payload), "gzip", 1 << 20) == payload
    assert c.decompress(zlib.compress(payload), "deflate", 1 << 20) == payload
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    raw_deflate = raw.compress(payload) + raw.flush()
    assert c.decompress(raw_deflate, "deflate", 1 << 20) == payload


def test_the_cap_is_on_the_decompressed_size():
    payload = bytes(10_000)
    packed = c.compress(payload, "gzip")
    assert len(packed) < 100
    assert c.decompress(packed, "gzip", 10_000) == payload
    with pytest.raises(ResourceExhausted, match=r"received message larger than max .* 9999\)"):
        c.decompress(packed, "gzip", 9_999)


def test_the_bomb_helper_builds_a_valid_stream():
    small = _bomb(64 << 20, "gzip")
    assert gzip.decompress(small) == bytes(64 << 20)
    small = _bomb(64 << 20, "deflate")
    assert zlib.decompress(small) == bytes(64 << 20)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_4_gb_bomb_is_resource_exhausted_without_inflating_it(algorithm):
    bomb = _bomb(4 << 30, algorithm)
    assert len(bomb) < 8 << 20  # a few MB on the wire
    cap = 64 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ResourceExhausted):
            c.decompress(bomb, algorithm, cap)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * cap  # bounded by the cap, never by the 4 GB the bomb expands to


def test_corrupt_or_unlabelled_payloads_are_invalid_argument():
    with pytest.raises(InvalidArgument, match="cannot decompress the gzip message"):
        c.decompress(b"not gzip at all", "gzip", 1 << 20)
    truncated = c.compress(b"x" * 5000, "deflate")[:-4]
    with pytest.raises(InvalidArgument, match="cannot decompress the deflate message"):
        c.decompress(truncated, "deflate", 1 << 20)
    with pytest.raises(InvalidArgument, match="without a grpc-encoding"):
        c.decompress(b"abc", "identity", 1 << 20)


def test_encoding_headers():
    assert c.parse_encoding(None) == "identity"
    assert c.parse_encoding(" GZIP ") == "gzip"
    assert c.parse_encoding("deflate") == "deflate"
    with pytest.raises(Unimplemented, match=r"grpc-encoding 'snappy' is not supported"):
        c.parse_encoding("snappy")
    assert c.parse_accept_encoding("identity,deflate,gzip") == {"identity", "deflate", "gzip"}
    assert c.parse_accept_encoding(None) == {"identity"}


def test_a_reply_is_compressed_only_when_its_request_was_or_when_told():
    tritonclient = c.parse_accept_encoding("identity,deflate,gzip")
    assert c.reply_encoding("identity", tritonclient, compress_all=False) == "identity"
    assert c.reply_encoding("gzip", tritonclient, compress_all=False) == "gzip"
    assert c.reply_encoding("deflate", tritonclient, compress_all=False) == "deflate"
    assert c.reply_encoding("gzip", {"identity"}, compress_all=False) == "identity"
    assert c.reply_encoding("identity", tritonclient, compress_all=True) == "gzip"
    assert c.reply_encoding("identity", {"identity", "deflate"}, compress_all=True) == "deflate"
    assert c.reply_encoding("identity", {"identity"}, compress_all=True) == "identity"
