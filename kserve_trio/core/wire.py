"""Protobuf wire-level fast paths for the two messages that carry tensor payloads.

betterproto2 copies every ``bytes`` field twice on parse and serializes through ``BytesIO``
(notes/stack_probe.md section 1). For ``ModelInferRequest.raw_input_contents`` (field 7) and
``ModelInferResponse.raw_output_contents`` (field 6) those copies are the payload itself, so:

- ``parse_infer_request(data)`` scans the top-level fields, keeps every raw-contents entry as a
  ``memoryview`` slice of ``data`` (no copy) and lets betterproto2 parse the small remainder.
- ``infer_response_pieces(msg)`` serializes the response without its raw contents through
  betterproto2 and returns the pieces (header bytes, then each entry's tag+length and the
  payload buffer itself), for a transport that writes them without concatenating first.

Pure functions over bytes; no I/O.
"""

from __future__ import annotations

from kserve_trio.proto import inference as pb

_REQ_RAW_FIELD = 7
_RESP_RAW_FIELD = 6


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def encode_varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire_type}")


def parse_infer_request(data: bytes | bytearray | memoryview) -> pb.ModelInferRequest:
    """Parse a ``ModelInferRequest``; ``raw_input_contents`` entries are zero-copy memoryviews.

    The views alias ``data``, which stays alive as long as any of them does.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    raws: list[memoryview] = []
    rest: list[memoryview] = []
    pos = 0
    end = len(buf)
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == _REQ_RAW_FIELD and wire_type == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise ValueError("truncated raw_input_contents entry")
            raws.append(buf[pos : pos + n])
            pos += n
            continue
        pos = _skip(buf, pos, wire_type)
        if pos > end:
            raise ValueError(f"truncated field {field}")
        rest.append(buf[start:pos])
    msg = pb.ModelInferRequest.parse(b"".join(rest)) if rest else pb.ModelInferRequest()
    msg.raw_input_contents = raws  # bytes-like views; the codec only reads them via frombuffer
    return msg


def infer_response_pieces(msg: pb.ModelInferResponse) -> list[bytes | memoryview]:
    """``msg`` serialized as pieces whose concatenation is its protobuf encoding.

    The payload entries of ``raw_output_contents`` are returned as the buffers themselves.
    """
    raws = msg.raw_output_contents
    msg.raw_output_contents = []
    try:
        pieces: list[bytes | memoryview] = [bytes(msg)]
    finally:
        msg.raw_output_contents = raws
    tag = encode_varint((_RESP_RAW_FIELD << 3) | 2)
    for raw in raws:
        view = memoryview(raw).cast("B")
        pieces.append(tag + encode_varint(view.nbytes))
        pieces.append(view)
    return pieces


__all__ = ["encode_varint", "infer_response_pieces", "parse_infer_request"]
