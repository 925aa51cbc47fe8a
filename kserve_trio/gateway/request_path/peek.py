"""Reading the few routing fields of a forwarded request without decoding it.

The gateway forwards ModelInfer (and stream messages, and shared-memory Register/Unregister) as
the bytes it received: it never decodes or re-encodes the payload. To route, it needs only
``model_name`` (field 1) and ``id`` (field 3) of a ``ModelInferRequest``, and, when it routes by
work, the shape of one named input (field 5 ``inputs``: a tensor's ``name`` is its field 1, its
``shape`` its field 3, packed or not). ``peek_infer_request`` walks the top-level fields once,
skipping every other field by its length (so a 10 MB ``raw_input_contents`` costs nothing), and
looks inside an input only until the named one is found. A request whose transport compressed
it is read after the server layer decompressed it; the bytes forwarded are the received ones.

Semantics are protobuf's: the last occurrence of a singular field wins, shape values from
several occurrences concatenate, fields of a wrong wire type are unknown fields and skipped.
Anything malformed (truncated, an impossible length, a varint over 10 bytes, a group, invalid
UTF-8 in a name) is ``InvalidArgument``; nothing else escapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol import (
    check_count,
    decode_varint,
    iter_fields,
    require_model_name,
    signed,
)

_MASK64 = (1 << 64) - 1
_Span = tuple[int, int]
_Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class PeekedRequest:
    """The routing fields of a ``ModelInferRequest``; ``shape`` is the named input's shape,
    ``None`` when no input was asked for or the request has no input of that name."""

    model_name: str
    id: str
    shape: tuple[int, ...] | None = None


def _text(buf: memoryview, span: tuple[int, int] | None, what: str) -> str:
    if span is None:
        return ""
    try:
        return bytes(buf[span[0] : span[1]]).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"malformed ModelInferRequest: {what} is not valid UTF-8") from None


def _tensor(sub: memoryview, target: bytes) -> tuple[int, ...] | None:
    """The shape of input ``sub`` if its name is ``target``, else ``None``."""
    name: tuple[int, int] | None = None
    dims: list[int] = []
    for field, wt, value in iter_fields(sub, 0, len(sub)):
        if field == 1 and wt == 2:
            name = cast(_Span, value)
        elif field == 3 and wt == 0:  # one unpacked element
            dims.append(signed(cast(int, value) & _MASK64))
        elif field == 3 and wt == 2:  # packed elements
            start, end = cast(_Span, value)
            packed = sub[start:end]
            pos = 0
            while pos < len(packed):
                element, pos = decode_varint(packed, pos)
                dims.append(signed(element & _MASK64))
    if name is None:
        return tuple(dims) if target == b"" else None
    return tuple(dims) if sub[name[0] : name[1]] == target else None


_COUNTED = {5: "inputs", 6: "outputs", 7: "raw_input_contents"}


def _walk(
    buf: memoryview, max_tensors: int = 0
) -> tuple[tuple[int, int] | None, tuple[int, int] | None, list]:
    """One pass over the top-level fields: the spans of ``model_name``, ``id`` and every
    input tensor (in order). With ``max_tensors``, the walk stops at the first of inputs,
    requested outputs or raw contents past it (``core.protocol.request_bounds.check_count``): a
    message of a million empty entries is refused for the price of the limit's worth."""
    model: tuple[int, int] | None = None
    ident: tuple[int, int] | None = None
    inputs: list[tuple[int, int]] = []
    counts = dict.fromkeys(_COUNTED, 0)
    try:
        for field, wt, value in iter_fields(buf, 0, len(buf)):
            if wt != 2:
                continue
            if field == 1:
                model = cast(_Span, value)
            elif field == 3:
                ident = cast(_Span, value)
            elif field == 5:
                inputs.append(cast(_Span, value))
            if max_tensors and field in counts:
                counts[field] += 1
                if counts[field] > max_tensors:
                    check_count(_COUNTED[field], counts[field], max_tensors, "max_tensors")
    except IndexError:  # a varint running off the end of its buffer
        raise InvalidArgument("malformed ModelInferRequest: truncated message") from None
    except ValueError as exc:
        raise InvalidArgument(f"malformed ModelInferRequest: {exc}") from None
    return model, ident, inputs


def _shape(buf: memoryview, inputs: list, name: str) -> tuple[int, ...] | None:
    """The shape of the first input named ``name`` (inputs after it are not looked into)."""
    target = name.encode("utf-8")
    try:
        for start, end in inputs:
            shape = _tensor(buf[start:end], target)
            if shape is not None:
                return shape
    except IndexError:
        raise InvalidArgument("malformed ModelInferRequest: truncated input tensor") from None
    except ValueError as exc:
        raise InvalidArgument(f"malformed ModelInferRequest: {exc}") from None
    return None


def peek_routing(
    data: _Buffer, batch_input: Callable[[str], tuple[str, int] | None], max_tensors: int = 0
) -> PeekedRequest:
    """``model_name``, ``id`` and, when ``batch_input(model_name)`` names an input, that
    input's shape, from a single walk over the top-level fields (the routing policy knows
    which input to read only once it knows the model). An empty ``model_name`` is
    ``InvalidArgument``: such a request cannot be routed."""
    buf = memoryview(data).cast("B")
    model, ident, inputs = _walk(buf, max_tensors)
    model_name = _text(buf, model, "model_name")
    require_model_name(model_name)
    batch = batch_input(model_name)
    shape = _shape(buf, inputs, batch[0]) if batch is not None else None
    return PeekedRequest(model_name, _text(buf, ident, "id"), shape)


def peek_infer_request(data: _Buffer, input_name: str | None = None) -> PeekedRequest:
    """``model_name``, ``id`` and (with ``input_name``) that input's shape; see the module
    docstring. An empty ``model_name`` is ``InvalidArgument`` too: such a request cannot be
    routed."""
    return peek_routing(data, lambda _model: None if input_name is None else (input_name, 0))


def peek_region_name(data: _Buffer, rpc: str) -> str:
    """``name`` (field 1) of a ``SystemSharedMemoryRegisterRequest`` or ``...UnregisterRequest``
    (``rpc`` names it in errors); ``""`` when absent, which the caller judges (empty means
    "every region" to Unregister and is an error to Register)."""
    buf = memoryview(data).cast("B")
    name: tuple[int, int] | None = None
    try:
        for field, wt, value in iter_fields(buf, 0, len(buf)):
            if field == 1 and wt == 2:
                name = cast(_Span, value)
        text = "" if name is None else bytes(buf[name[0] : name[1]]).decode("utf-8")
    except IndexError:
        raise InvalidArgument(f"malformed {rpc} request: truncated message") from None
    except ValueError as exc:
        raise InvalidArgument(f"malformed {rpc} request: {exc}") from None
    return text


__all__ = ["PeekedRequest", "peek_infer_request", "peek_region_name", "peek_routing"]
