"""Messages as a call sends and receives them: caps, raw and typed forms, reply pieces.

- ``Limits``: one server's message caps (``grpc.max_*_msg_bytes``, on decompressed sizes),
  whether every reply is compressed (``grpc.compress_responses``), the server's ``limits:``
  block (``edge``), whose name and repeated-field bounds ``parse_message`` applies, and the
  process's request bytes in flight its calls charge (``inflight``, the admission's
  ``InflightBytes``).
- ``RawMessage``: one received message exactly as it arrived (compressed ones still compressed).
- ``parse_message``: bytes to a typed message. ModelInfer requests go through our own wire
  parser (payloads stay views of the received bytes, repeated fields counted as they grow);
  every other message is scanned for its bounds on the wire (``message_check.scan_bounds``),
  decoded by betterproto2, then checked by ``message_check.wrong_field`` and ``check_bounds``,
  so a field sent with the wrong wire type, a malformed message or a name or repeated field
  over its bound is INVALID_ARGUMENT, refused before the work it would cost, and never a
  TypeError deep in a handler.
- ``reply_pieces``: whatever a handler returns (``WirePieces``, an ``InferResponseMessage``, a
  betterproto2 message, bytes) as the buffers that make up its encoding and their length.
- ``reply_encoding``: the algorithm a reply is compressed with: the request's when it was
  compressed and the client accepts it back, or any accepted one under ``compress_responses``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kserve_trio.core import compression
from kserve_trio.core.config import EdgeLimits
from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.infer_wire import (
    Buffer,
    InferRequestMessage,
    InferResponseMessage,
    WirePieces,
    parse_infer_request,
)
from kserve_trio.proto import inference as pb
from kserve_trio.serving.message_check import check_bounds, scan_bounds, wrong_field

if TYPE_CHECKING:
    from kserve_trio.serving.admission import InflightBytes


@dataclass(frozen=True)
class Limits:
    """Message caps for one server (decompressed sizes), ``compress_responses`` and the bounds
    of names and repeated fields (``edge``, the server's ``limits:``)."""

    max_recv_bytes: int
    max_send_bytes: int
    compress_responses: bool = False
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    inflight: InflightBytes | None = field(default=None, compare=False)
    """The process's request bytes in flight (``Admission.bytes``); None: not counted."""


@dataclass(frozen=True, slots=True)
class RawMessage:
    """One request message: ``data`` exactly as received (still compressed when
    ``compressed``)."""

    data: bytes
    compressed: bool = False


def parse_message(data: Buffer, message_type: Any, bounds: EdgeLimits | None = None) -> Any:
    """``data`` parsed as ``message_type`` (module docstring) under ``bounds`` (none: no name
    or repeated-field bounds); INVALID_ARGUMENT when it does not parse or is over a bound."""
    try:
        if message_type is pb.ModelInferRequest or message_type is InferRequestMessage:
            return parse_infer_request(data, bounds)
        if bounds is not None:
            scan_bounds(data, message_type, bounds)
        message = message_type.parse(bytes(data))
    except InvalidArgument:
        raise
    except Exception as exc:
        raise InvalidArgument(f"malformed request message: {exc}") from exc
    bad = wrong_field(message)
    if bad is not None:
        raise InvalidArgument(f"malformed request message: field '{bad}' has the wrong wire type")
    if bounds is not None:
        check_bounds(message, bounds)
    return message


def reply_pieces(reply: Any) -> tuple[list[Buffer], int]:
    """The buffers of ``reply``'s encoding and its length, nothing joined."""
    if reply.__class__ is bytes:
        return [reply], len(reply)
    if isinstance(reply, InferResponseMessage):
        reply = reply.pieces()
    if isinstance(reply, WirePieces):
        return reply.pieces, reply.nbytes
    data = bytes(reply)
    return [data], len(data)


def reply_encoding(request_encoding: str, accept_encoding: str | None, limits: Limits) -> str:
    """The algorithm a reply is sent with (module docstring)."""
    if request_encoding == compression.IDENTITY and not limits.compress_responses:
        return compression.IDENTITY
    accepted = compression.parse_accept_encoding(accept_encoding)
    return compression.reply_encoding(request_encoding, accepted, limits.compress_responses)


__all__ = [
    "Limits",
    "RawMessage",
    "parse_message",
    "reply_encoding",
    "reply_pieces",
]
