"""Our gRPC server: gRPC over HTTP/2 on the ``h2`` library's sans-IO connection and anyio streams.

It serves every RPC of the worker and the gateway, on asyncio (uvloop) and trio alike, with
every connection and call task inside the server's task group. HTTP/2 itself (framing, flow
control, stream states, HPACK) stays h2's; what is ours is the policy around it: how calls are
opened, read, answered, timed out, cancelled and drained.

- ``GrpcServer``: listeners, connections, the two-phase drain (``_server``).
- ``Method`` and its builders ``unary``, ``raw_unary``, ``bytes_unary``, ``stream``,
  ``unimplemented``
  (``_methods``).
- ``StreamSession``: the request/answer stream engine of ModelStreamInfer, shared by the
  worker and the gateway (``_stream_session``).
- ``Call``: one call's receive and send paths (``_call``).
- ``Limits``, ``RawMessage``, ``parse_message``, ``reply_pieces`` (``_messages``).
- ``GrpcError`` and ``status_of``: the one exception-to-status mapping (``_status``).
- ``ServerSettings`` and the HTTP/2 defaults (``_settings``).
- ``header_problem``: the request-header checks (``_headers``).
"""

from __future__ import annotations

from kserve_trio.serving.grpc._call import Call, CallClosed
from kserve_trio.serving.grpc._frames import patch_frame_repr
from kserve_trio.serving.grpc._headers import header_problem
from kserve_trio.serving.grpc._messages import Limits, RawMessage, parse_message, reply_pieces
from kserve_trio.serving.grpc._methods import (
    BytesUnaryFn,
    DeadlineUnaryFn,
    Method,
    RawStreamFn,
    RawUnaryFn,
    TypedUnaryFn,
    bytes_unary,
    raw_unary,
    stream,
    unary,
    unimplemented,
)
from kserve_trio.serving.grpc._server import GrpcServer
from kserve_trio.serving.grpc._settings import (
    MAX_FRAME_BYTES,
    WINDOW_BYTES,
    ServerSettings,
)
from kserve_trio.serving.grpc._status import GrpcError, status_of
from kserve_trio.serving.grpc._stream_session import MAX_OUTSTANDING, StreamSession

patch_frame_repr()

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_OUTSTANDING",
    "WINDOW_BYTES",
    "BytesUnaryFn",
    "Call",
    "CallClosed",
    "DeadlineUnaryFn",
    "GrpcError",
    "GrpcServer",
    "Limits",
    "Method",
    "RawMessage",
    "RawStreamFn",
    "RawUnaryFn",
    "ServerSettings",
    "StreamSession",
    "TypedUnaryFn",
    "bytes_unary",
    "header_problem",
    "parse_message",
    "raw_unary",
    "reply_pieces",
    "status_of",
    "stream",
    "unary",
    "unimplemented",
]
