"""Protobuf wire primitives for the messages the serving hot path codes by hand.

betterproto2 parses and serializes field by field through generic machinery (tens of
microseconds for a small ``ModelInferRequest``) and copies every ``bytes`` field on parse. The
ModelInfer messages are therefore coded directly (``core.protocol.infer_wire``) from the pieces defined
here, which the gateway's request peek reads with too:

- varints (``encode_varint``, ``decode_varint``, ``signed``) and the field walker ``iter_fields``;
- length-delimited fields (``len_field``);
- ``InferParameter`` values as plain Python values (``ParamValue``): ``bool``, ``int``,
  ``float``, ``str``, ``Uint64`` (an ``int`` that travels as ``uint64_param``) or ``None`` for
  a parameter with no member set; ``param_bytes`` / ``parse_param`` code one, ``plain_param``
  turns a betterproto2 ``InferParameter`` into one;
- ``TensorContents``, the typed ``InferTensorContents`` of a tensor, with its parser and
  encoder.

Rules shared by every reader here: unknown fields, and known fields of an unexpected wire type,
are skipped as protobuf requires; a truncated value or an invalid wire type raises
``ValueError``; a repeated scalar is read packed or unpacked.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import betterproto2
import numpy as np

from kserve_trio.proto import inference as pb

_SMALL = [bytes([i]) for i in range(128)]
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_DOUBLE = struct.Struct("<d")
_INT64_MIN = -(1 << 63)
_UINT64_END = 1 << 64

# --------------------------------------------------------------------------------------------
# varints and fields


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


def decode_varint(buf, pos: int) -> tuple[int, int]:
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


FieldValue = Any
"""A value ``iter_fields`` yields: an ``int`` for wire type 0 (varint), a ``(start, end)`` span of
the buffer for the others. Which one depends on the wire type, which a type checker cannot
follow, so the alias is left open; every caller tests the wire type before using the value."""


def iter_fields(buf, start: int, end: int) -> Iterator[tuple[int, int, FieldValue]]:
    """Yield (field number, wire type, value) where value is an int or a (start, end) span.

    Keys and lengths under 128 (every key of these messages, most lengths) are read inline:
    a call per varint was a third of a small request's parse."""
    pos = start
    while pos < end:
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = decode_varint(buf, pos)
        field, wt = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wt == 2:
            n = buf[pos]
            if n < 0x80:
                pos += 1
            else:
                n, pos = decode_varint(buf, pos)
            if pos + n > end:
                raise ValueError(f"truncated field {field}")
            yield field, wt, (pos, pos + n)
            pos += n
        elif wt == 0:
            value, pos = decode_varint(buf, pos)
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


def text(buf, span: tuple[int, int]) -> str:
    """A string field (proto3 strings are UTF-8; anything else raises ``ValueError``)."""
    return str(buf[span[0] : span[1]], "utf-8")


_LEN_KEYS = [encode_varint(num << 3 | 2) for num in range(16)]


def len_field(num: int, data: bytes) -> bytes:
    """A length-delimited field: tag, length, bytes."""
    n = len(data)
    key = _LEN_KEYS[num] if num < 16 else encode_varint(num << 3 | 2)
    return key + (_SMALL[n] if n < 128 else encode_varint(n)) + data


def str_field(num: int, value: str) -> bytes:
    """A string field, omitted when empty (proto3 default)."""
    if not value:
        return b""
    data = value.encode()
    n = len(data)
    return _LEN_KEYS[num] + (_SMALL[n] if n < 128 else encode_varint(n)) + data


def varints(values: Sequence[int]) -> bytes:
    """The body of a packed repeated varint field (small non-negative values looked up)."""
    return b"".join([_SMALL[v] if 0 <= v < 128 else encode_varint(int(v)) for v in values])


def packed_varints(num: int, values: Sequence[int]) -> bytes:
    """A packed repeated varint field (``int64``/``int32``/``uint*``/``bool``), omitted when
    empty; negative values as 64-bit two's complement, as protobuf writes them."""
    if not values:
        return b""
    return len_field(num, varints(values))


def read_varints(buf, wt: int, value, into: list[int]) -> None:
    """Append a repeated varint field's raw values: one unpacked element or a packed run."""
    if wt == 0:
        into.append(value)
        return
    pos, end = value
    while pos < end:
        v, pos = decode_varint(buf, pos)
        into.append(v)
    if pos != end:
        raise ValueError("truncated packed field")


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat ``B`` view of an array's bytes for a payload field (copied once only if the array
    is not C-contiguous; works for dtypes numpy cannot export, such as bfloat16)."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


# --------------------------------------------------------------------------------------------
# parameters


