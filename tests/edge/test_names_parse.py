"""The parsers stop at the first entry over a bound: what refusing a message costs is the
limit's worth of parsing, not the message's (no server; ``test_names.py`` runs the processes).
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.core.protocol.infer_wire import InferRequestMessage, parse_infer_request
from kserve_trio.core.protocol.request_bounds import check_infer_request
from kserve_trio.core.protocol.wire import len_field
from kserve_trio.gateway.request_path.peek import peek_routing
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from kserve_trio.serving.rpc_codec import parse_message

LIMITS = EdgeLimits()
MILLION_EMPTY = b"\x0a\x00" * (1 << 20)  # field 1, empty, a million times (2 MiB)


def _refused(fn) -> tuple[str, float, int]:
    """The message of the ``InvalidArgument`` ``fn`` raises, the CPU seconds it spent (this
    process's own: what a busy machine's other processes take is not counted) and peak bytes."""
    tracemalloc.start()
    started = time.process_time()
    try:
        with pytest.raises(InvalidArgument) as info:
            fn()
        return info.value.message, time.process_time() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field", [5, 6, 7])
def test_model_infer_parse_stops_at_max_tensors(field):
    entry = len_field(field, b"")
    data = bytes(InferRequestMessage(model_name="m")) + entry * (1 << 20)
    message, seconds, peak = _refused(lambda: parse_message(data, pb.ModelInferRequest, LIMITS))
    assert "limits.max_tensors" in message
    assert seconds < 1.0  # a million entries took ~1 s and ~180 MB before the bound
    assert peak < 8 << 20


@pytest.mark.timeout(30)
def test_gateway_peek_stops_at_max_tensors():
    data = bytes(InferRequestMessage(model_name="m")) + b"\x3a\x00" * (1 << 20)
    message, seconds, _ = _refused(lambda: peek_routing(data, lambda _m: None, LIMITS.max_tensors))
    assert message == "raw_input_contents has more than 1024 entries (limits.max_tensors)"
    assert seconds < 0.5


@pytest.mark.timeout(30)
def test_parameters_stop_at_max_parameters():
    entry = len_field(4, len_field(1, b"k") + len_field(2, b""))
    many = b"".join(len_field(4, len_field(1, str(i).encode())) for i in range(100_000))
    data = bytes(InferRequestMessage(model_name="m")) + entry + many
    message, seconds, _ = _refused(lambda: parse_infer_request(data, LIMITS))
    assert "request parameters" in message and "limits.max_parameters" in message
    assert seconds < 1.0


@pytest.mark.timeout(30)
def test_betterproto_messages_are_scanned_before_they_are_decoded():
    # decoding these 2 MiB took 4.6 s with betterproto2
    message, seconds, _ = _refused(
        lambda: parse_message(MILLION_EMPTY, rc.CompactMemoryRequest, LIMITS)
    )
    assert message == "reload_models has more than 1024 entries (limits.max_tensors)"
    assert seconds < 0.5
    long_name = len_field(2, b"x" * (1 << 20))
    message, _, _ = _refused(
        lambda: parse_message(long_name, pb.RepositoryModelLoadRequest, LIMITS)
    )
    assert message.startswith("model_name is 1048576 bytes, over the limit of 1024")
    assert len(message) < 200
    key = len_field(3, len_field(1, b"k" * 2000))
    message, _, _ = _refused(lambda: parse_message(key, pb.RepositoryModelLoadRequest, LIMITS))
    assert message.startswith("parameters key is 2000 bytes")


def test_not_a_message_is_malformed_and_a_real_one_parses():
    message, _, _ = _refused(
        lambda: parse_message(b"\xff\xfe garbage", rc.ModelControlStatusRequest, LIMITS)
    )
    assert message.startswith("malformed request message")
    assert (
        parse_message(b"", rc.ModelControlStatusRequest, LIMITS) == rc.ModelControlStatusRequest()
    )


def test_raw_contents_beyond_the_inputs_are_refused():
    msg = parse_infer_request(
        bytes(InferRequestMessage(model_name="m", raw_input_contents=[b"", b""])), LIMITS
    )
    with pytest.raises(InvalidArgument, match="2 raw_input_contents entries but only 0 input"):
        check_infer_request(msg, LIMITS)
    off = EdgeLimits(max_name_bytes=0, max_tensors=0, max_parameters=0)
    check_infer_request(InferRequestMessage(model_name="m" * 5000), off)  # 0 turns them off
