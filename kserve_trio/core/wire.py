"""Direct protobuf coding of the two messages on the serving hot path.

betterproto2 parses and serializes field by field through generic machinery (tens of
microseconds for a small ``ModelInferRequest`` here) and copies every ``bytes`` field twice on
parse (notes/stack_probe.md section 1). For ``ModelInferRequest`` in and ``ModelInferResponse``
out this module reads and writes the wire format directly, for exactly the fields KServe V2 uses:

- ``parse_infer_request(data)`` returns an ``InferRequestView`` with the attributes of
  ``pb.ModelInferRequest`` the codec reads; every ``raw_input_contents`` entry is a
  ``memoryview`` slice of ``data`` (zero copy); parameters are real ``pb.InferParameter``s;
  typed ``contents`` are handed to betterproto2 (rare, small). Unknown fields are skipped, as
  protobuf requires.
- ``infer_response_pieces(msg)`` serializes a ``pb.ModelInferResponse`` into pieces whose
  concatenation is its protobuf encoding, with each payload as the buffer itself.

Equivalence with betterproto2 and Google protobuf is pinned by tests/core/test_wire.py.
"""

from __future__ import annotations

import struct

import betterproto2

from kserve_trio.proto import inference as pb

_SMALL = [bytes([i]) for i in range(128)]
_MASK64 = (1 << 64) - 1
_DOUBLE = struct.Struct("<d")