class Uint64(int):
    """An ``int`` that travels as ``uint64_param`` (a plain ``int`` travels as ``int64_param``
    when it fits, which is what every parameter KServe and Triton define uses)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Uint64({int(self)})"


ParamValue = bool | int | float | str | None
"""An ``InferParameter`` as a plain value; ``None`` is a parameter with no member set."""

Params = dict[str, ParamValue]


def plain_param(value: Any) -> ParamValue:
    """``value`` as a ``ParamValue``: a betterproto2 ``InferParameter`` becomes its member's
    value (``uint64_param`` as ``Uint64``), numpy scalars become Python ones, anything else is
    returned as it is."""
    if isinstance(value, pb.InferParameter):
        kind, member = betterproto2.which_one_of(value, "parameter_choice")
        if kind == "uint64_param" and isinstance(member, int):
            return Uint64(member)
        return member if kind else None
    if isinstance(value, np.generic):
        return value.item()
    return value


def plain_params(params: Mapping[str, Any] | None) -> Params:
    """A parameter map with every value as a ``ParamValue`` (see ``plain_param``)."""
    if not params:
        return {}
    return {k: plain_param(v) for k, v in params.items()}


def param_bytes(value: ParamValue) -> bytes:
    """The ``InferParameter`` encoding of ``value`` (its oneof member is always written).

    ``bool`` -> ``bool_param``; ``Uint64`` -> ``uint64_param``; any other ``int`` ->
    ``int64_param`` when it fits, else ``uint64_param`` up to 2**64 - 1; ``float`` ->
    ``double_param``; ``str`` -> ``string_param``; ``None`` -> no member. Anything else (or an
    integer outside both ranges) raises ``ValueError``.
    """
    if type(value) is str:
        return len_field(3, value.encode())
    if type(value) is int and _INT64_MIN <= value < 1 << 63:
        return b"\x10" + encode_varint(value)
    value = plain_param(value)
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x08\x01" if value else b"\x08\x00"
    if isinstance(value, int):
        if not isinstance(value, Uint64) and _INT64_MIN <= value < 1 << 63:
            return b"\x10" + encode_varint(value)
        if 0 <= value < _UINT64_END:
            return b"\x28" + encode_varint(value)
        raise ValueError(f"parameter value {value} is outside the int64 and uint64 ranges")
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, str):
        return len_field(3, value.encode())
    raise ValueError(
        f"a parameter value must be bool, int, float or str, got {type(value).__name__}"
    )


def params_bytes(num: int, params: Mapping[str, Any]) -> bytes:
    """A ``map<string, InferParameter>`` field: one entry per key, in the map's order."""
    return b"".join(
        [
            len_field(num, str_field(1, key) + len_field(2, param_bytes(v)))
            for key, v in params.items()
        ]
    )


def parse_param(buf, start: int, end: int) -> ParamValue:
    """An ``InferParameter`` (the last member on the wire wins, as protobuf's oneof does)."""
    if end - start >= 2 and buf[start] == 0x10 and buf[end - 1] < 0x80:  # one int64_param
        v, pos = decode_varint(buf, start + 1)
        if pos == end:
            return signed(v)
    value: ParamValue = None
    for field, wt, v in iter_fields(buf, start, end):
        if wt == 0:
            if field == 1:
                value = v != 0
            elif field == 2:
                value = signed(v)
            elif field == 5:
                value = Uint64(v)
        elif field == 3 and wt == 2:
            value = text(buf, v)
        elif field == 4 and wt == 1:
            value = _DOUBLE.unpack_from(buf, v[0])[0]
    return value


def _entry_fast(buf, start: int, end: int) -> tuple[str, ParamValue] | None:
    """The common layout of a map entry, as every protobuf writer lays it out: a key shorter
    than 128 bytes, then a value message shorter than 128 bytes (or none). None otherwise."""
    if end - start < 2 or buf[start] != 0x0A or buf[start + 1] >= 0x80:
        return None
    kend = start + 2 + buf[start + 1]
    if kend > end:
        return None
    key = str(buf[start + 2 : kend], "utf-8")
    if kend == end:
        return key, None
    if end - kend < 2 or buf[kend] != 0x12 or kend + 2 + buf[kend + 1] != end:
        return None
    return key, parse_param(buf, kend + 2, end)


def parse_map_entry(buf, span: tuple[int, int], into: Params) -> None:
    """One ``map<string, InferParameter>`` entry into ``into`` (a later key replaces)."""
    fast = _entry_fast(buf, span[0], span[1])
    if fast is not None:
        into[fast[0]] = fast[1]
        return
    key = ""
    value: ParamValue = None
    for field, wt, v in iter_fields(buf, span[0], span[1]):
        if wt == 2:
            if field == 1:
                key = text(buf, v)
            elif field == 2:
                value = parse_param(buf, v[0], v[1])
    into[key] = value


