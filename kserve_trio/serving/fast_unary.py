"""A lean server path for the unary calls that carry the load (ModelInfer), inside grpclib.

grpclib serves every call through ``request_handler``: a header map, a ``Stream`` object with
its send/receive state machine, a deadline ``Wrapper`` context, dispatch events, decoded
metadata, then headers, message and trailers sent by three awaited calls and three socket
writes. For a 16-float ModelInfer that machinery is about half of what the worker's gRPC stack
spends per request (docs/benchmarks.md, "Small requests against KServe"). A unary handler built
by ``grpc_adapter.unary(..., fast=True)`` carries a ``FastUnary``; when the fast path is on,
``grpc_server`` hands such a call's HTTP/2 stream to ``FastUnary.serve`` instead, which does the
same work in one coroutine on grpclib's protocol stream.

What a call keeps (each rule tested with tritonclient, tests/serving/test_fast_unary.py):

1. Only plain calls take it (``plain_call``, pure): ``POST``, ``content-type`` ``application/grpc``
   or ``application/grpc+proto``, ``te: trailers``, no ``grpc-encoding`` other than identity,
   and a server that does not compress every reply. Anything else goes through grpclib as
   before, so its statuses for odd headers and the compression rules stay where they are.
2. Framing and the receive cap are ``grpc_adapter.recv_message``'s (INVALID_ARGUMENT,
   RESOURCE_EXHAUSTED); the send cap is checked before anything is sent.
3. ``grpc-timeout``: the handler sees it as ``CallContext.deadline_ns``; at the deadline the
   call's task is cancelled and DEADLINE_EXCEEDED is answered, as grpclib's deadline wrapper
   does. RST_STREAM from the client cancels the task through grpclib's handler (``_tasks``),
   like any call; server close cancels it too.
4. Errors map through ``grpc_adapter.status_error``; the answer is trailers-only (or trailers
   after sent headers) with ``grpc-status`` and a percent-encoded ``grpc-message``, and the
   stream is reset when the client has not finished sending, as grpclib does.
5. A reply that fits the peer's window and frame size goes out as headers, one DATA frame and
   the OK trailers in one socket write; a larger one is framed within flow control from its
   own buffers (``grpc_adapter._send_segments``).
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, decode_metadata, encode_grpc_message

from kserve_trio.core.errors import ResourceExhausted
from kserve_trio.core.infer_wire import InferResponseMessage, WirePieces
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.grpc_adapter import (
    CallContext,
    _segments,
    _send_segments,
    recv_message,
    status_error,
)

log = get_logger("kserve_trio.serving.grpc")

Headers = Sequence[tuple[str, str]]

FAST_ENV = "KSERVE_TRIO_GRPC_FAST_UNARY"
"""``0`` turns the fast path off (every call through grpclib's own handler), for A/B runs."""

_JOIN_BYTES = 256 << 10
"""Up to this size a reply is one joined ``bytes`` (as ``grpc_adapter.send_reply`` does)."""


def fast_path_enabled(environ: dict[str, str] | None = None) -> bool:
    """The switch: on unless ``KSERVE_TRIO_GRPC_FAST_UNARY`` is 0/false/no/off."""
    env = os.environ if environ is None else environ
    return env.get(FAST_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def plain_call(headers: Headers) -> tuple[str, str] | None:
    """``(path, grpc-timeout or "")`` when the call may take the fast path (rule 1), else
    None. Pure: the request headers as h2 gave them."""
    method = path = content_type = te = ""
    timeout = ""
    for key, value in headers:
        if key[0] == ":":
            if key == ":method":
                method = value
            elif key == ":path":
                path = value
        elif key == "content-type":
            content_type = value
        elif key == "te":
            te = value
        elif key == "grpc-timeout":
            if timeout:  # several: grpclib takes the smallest; leave that to it
                return None
            timeout = value
        elif key == "grpc-encoding" and value != "identity":
            return None
    if method != "POST" or te != "trailers" or not path:
        return None
    if content_type not in ("application/grpc", "application/grpc+proto"):
        return None
    return path, timeout


class FastCall:
    """What ``grpc_adapter``'s receive helpers and a ``CallContext`` read of a call: the
    protocol stream (``_stream``, with ``request_headers``), the deadline and the metadata
    (decoded only when asked for)."""

    __slots__ = ("_metadata", "_stream", "deadline")

    def __init__(self, h2_stream: Any, deadline: Deadline | None) -> None:
        self._stream = h2_stream
        self.deadline = deadline
        self._metadata: Any = None

    @property
    def metadata(self) -> Any:
        if self._metadata is None:
            self._metadata = decode_metadata(self._stream.request_headers)
        return self._metadata


class FastUnary:
    """One unary RPC's fast path: ``fn(request, ctx) -> reply`` served on a protocol stream.
    ``FastUnary.calls`` counts the calls every instance has taken (tests and A/B runs read
    it to know which path served them)."""

    calls = 0

    def __init__(self, fn: Callable[[Any, Any], Awaitable[Any]], request_type, limits, rpc: str):
        self.fn = fn
        self.request_type = request_type
        self.limits = limits
        self.rpc = rpc

    async def serve(self, h2_stream: Any, timeout: str, release_stream: Callable[[], Any]) -> None:
        """Serve the call on ``h2_stream`` (rules 2-5), then release it."""
        FastUnary.calls += 1
        loop = asyncio.get_running_loop()
        expiry: asyncio.TimerHandle | None = None
        expired = False
        deadline: Deadline | None = None
        deadline_ns = 0
        headers_sent = False
        if timeout:
            deadline = Deadline.from_headers([("grpc-timeout", timeout)])
            assert deadline is not None
            remaining = deadline.time_remaining()
            deadline_ns = time.monotonic_ns() + max(0, int(remaining * 1e9)) or 1
            task = asyncio.current_task()
            assert task is not None

            def expire() -> None:
                nonlocal expired
                expired = True
                task.cancel()

            expiry = loop.call_later(remaining, expire)
        limits = self.limits
        try:
            call = FastCall(h2_stream, deadline)
            try:
                request, encoding = await recv_message(
                    call, self.request_type, limits.max_recv_bytes
                )
                reply = await self.fn(request, CallContext(call, deadline_ns, encoding))
                if expiry is not None:
                    expiry.cancel()
                headers_sent = await _send_reply(h2_stream, reply, limits.max_send_bytes)
            except asyncio.CancelledError:
                if not expired:
                    raise  # RST_STREAM or server close: nothing is answered
                await _send_error(
                    h2_stream, Status.DEADLINE_EXCEEDED, "Deadline exceeded", headers_sent
                )
            except GRPCError as exc:
                await _send_error(h2_stream, exc.status, exc.message, headers_sent)
            except Exception as exc:
                err = status_error(exc, rpc=self.rpc)
                await _send_error(h2_stream, err.status, err.message, headers_sent)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the connection went away while answering
            log.debug("fast_call_not_answered", rpc=self.rpc, error=repr(exc))
        finally:
            if expiry is not None:
                expiry.cancel()
            release_stream()


async def _send_reply(h2_stream: Any, message: Any, max_bytes: int) -> bool:
    """Send a unary reply and the OK trailers (rule 5). Returns whether headers went out (for
    an error answered after them)."""
    if isinstance(message, InferResponseMessage):
        message = message.pieces()
    if isinstance(message, WirePieces):
        pieces: list[Any] = message.pieces
        length = message.nbytes
    else:
        data = message.SerializeToString() if hasattr(message, "SerializeToString") else message
        data = bytes(data)
        pieces, length = [data], len(data)
    if length > max_bytes:
        raise ResourceExhausted(f"response larger than max ({length} vs. {max_bytes})")
    conn = h2_stream.connection
    h2_conn = h2_stream._h2_connection
    sid = h2_stream.id
    if sid not in h2_conn.streams:
        return False  # the client is gone; nothing to answer
    if length <= _JOIN_BYTES:
        payload = b"".join([struct.pack(">BI", 0, length), *pieces])
        if (
            len(payload) <= h2_conn.max_outbound_frame_size
            and len(payload) <= h2_conn.local_flow_control_window(sid)
            and conn.write_ready.is_set()
        ):
            h2_conn.send_headers(sid, _REPLY_HEADERS)
            h2_conn.send_data(sid, payload)
            h2_conn.send_headers(sid, _OK_TRAILERS, end_stream=True)
            h2_stream._transport.write(h2_conn.data_to_send())
            h2_stream.data_sent += len(payload)
            conn.data_sent += len(payload)
            conn.headers_send_process()
            conn.data_send_process()
            return True
        segments: list[Any] = [payload]
    else:
        segments = _segments([struct.pack(">BI", 0, length), *pieces])
    await h2_stream.send_headers(_REPLY_HEADERS)
    await _send_segments(h2_stream, segments)
    await h2_stream.send_headers(_OK_TRAILERS, end_stream=True)
    return True


_REPLY_HEADERS = [(":status", "200"), ("content-type", "application/grpc+proto")]
_OK_TRAILERS = [("grpc-status", "0")]


async def _send_error(h2_stream: Any, status: Status, message: str | None, after_headers: bool):
    """Answer ``status`` (rule 4): trailers-only, or trailers after sent headers; then reset
    the stream if the client is still sending."""
    headers: list[tuple[str, str]] = [] if after_headers else list(_REPLY_HEADERS)
    headers.append(("grpc-status", str(status.value)))
    if message is not None:
        headers.append(("grpc-message", encode_grpc_message(message)))
    try:
        await h2_stream.send_headers(headers, end_stream=True)
    except Exception as exc:  # the peer may already be gone
        log.debug("fast_error_not_sent", status=status.name, error=repr(exc))
        return
    if h2_stream.closable:
        h2_stream.reset_nowait()


__all__ = ["FAST_ENV", "FastCall", "FastUnary", "fast_path_enabled", "plain_call"]