def encode_varint(n: int) -> bytes:
    """Unsigned varint; negative values as their 64-bit two's complement (protobuf int64)."""
    if 0 <= n < 128:
        return _SMALL[n]
    n &= _MASK64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint(buf, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result = b & 0x7F
    shift = 7
    pos += 1
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos  # a 10th byte's spare bits are dropped, as protobuf does
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def signed(n: int) -> int:
    """A varint read back as protobuf int64 (two's complement)."""
    return n - (1 << 64) if n >= 1 << 63 else n


def _fields(buf, start: int, end: int):
    """Yield (field number, wire type, value) where value is an int or a (start, end) span."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wt = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise ValueError(f"truncated field {field}")
            yield field, wt, (pos, pos + n)
            pos += n
        elif wt == 0:
            value, pos = _varint(buf, pos)
            if pos > end:
                raise ValueError(f"truncated field {field}")
            yield field, wt, value
        elif wt == 1:
            if pos + 8 > end:
                raise ValueError(f"truncated field {field}")
            yield field, wt, (pos, pos + 8)
            pos += 8
        elif wt == 5:
            if pos + 4 > end:
                raise ValueError(f"truncated field {field}")
            yield field, wt, (pos, pos + 4)
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wt}")


def _text(buf, span: tuple[int, int]) -> str:
    return bytes(buf[span[0] : span[1]]).decode("utf-8")


def _parameter(buf, span: tuple[int, int]) -> pb.InferParameter:
    param = pb.InferParameter()
    for field, wt, value in _fields(buf, *span):
        if field == 1 and wt == 0:
            param = pb.InferParameter(bool_param=bool(value))
        elif field == 2 and wt == 0:
            param = pb.InferParameter(int64_param=signed(value))
        elif field == 3 and wt == 2:
            param = pb.InferParameter(string_param=_text(buf, value))
        elif field == 4 and wt == 1:
            param = pb.InferParameter(double_param=_DOUBLE.unpack(buf[value[0] : value[1]])[0])
        elif field == 5 and wt == 0:
            param = pb.InferParameter(uint64_param=value)
    return param


def _map_entry(buf, span: tuple[int, int], into: dict) -> None:
    key = ""
    value = pb.InferParameter()
    for field, wt, v in _fields(buf, *span):
        if field == 1 and wt == 2:
            key = _text(buf, v)
        elif field == 2 and wt == 2:
            value = _parameter(buf, v)
    into[key] = value


def _shape(buf, wt: int, value, into: list[int]) -> None:
    if wt == 0:  # unpacked element
        into.append(signed(value))
        return
    pos, end = value
    while pos < end:
        v, pos = _varint(buf, pos)
        into.append(signed(v))
    if pos != end:
        raise ValueError("truncated packed shape")


class InferTensorView:
    """An input tensor of an ``InferRequestView`` (the fields of InferInputTensor)."""

    __slots__ = ("contents", "datatype", "name", "parameters", "shape")

    def __init__(self) -> None:
        self.name = ""
        self.datatype = ""
        self.shape: list[int] = []
        self.parameters: dict[str, pb.InferParameter] = {}
        self.contents: pb.InferTensorContents | None = None


class RequestedOutputView:
    """A requested output of an ``InferRequestView``."""

    __slots__ = ("name", "parameters")

    def __init__(self) -> None:
        self.name = ""
        self.parameters: dict[str, pb.InferParameter] = {}


class InferRequestView:
    """A parsed ``ModelInferRequest``: the attributes of ``pb.ModelInferRequest``, payloads as
    zero-copy ``memoryview`` slices of the received buffer."""

    __slots__ = (
        "id",
        "inputs",
        "model_name",
        "model_version",
        "outputs",
        "parameters",
        "raw_input_contents",
    )

    def __init__(self) -> None:
        self.model_name = ""
        self.model_version = ""
        self.id = ""
        self.parameters: dict[str, pb.InferParameter] = {}
        self.inputs: list[InferTensorView] = []
        self.outputs: list[RequestedOutputView] = []
        self.raw_input_contents: list[memoryview] = []


def _input(buf, span: tuple[int, int]) -> InferTensorView:
    t = InferTensorView()
    for field, wt, v in _fields(buf, *span):
        if field == 1 and wt == 2:
            t.name = _text(buf, v)
        elif field == 2 and wt == 2:
            t.datatype = _text(buf, v)
        elif field == 3:
            _shape(buf, wt, v, t.shape)
        elif field == 4 and wt == 2:
            _map_entry(buf, v, t.parameters)
        elif field == 5 and wt == 2:
            t.contents = pb.InferTensorContents.parse(bytes(buf[v[0] : v[1]]))
    return t


def _output(buf, span: tuple[int, int]) -> RequestedOutputView:
    o = RequestedOutputView()
    for field, wt, v in _fields(buf, *span):
        if field == 1 and wt == 2:
            o.name = _text(buf, v)
        elif field == 2 and wt == 2:
            _map_entry(buf, v, o.parameters)
    return o


def parse_infer_request(data: bytes | bytearray | memoryview) -> InferRequestView:
    """Parse a ``ModelInferRequest`` (raises ``ValueError`` on malformed input)."""
    buf = memoryview(data).cast("B")
    req = InferRequestView()
    try:
        for field, wt, v in _fields(buf, 0, len(buf)):
            if wt != 2:
                continue
            if field == 7:
                req.raw_input_contents.append(buf[v[0] : v[1]])
            elif field == 5:
                req.inputs.append(_input(buf, v))
            elif field == 1:
                req.model_name = _text(buf, v)
            elif field == 3:
                req.id = _text(buf, v)
            elif field == 4:
                _map_entry(buf, v, req.parameters)
            elif field == 6:
                req.outputs.append(_output(buf, v))
            elif field == 2:
                req.model_version = _text(buf, v)
    except IndexError:
        raise ValueError("truncated message") from None
    return req


# ---------------------------------------------------------------------------- response encode


def len_field(num: int, data: bytes) -> bytes:
    """A length-delimited field: tag, length, bytes."""
    return encode_varint(num << 3 | 2) + encode_varint(len(data)) + data


def param_bytes(param: pb.InferParameter) -> bytes:
    """The encoding of an ``InferParameter`` (its oneof member is always written)."""
    kind, value = betterproto2.which_one_of(param, "parameter_choice")
    if kind == "bool_param":
        return b"\x08" + encode_varint(int(value))
    if kind == "int64_param":
        return b"\x10" + encode_varint(value)
    if kind == "string_param":
        return len_field(3, value.encode())
    if kind == "double_param":
        return b"\x21" + _DOUBLE.pack(value)
    if kind == "uint64_param":
        return b"\x28" + encode_varint(value)
    return b""


def _params_bytes(num: int, params) -> bytes:
    out = []
    for key, param in params.items():
        entry = len_field(1, key.encode()) + len_field(2, param_bytes(param))
        out.append(len_field(num, entry))
    return b"".join(out)


def _output_tensor(t: pb.ModelInferResponseInferOutputTensor) -> bytes:
    parts = []
    if t.name:
        parts.append(len_field(1, t.name.encode()))
    if t.datatype:
        parts.append(len_field(2, t.datatype.encode()))
    if t.shape:
        parts.append(len_field(3, b"".join(encode_varint(d) for d in t.shape)))
    if t.parameters:
        parts.append(_params_bytes(4, t.parameters))
    if t.contents is not None:
        parts.append(len_field(5, bytes(t.contents)))
    return b"".join(parts)


def infer_response_pieces(msg: pb.ModelInferResponse) -> list[bytes | memoryview]:
    """``msg`` serialized as pieces whose concatenation is its protobuf encoding; each
    ``raw_output_contents`` payload is the buffer itself (never copied here)."""
    head = []
    if msg.model_name:
        head.append(len_field(1, msg.model_name.encode()))
    if msg.model_version:
        head.append(len_field(2, msg.model_version.encode()))
    if msg.id:
        head.append(len_field(3, msg.id.encode()))
    if msg.parameters:
        head.append(_params_bytes(4, msg.parameters))
    for out in msg.outputs:
        head.append(len_field(5, _output_tensor(out)))
    pieces: list[bytes | memoryview] = [b"".join(head)]
    for raw in msg.raw_output_contents:
        view = raw if isinstance(raw, bytes) else memoryview(raw).cast("B")
        pieces.append(b"\x32" + encode_varint(len(view)))
        pieces.append(view)
    return pieces


__all__ = [
    "InferRequestView",
    "InferTensorView",
    "RequestedOutputView",
    "encode_varint",
    "infer_response_pieces",
    "len_field",
    "param_bytes",
    "parse_infer_request",
    "signed",
]
