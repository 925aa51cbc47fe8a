"""What the three gRPC floors (``h2_floor.py``, ``ngh2_floor.py``, ``grpcio_floor.py``) share:
the echo reply, the gRPC length prefix and headers, and their command line.

Every floor answers a ModelInfer by rewriting the request's top-level fields into a response
(model name, version and id kept, the input tensors' metadata kept as the outputs', so an
output is named after its input, ``raw_input_contents`` sent back as ``raw_output_contents``,
requested outputs and parameters dropped): a client sees an identity model whose output
``INPUT0`` is its input ``INPUT0``, the same contract as ``echo_server.py``. ServerReady and
ModelReady answer ready. The same Python does this on every floor, so the floors differ only in
their HTTP/2 engine and event loop.
"""

from __future__ import annotations

import argparse
import struct

RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc+proto")]
TRAILERS = [(b"grpc-status", b"0")]
READY_REPLY = b"\x08\x01"  # ServerReadyResponse / ModelReadyResponse(ready=True)
_KEEP = {1: 1, 2: 2, 3: 3, 5: 5, 7: 6}  # request field -> response field


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def reply_of(request: bytes) -> bytes:
    """The identity response of a serialized ModelInferRequest (module docstring)."""
    out = []
    pos = 0
    while pos < len(request):
        tag, pos = _varint(request, pos)
        field, wire = tag >> 3, tag & 7
        start = pos
        if wire == 2:
            length, pos = _varint(request, pos)
            pos += length
        elif wire == 0:
            _, pos = _varint(request, pos)
        else:
            raise ValueError("unexpected wire type")
        if field in _KEEP:
            out.append(_encode_varint(_KEEP[field] << 3 | wire) + request[start:pos])
    return b"".join(out)


def answer(path: bytes, body: bytes) -> bytes:
    """The length-prefixed gRPC reply to a unary call on ``path`` whose message is ``body``
    (with its 5-byte prefix)."""
    reply = READY_REPLY if path.endswith(b"Ready") else reply_of(body[5:])
    return struct.pack(">BI", 0, len(reply)) + reply


def parse_args(description: str) -> argparse.Namespace:
    """``--port P [--no-uvloop]`` (and ``--lean`` for the h2 floor); installs uvloop unless
    told not to or it is missing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="h2 floor only: h2's header validation and normalization off",
    )
    args = parser.parse_args()
    if not args.no_uvloop:
        try:
            import uvloop
        except ImportError:
            args.no_uvloop = True
        else:
            uvloop.install()
    return args