# --------------------------------------------------------------------------------------------
# typed contents


class TensorContents:
    """``InferTensorContents``: a tensor's data as typed repeated fields (values as Python
    ``bool``/``int``/``float``/``bytes``, in row-major order)."""

    __slots__ = (
        "bool_contents",
        "bytes_contents",
        "fp32_contents",
        "fp64_contents",
        "int64_contents",
        "int_contents",
        "uint64_contents",
        "uint_contents",
    )

    def __init__(
        self,
        *,
        bool_contents: Sequence[bool] = (),
        int_contents: Sequence[int] = (),
        int64_contents: Sequence[int] = (),
        uint_contents: Sequence[int] = (),
        uint64_contents: Sequence[int] = (),
        fp32_contents: Sequence[float] = (),
        fp64_contents: Sequence[float] = (),
        bytes_contents: Sequence[bytes] = (),
    ) -> None:
        self.bool_contents = list(bool_contents)
        self.int_contents = list(int_contents)
        self.int64_contents = list(int64_contents)
        self.uint_contents = list(uint_contents)
        self.uint64_contents = list(uint64_contents)
        self.fp32_contents = list(fp32_contents)
        self.fp64_contents = list(fp64_contents)
        self.bytes_contents = list(bytes_contents)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorContents):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __repr__(self) -> str:
        set_ = ", ".join(f"{n}={getattr(self, n)!r}" for n in CONTENTS_FIELDS if getattr(self, n))
        return f"TensorContents({set_})"


CONTENTS_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)
"""The fields of ``InferTensorContents`` in field-number order (1..8)."""


def _int32(v: int) -> int:
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def _fixed(buf, wt: int, value, want_wt: int, fmt: str, into: list) -> None:
    size = 4 if want_wt == 5 else 8
    start, end = value
    if wt == 2:  # packed
        if (end - start) % size:
            raise ValueError("truncated packed field")
        into.extend(np.frombuffer(buf[start:end], dtype=fmt).tolist())
    elif wt == want_wt:
        into.append(np.frombuffer(buf[start:end], dtype=fmt)[0].item())


def parse_contents(buf, start: int, end: int) -> TensorContents:
    """An ``InferTensorContents`` message."""
    c = TensorContents()
    for field, wt, v in iter_fields(buf, start, end):
        if field == 6:
            if wt in (2, 5):
                _fixed(buf, wt, v, 5, "<f4", c.fp32_contents)
        elif field == 7:
            if wt in (2, 1):
                _fixed(buf, wt, v, 1, "<f8", c.fp64_contents)
        elif field == 8:
            if wt == 2:
                c.bytes_contents.append(bytes(buf[v[0] : v[1]]))
        elif 1 <= field <= 5 and wt in (0, 2):
            raw: list[int] = []
            read_varints(buf, wt, v, raw)
            if field == 1:
                c.bool_contents.extend([x != 0 for x in raw])
            elif field == 2:
                c.int_contents.extend([_int32(x) for x in raw])
            elif field == 3:
                c.int64_contents.extend([signed(x) for x in raw])
            elif field == 4:
                c.uint_contents.extend([x & _MASK32 for x in raw])
            else:
                c.uint64_contents.extend(raw)
    return c


def _packed_fixed(num: int, values: Sequence[float], fmt: str) -> bytes:
    if not len(values):
        return b""
    return len_field(num, np.asarray(values, dtype=fmt).tobytes())


def contents_bytes(c: Any) -> bytes:
    """The encoding of a ``TensorContents`` (or anything with its eight list attributes, such
    as a betterproto2 ``InferTensorContents``): packed scalars, one entry per ``bytes``."""
    return b"".join(
        [
            packed_varints(1, [1 if x else 0 for x in c.bool_contents]),
            packed_varints(2, c.int_contents),
            packed_varints(3, c.int64_contents),
            packed_varints(4, c.uint_contents),
            packed_varints(5, c.uint64_contents),
            _packed_fixed(6, c.fp32_contents, "<f4"),
            _packed_fixed(7, c.fp64_contents, "<f8"),
            *[len_field(8, bytes(b)) for b in c.bytes_contents],
        ]
    )


__all__ = [
    "CONTENTS_FIELDS",
    "ParamValue",
    "Params",
    "TensorContents",
    "Uint64",
    "byte_view",
    "contents_bytes",
    "encode_varint",
    "len_field",
    "packed_varints",
    "param_bytes",
    "params_bytes",
    "parse_contents",
    "parse_map_entry",
    "parse_param",
    "plain_param",
    "plain_params",
    "read_varints",
    "signed",
    "str_field",
    "text",
    "varints",
]
