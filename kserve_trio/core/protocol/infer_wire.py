"""``ModelInferRequest`` and ``ModelInferResponse`` on the wire, both directions, both sides.

The one module that codes the two ModelInfer messages: the server parses requests and encodes
responses, the client encodes requests and parses responses, all through the same types and the
same primitives (``core.protocol.wire``). betterproto2 still codes every other message.

- ``InferRequestMessage`` (``InferInputTensor``, ``InferRequestedOutput``) and
  ``InferResponseMessage`` (``InferOutputTensor``) carry the fields of the protobuf messages
  under the same names. Parameters are plain values (``core.protocol.wire.ParamValue``), typed data is a
  ``core.protocol.wire.TensorContents``, and ``raw_input_contents`` / ``raw_output_contents`` entries are
  buffers: on parse, ``memoryview`` slices of the received bytes (never copied); on encode,
  whatever buffer the caller put there (a view of its array is never copied either).
- ``parse_infer_request`` / ``parse_infer_response`` read a message (``ValueError`` when it is
  malformed: truncated, an invalid wire type, a string that is not UTF-8).
- ``infer_request_pieces`` / ``infer_response_pieces`` write one as ``WirePieces``: the encoded
  fields before each payload joined into one ``bytes``, each payload as its own buffer, so a
  transport can send a large payload without joining it into a copy first. ``bytes()`` of a
  message or of its pieces is the joined encoding.

Field order on encode is the field-number order protobuf writes; proto3 defaults (empty
strings, empty lists and maps, no contents) are omitted; a parameter's oneof member is always
written. Equivalence with Google protobuf (tritonclient's ``service_pb2``) in both directions is
pinned by tests/core/test_wire.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kserve_trio.core.protocol.request_bounds import RequestBounds, check_count, shown
from kserve_trio.core.protocol.wire import (
    Params,
    TensorContents,
    contents_bytes,
    decode_varint,
    encode_varint,
    iter_fields,
    len_field,
    params_bytes,
    parse_contents,
    parse_map_entry,
    signed,
    str_field,
    text,
    varints,
)

Buffer = bytes | bytearray | memoryview
"""A payload entry: what ``raw_*_contents`` hold."""


class WirePieces:
    """A serialized message as pieces whose concatenation is its protobuf encoding.

    ``pieces[0]`` and every piece between two payloads are ``bytes`` (tags, lengths, the small
    fields); each payload is the caller's buffer itself. ``nbytes`` is the encoded length.
    """

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: list[Buffer], nbytes: int | None = None) -> None:
        self.pieces = pieces
        if nbytes is None:
            nbytes = sum(len(p) if p.__class__ is bytes else memoryview(p).nbytes for p in pieces)
        self.nbytes = nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)

    def __iter__(self) -> Iterator[Buffer]:
        return iter(self.pieces)

    def __repr__(self) -> str:
        return f"WirePieces({len(self.pieces)} pieces, {self.nbytes} bytes)"


def _flat(buf: Buffer) -> bytes | memoryview:
    """``buf`` as a flat byte buffer (``bytes`` as it is, anything else as a ``B`` view)."""
    if type(buf) is bytes:
        return buf
    if type(buf) is memoryview and buf.ndim == 1 and buf.format == "B":
        return buf
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _pieces(head: list[bytes], tag: bytes, payloads: Sequence[Buffer]) -> WirePieces:
    """``head`` fields, then each payload as a ``tag`` field: the prefix of each payload is
    joined onto the bytes before it."""
    pieces: list[Buffer] = []
    total = 0
    for raw in payloads:
        flat = _flat(raw)
        size = flat.nbytes if type(flat) is memoryview else len(flat)
        head.append(tag)
        head.append(encode_varint(size))
        joined = b"".join(head)
        pieces.append(joined)
        pieces.append(flat)
        total += len(joined) + size
        head = []
    if head or not pieces:
        joined = b"".join(head)
        pieces.append(joined)
        total += len(joined)
    return WirePieces(pieces, total)


class _Message:
    """Equality and repr over ``__slots__`` (for tests and logs; never on the hot path)."""

    __slots__ = ()
    _names: tuple[str, ...] = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._names)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._names)
        return f"{type(self).__name__}({fields})"


# --------------------------------------------------------------------------------------------
# tensors


class _Tensor(_Message):
    __slots__ = ("contents", "datatype", "name", "parameters", "shape")
    _names = ("name", "datatype", "shape", "parameters", "contents")

    def __init__(
        self,
        name: str = "",
        datatype: str = "",
        shape: Sequence[int] = (),
        parameters: Params | None = None,
        contents: TensorContents | None = None,
    ) -> None:
        self.name = name
        self.datatype = datatype
        self.shape: list[int] = list(shape)
        self.parameters: Params = {} if parameters is None else parameters
        self.contents = contents


_AnyTensor = TypeVar("_AnyTensor", bound=_Tensor)


class InferInputTensor(_Tensor):
    """``ModelInferRequest.InferInputTensor``."""

    __slots__ = ()


class InferOutputTensor(_Tensor):
    """``ModelInferResponse.InferOutputTensor``."""

    __slots__ = ()


class InferRequestedOutput(_Message):
    """``ModelInferRequest.InferRequestedOutputTensor``."""

    __slots__ = ("name", "parameters")
    _names = __slots__

    def __init__(self, name: str = "", parameters: Params | None = None) -> None:
        self.name = name
        self.parameters: Params = {} if parameters is None else parameters


def _tensor_bytes(t: Any) -> bytes:
    parts = [str_field(1, t.name), str_field(2, t.datatype)]
    if t.shape:
        parts.append(len_field(3, varints(t.shape)))
    if t.parameters:
        parts.append(params_bytes(4, t.parameters))
    if t.contents is not None:
        parts.append(len_field(5, contents_bytes(t.contents)))
    return b"".join(parts)


def _read_shape(buf, pos: int, end: int, shape: list[int]) -> None:
    """A packed ``int64`` run (one-byte dimensions read inline)."""
    while pos < end:
        d = buf[pos]
        if d < 0x80:
            shape.append(d)
            pos += 1
        else:
            d, pos = decode_varint(buf, pos)
            shape.append(d - (1 << 64) if d >= 1 << 63 else d)
    if pos != end:
        raise ValueError("truncated packed shape")


def _parse_tensor(
    buf, start: int, end: int, t: _AnyTensor, max_params: int = 0, what: str = "input"
) -> _AnyTensor:
    for field, wt, v in iter_fields(buf, start, end):
        if field == 3:
            if wt == 2:
                _read_shape(buf, v[0], v[1], t.shape)
            elif wt == 0:
                t.shape.append(signed(v))
        elif wt != 2:
            continue
        elif field == 1:
            t.name = text(buf, v)
        elif field == 2:
            t.datatype = text(buf, v)
        elif field == 4:
            parse_map_entry(buf, v, t.parameters)
            if max_params and len(t.parameters) > max_params:
                check_count(
                    f"{what} {shown(t.name)} parameters",
                    len(t.parameters),
                    max_params,
                    "max_parameters",
                )
        elif field == 5:
            t.contents = parse_contents(buf, v[0], v[1])
    return t


def _parse_requested(buf, start: int, end: int, max_params: int = 0) -> InferRequestedOutput:
    o = InferRequestedOutput()
    for field, wt, v in iter_fields(buf, start, end):
        if wt == 2:
            if field == 1:
                o.name = text(buf, v)
            elif field == 2:
                parse_map_entry(buf, v, o.parameters)
                if max_params and len(o.parameters) > max_params:
                    check_count(
                        f"output {shown(o.name)} parameters",
                        len(o.parameters),
                        max_params,
                        "max_parameters",
                    )
    return o


# --------------------------------------------------------------------------------------------
# ModelInferRequest


class InferRequestMessage(_Message):
    """``ModelInferRequest``: ``bytes(msg)`` is its encoding, ``FromString`` parses one."""

    __slots__ = (
        "id",
        "inputs",
        "model_name",
        "model_version",
        "outputs",
        "parameters",
        "raw_input_contents",
    )
    _names = (
        "model_name",
        "model_version",
        "id",
        "parameters",
        "inputs",
        "outputs",
        "raw_input_contents",
    )

    def __init__(
        self,
        model_name: str = "",
        model_version: str = "",
        id: str = "",
        parameters: Params | None = None,
        inputs: list[InferInputTensor] | None = None,
        outputs: list[InferRequestedOutput] | None = None,
        raw_input_contents: list[Buffer] | None = None,
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.id = id
        self.parameters: Params = {} if parameters is None else parameters
        self.inputs: list[InferInputTensor] = [] if inputs is None else inputs
        self.outputs: list[InferRequestedOutput] = [] if outputs is None else outputs
        self.raw_input_contents: list[Buffer] = (
            [] if raw_input_contents is None else raw_input_contents
        )

    def __bytes__(self) -> bytes:
        return b"".join(infer_request_pieces(self).pieces)

    @staticmethod
    def FromString(data: Buffer) -> InferRequestMessage:
        return parse_infer_request(data)


def infer_request_pieces(msg: Any) -> WirePieces:
    """``msg`` (an ``InferRequestMessage``, or anything with its attributes) encoded."""
    head = [str_field(1, msg.model_name), str_field(2, msg.model_version), str_field(3, msg.id)]
    if msg.parameters:
        head.append(params_bytes(4, msg.parameters))
    for t in msg.inputs:
        head.append(len_field(5, _tensor_bytes(t)))
    for o in msg.outputs:
        body = str_field(1, o.name)
        if o.parameters:
            body += params_bytes(2, o.parameters)
        head.append(len_field(6, body))
    return _pieces(head, b"\x3a", msg.raw_input_contents)


def parse_infer_request(data: Buffer, bounds: RequestBounds | None = None) -> InferRequestMessage:
    """Parse a ``ModelInferRequest``; each ``raw_input_contents`` entry is a ``memoryview``
    slice of ``data``.

    With ``bounds`` (a server's ``limits:``), the parse stops at the first repeated field that
    grows past its limit (inputs, requested outputs and raw contents past ``max_tensors``,
    parameters past ``max_parameters``) with ``InvalidArgument``, so refusing a message of a
    million empty entries costs as much as parsing the limit's worth of them; names and the
    rest of ``core.protocol.request_bounds.check_infer_request`` are the caller's to check."""
    req = InferRequestMessage()
    _parse_infer(
        data, req, 7, req.raw_input_contents, req.inputs, InferInputTensor, req.outputs, bounds
    )
    return req


def _parse_infer(
    data: Buffer,
    msg: Any,
    raw_field: int,
    raw: list[Buffer],
    tensors: list[Any],
    tensor_type: type,
    requested: list[InferRequestedOutput] | None,
    bounds: RequestBounds | None = None,
) -> None:
    """The field loop both ModelInfer messages share: name (1), version (2), id (3),
    parameters (4), tensors (5) and raw contents (``raw_field``, views of ``data``); a request
    also has requested outputs (6). Unknown fields and other wire types are skipped. With
    ``bounds``, each repeated field is counted as it grows (``parse_infer_request``)."""
    buf = memoryview(data).cast("B")
    max_tensors = bounds.max_tensors if bounds is not None else 0
    max_params = bounds.max_parameters if bounds is not None else 0
    try:
        for field, wt, v in iter_fields(buf, 0, len(buf)):
            if wt != 2:
                continue
            if field == raw_field:
                raw.append(buf[v[0] : v[1]])
                if max_tensors and len(raw) > max_tensors:
                    check_count("raw_input_contents", len(raw), max_tensors, "max_tensors")
            elif field == 5:
                tensors.append(_parse_tensor(buf, v[0], v[1], tensor_type(), max_params))
                if max_tensors and len(tensors) > max_tensors:
                    check_count("inputs", len(tensors), max_tensors, "max_tensors")
            elif field == 1:
                msg.model_name = text(buf, v)
            elif field == 3:
                msg.id = text(buf, v)
            elif field == 4:
                parse_map_entry(buf, v, msg.parameters)
                if max_params and len(msg.parameters) > max_params:
                    check_count(
                        "request parameters", len(msg.parameters), max_params, "max_parameters"
                    )
            elif field == 6 and requested is not None:
                requested.append(_parse_requested(buf, v[0], v[1], max_params))
                if max_tensors and len(requested) > max_tensors:
                    check_count("outputs", len(requested), max_tensors, "max_tensors")
            elif field == 2:
                msg.model_version = text(buf, v)
    except IndexError:
        raise ValueError("truncated message") from None


# --------------------------------------------------------------------------------------------
# ModelInferResponse


class InferResponseMessage(_Message):
    """``ModelInferResponse``: ``pieces()`` / ``bytes(msg)`` encode it, ``FromString`` parses
    one (the ``reply_type`` a client transport is given)."""

    __slots__ = (
        "id",
        "model_name",
        "model_version",
        "outputs",
        "parameters",
        "raw_output_contents",
    )
    _names = ("model_name", "model_version", "id", "parameters", "outputs", "raw_output_contents")

    def __init__(
        self,
        model_name: str = "",
        model_version: str = "",
        id: str = "",
        parameters: Params | None = None,
        outputs: list[InferOutputTensor] | None = None,
        raw_output_contents: list[Buffer] | None = None,
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.id = id
        self.parameters: Params = {} if parameters is None else parameters
        self.outputs: list[InferOutputTensor] = [] if outputs is None else outputs
        self.raw_output_contents: list[Buffer] = (
            [] if raw_output_contents is None else raw_output_contents
        )

    def pieces(self) -> WirePieces:
        return infer_response_pieces(
            self.model_name,
            self.model_version,
            self.id,
            self.parameters,
            self.outputs,
            self.raw_output_contents,
        )

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces().pieces)

    @staticmethod
    def FromString(data: Buffer) -> InferResponseMessage:
        return parse_infer_response(data)


def infer_response_pieces(
    model_name: str,
    model_version: str,
    id: str,
    parameters: Mapping[str, Any] | None,
    outputs: Sequence[Any],
    raw_output_contents: Sequence[Buffer],
) -> WirePieces:
    """A ``ModelInferResponse`` with these fields encoded; ``outputs`` are
    ``InferOutputTensor``s (or anything with their attributes)."""
    head = [str_field(1, model_name), str_field(2, model_version), str_field(3, id)]
    if parameters:
        head.append(params_bytes(4, parameters))
    for t in outputs:
        head.append(len_field(5, _tensor_bytes(t)))
    return _pieces(head, b"\x32", raw_output_contents)


def parse_infer_response(data: Buffer) -> InferResponseMessage:
    """Parse a ``ModelInferResponse``; each ``raw_output_contents`` entry is a ``memoryview``
    slice of ``data``."""
    resp = InferResponseMessage()
    _parse_infer(data, resp, 6, resp.raw_output_contents, resp.outputs, InferOutputTensor, None)
    return resp


__all__ = [
    "Buffer",
    "InferInputTensor",
    "InferOutputTensor",
    "InferRequestMessage",
    "InferRequestedOutput",
    "InferResponseMessage",
    "WirePieces",
    "infer_request_pieces",
    "infer_response_pieces",
    "parse_infer_request",
    "parse_infer_response",
]
