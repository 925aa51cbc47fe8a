"""An RPC's messages apart from any transport: bytes to a typed request, a reply to the buffers
of its encoding, an exception to the status that ends the call.

gRPC's calls (``serving.grpc``) and a worker's device process serving its front ends'
requests (``worker.forwarded`` over ``serving.ipc``) both go through these, so a message is
parsed under one set of checks, encoded one way and failed with one status whatever carried it.

- ``parse_message``: bytes to a typed message. ModelInfer requests go through our own wire
  parser (payloads stay views of the received bytes, repeated fields counted as they grow);
  every other message is scanned for its bounds on the wire (``message_check.scan_bounds``),
  decoded by betterproto2, then checked by ``message_check.wrong_field`` and ``check_bounds``,
  so a field sent with the wrong wire type, a malformed message or a name or repeated field
  over its bound is INVALID_ARGUMENT, refused before the work it would cost, and never a
  TypeError deep in a handler.
- ``reply_pieces``: whatever a handler returns (``WirePieces``, an ``InferResponseMessage``, a
  betterproto2 message, bytes) as the buffers that make up its encoding and their length.
- ``TypedRpc``: one typed unary RPC, its handler with its own ``parse`` and ``encode``.
- ``status_of``: the one mapping from exceptions to statuses. Our ``ServingError`` family
  carries its status (``serving.grpc.GrpcError`` among them: any status a handler chooses),
  ``TimeoutError`` is DEADLINE_EXCEEDED, an exception group holding one exception is that
  exception, and anything else is a bug: INTERNAL, logged once with its traceback as a field of
  the JSON event (never as plain text).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kserve_trio.core.errors import InvalidArgument, ServingError, StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol import (
    Buffer,
    InferRequestMessage,
    InferResponseMessage,
    WirePieces,
    parse_infer_request,
)
from kserve_trio.proto import inference as pb
from kserve_trio.serving.message_check import check_bounds, scan_bounds, wrong_field

log = get_logger("kserve_trio.serving.rpc_codec")

TypedUnaryFn = Callable[[Any], Awaitable[Any]]
"""A typed unary handler: the request message in, the reply message out."""


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


@dataclass(frozen=True, slots=True)
class TypedRpc:
    """One typed unary RPC: ``handler`` on the message ``parse`` reads, its reply as ``encode``
    writes it. gRPC's ``unary`` methods and the device process's forwarded requests serve it
    alike."""

    handler: TypedUnaryFn
    request_type: type

    def parse(self, data: Buffer, bounds: EdgeLimits | None) -> Any:
        """The request message (``parse_message``)."""
        return parse_message(data, self.request_type, bounds)

    @staticmethod
    def encode(reply: Any) -> list[Buffer]:
        """The reply's encoding, as buffers (``reply_pieces``)."""
        return reply_pieces(reply)[0]


def _single(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def status_of(exc: BaseException, *, rpc: str = "", request_id: str = "") -> tuple[StatusCode, str]:
    """``(status, message)`` for an exception that ends a call (see the module docstring)."""
    exc = _single(exc)
    if isinstance(exc, ServingError):
        return exc.status, exc.message
    if isinstance(exc, TimeoutError):
        return StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    log.error(
        "request_failed_unexpectedly", rpc=rpc, request_id=request_id, error=repr(exc), exc_info=exc
    )
    return StatusCode.INTERNAL, f"internal error: {exc!r}"


__all__ = ["TypedRpc", "TypedUnaryFn", "parse_message", "reply_pieces", "status_of"]
