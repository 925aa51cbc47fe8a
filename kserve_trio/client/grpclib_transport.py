"""The grpclib transport: unary KServe V2 calls on asyncio (the one asyncio-specific module).

``GrpclibTransport`` owns one ``grpclib.client.Channel`` (one HTTP/2 connection, reconnected on
demand after a loss) bound to the event loop it was first used on. Each call is hand-written over
``channel.request`` so that:

1. the request is serialized once, here, and checked against the send cap before anything is
   sent (grpclib has no cap of its own);
2. the reply's 5-byte length prefix is checked against the receive cap before the payload is
   buffered;
3. every failure becomes an ``RpcError``: the server's status as is, a connect failure or a lost
   connection UNAVAILABLE, grpclib's deadline DEADLINE_EXCEEDED.

grpclib enforces deadlines and connection loss by calling ``task.cancel()`` on the waiting task
and turning the ``CancelledError`` into its own exception. The task's cancel request count is
restored afterwards so that anyio cancel scopes further up keep working.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Mapping
from typing import Any, TypeVar

import grpclib.client
import grpclib.config
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from kserve_trio.client.errors import RpcError
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode

R = TypeVar("R")

FLOW_CONTROL_WINDOW = 64 << 20
"""HTTP/2 connection and stream windows (grpclib's 4 MiB default throttles large tensors)."""


class _Raw(bytes):
    """Pre-serialized message bytes; grpclib's proto codec passes them through unchanged."""

    def SerializeToString(self) -> bytes:
        return self

    @classmethod
    def FromString(cls, data: bytes) -> _Raw:
        return cls(data)


def _rpc_name(method: str) -> str:
    return method.rsplit("/", 1)[-1]


async def _recv_capped(stream: grpclib.client.Stream, cap: int, rpc: str) -> bytes:
    """The one reply message of a unary call, refusing one longer than ``cap`` unread."""
    await stream.recv_initial_metadata()
    with stream._wrapper:
        h2_stream = stream._stream
        meta = await h2_stream.recv_data(5)
        if not meta:
            await stream.recv_trailing_metadata()  # raises the server's error status, if any
            raise RpcError(StatusCode.INTERNAL, "the server sent no reply message", method=rpc)
        compressed, length = struct.unpack(">?I", meta)
        if compressed:
            raise RpcError(
                StatusCode.UNIMPLEMENTED, "compressed replies are not supported", method=rpc
            )
        if length > cap:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"received message larger than max ({length} vs. {cap})",
                method=rpc,
                retryable=False,
            )
        data = await h2_stream.recv_data(length) if length else b""
    if len(data) != length:
        raise RpcError(
            StatusCode.UNAVAILABLE, f"truncated reply ({len(data)} of {length} bytes)", method=rpc
        )
    return data


class GrpclibTransport:
    """A ``Transport`` over one grpclib channel (asyncio only)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._channel: grpclib.client.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None

    def _get_channel(self) -> grpclib.client.Channel:
        if self._channel is None:
            loop = asyncio.get_running_loop()
            config = grpclib.config.Configuration(
                http2_connection_window_size=FLOW_CONTROL_WINDOW,
                http2_stream_window_size=FLOW_CONTROL_WINDOW,
            )
            self._channel = grpclib.client.Channel(
                self.endpoint.host,
                self.endpoint.port,
                ssl=self.endpoint.ssl_context or (True if self.endpoint.secure else None),
                config=config,
            )
            self._loop = loop
            self._thread = threading.get_ident()
        elif self._loop is not asyncio.get_running_loop():
            raise RuntimeError(
                f"transport to {self.endpoint.address} belongs to another event loop"
            )
        return self._channel

    async def unary(
        self,
        method: str,
        request: Any,
        reply_type: type[R],
        *,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> R:
        """One unary call; see ``Transport.unary`` for the error contract."""
        rpc = _rpc_name(method)
        address = self.endpoint.address
        payload = bytes(request)
        cap = self.endpoint.max_send_message_length
        if len(payload) > cap:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"sent message larger than max ({len(payload)} vs. {cap})",
                method=rpc,
                retryable=False,
            )
        if timeout is not None and timeout <= 0:
            raise RpcError(
                StatusCode.DEADLINE_EXCEEDED,
                f"deadline exceeded before {rpc} was sent to {address}",
                method=rpc,
            )
        channel = self._get_channel()
        task = asyncio.current_task()
        baseline = task.cancelling() if task is not None else 0
        try:
            async with channel.request(
                method,
                Cardinality.UNARY_UNARY,
                _Raw,
                _Raw,
                timeout=timeout,
                metadata=dict(metadata) if metadata else None,
            ) as stream:
                await stream.send_message(_Raw(payload), end=True)
                data = await _recv_capped(stream, self.endpoint.max_receive_message_length, rpc)
        except GRPCError as exc:
            raise RpcError(StatusCode(exc.status.value), exc.message or "", method=rpc) from None
        except TimeoutError:
            _restore_cancel_count(task, baseline)
            raise RpcError(
                StatusCode.DEADLINE_EXCEEDED,
                f"deadline of {timeout:.3f}s exceeded calling {rpc} on {address}",
                method=rpc,
            ) from None
        except StreamTerminatedError as exc:
            _restore_cancel_count(task, baseline)
            raise RpcError(
                StatusCode.UNAVAILABLE, f"connection to {address} lost: {exc}", method=rpc
            ) from None
        except (OSError, ProtocolError) as exc:
            raise RpcError(
                StatusCode.UNAVAILABLE, f"cannot reach {address}: {exc}", method=rpc
            ) from None
        try:
            return reply_type.FromString(data)  # type: ignore[attr-defined]
        except Exception as exc:
            raise RpcError(
                StatusCode.INTERNAL, f"cannot parse the {rpc} reply: {exc}", method=rpc
            ) from None

    async def aclose(self) -> None:
        """Close the connection (from the loop that owns it)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Close from any thread: directly on the owning loop's thread, else scheduled on that
        loop; a loop that is already closed took the connection with it."""
        channel, self._channel = self._channel, None
        loop = self._loop
        if channel is None or loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._thread:
            channel.close()
            return
        try:
            loop.call_soon_threadsafe(channel.close)
        except RuntimeError:
            pass  # the loop closed meanwhile

    def __repr__(self) -> str:
        return f"GrpclibTransport({self.endpoint.address})"


def _restore_cancel_count(task: asyncio.Task | None, baseline: int) -> None:
    """Undo the ``task.cancel()`` grpclib used to interrupt the call (see module docstring)."""
    if task is None:
        return
    while task.cancelling() > baseline:
        task.uncancel()


__all__ = ["FLOW_CONTROL_WINDOW", "GrpclibTransport"]
