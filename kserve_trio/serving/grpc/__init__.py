"""Our gRPC server: a sans-IO gRPC protocol core over an HTTP/2 engine, and two thin transports.

It serves every RPC of the worker, its front ends and the gateway, on asyncio (uvloop) and trio
alike, with every connection and call task inside the server's task group. HTTP/2 itself
(framing, flow control, stream states, HPACK) is the engine's (``kserve_trio.http2``: ngh2 by
default, h2 as the fallback, ``ServerSettings.http2_engine``); what is ours is the policy around
it: how calls are opened, read, answered, timed out, cancelled and drained.

- ``GrpcServer``: listeners, connections, the two-phase drain (``_server``).
- ``ServerConnection``: one connection's protocol core, no I/O (``_connection``); its
  transports: the event loop's own on asyncio (``_asyncio_transport``), an anyio byte stream
  on trio (``_stream_transport``). They are the only modules of the package that name an event
  loop or a socket.
- ``Call`` and its lifecycle (``_call``); the call tasks (``_runners``).
- ``Method`` and its builders ``unary``, ``raw_unary``, ``bytes_unary``, ``stream``,
  ``unimplemented`` (``_methods``).
- ``StreamSession``: the request/answer stream engine of ModelStreamInfer, shared by the
  worker and the gateway (``_stream_session``).
- ``Limits``, ``RawMessage`` (``_messages``); a message's parse and a reply's pieces are
  transport-neutral (``serving.rpc_codec``).
- ``GrpcError``: a status a handler chose (``_status``); ``rpc_codec.status_of`` is the one
  exception-to-status mapping.
- ``ServerSettings``, ``engine_settings`` and the HTTP/2 defaults (``_settings``).
- ``header_problem``: the request-header checks (``_headers``).
"""

from __future__ import annotations

from kserve_trio.serving.grpc._call import Call, CallClosed, CallState
from kserve_trio.serving.grpc._connection import ServerConnection, Transport
from kserve_trio.serving.grpc._headers import header_problem
from kserve_trio.serving.grpc._messages import Limits, RawMessage
from kserve_trio.serving.grpc._methods import (
    BytesUnaryFn,
    DeadlineUnaryFn,
    HeaderBytesUnaryFn,
    HeaderReader,
    HeaderUnaryFn,
    Method,
    RawStreamFn,
    RawUnaryFn,
    bytes_unary,
    bytes_unary_with_header,
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
    engine_settings,
)
from kserve_trio.serving.grpc._status import GrpcError
from kserve_trio.serving.grpc._stream_session import MAX_OUTSTANDING, StreamSession

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_OUTSTANDING",
    "WINDOW_BYTES",
    "BytesUnaryFn",
    "Call",
    "CallClosed",
    "CallState",
    "DeadlineUnaryFn",
    "GrpcError",
    "GrpcServer",
    "HeaderBytesUnaryFn",
    "HeaderReader",
    "HeaderUnaryFn",
    "Limits",
    "Method",
    "RawMessage",
    "RawStreamFn",
    "RawUnaryFn",
    "ServerConnection",
    "ServerSettings",
    "StreamSession",
    "Transport",
    "bytes_unary",
    "bytes_unary_with_header",
    "engine_settings",
    "header_problem",
    "raw_unary",
    "stream",
    "unary",
    "unimplemented",
]
