"""The HTTP/2 transport: unary gRPC calls over one HTTP/2 connection on anyio streams (asyncio
or trio).

``H2Transport`` implements the client's ``Transport`` protocol on an HTTP/2 engine
(``kserve_trio.http2``: ``ngh2`` by default, ``h2`` the fallback; ``Endpoint.http2_engine``)
over ``anyio.connect_tcp`` (plus anyio's TLS stream with ALPN ``h2`` for ``grpcs://``), so it
runs wherever anyio runs. One connection per transport, opened on the first call and reopened
after a loss; the connection itself (who reads the socket, one flusher at a time) is
``_h2_connection``'s, the gRPC wire rules ``core.protocol.grpc_wire``'s. A ModelInfer request is sent as
its wire pieces (``core.protocol.infer_wire``), its tensors' buffers not joined into a copy, and its
reply is parsed from a view of the received bytes.

Wire behaviour (gRPC over HTTP/2): HEADERS with ``:method POST``, ``:scheme``, ``:path``,
``:authority``, ``content-type: application/grpc``, ``te: trailers``, ``grpc-timeout`` from the
deadline and the caller's metadata; then the 5-byte-prefixed message in DATA frames within the
peer's flow-control windows. We advertise 64 MiB windows and 1 MiB frames. The reply's
``grpc-status`` / percent-decoded ``grpc-message`` become an ``RpcError`` with the server's codes
and wording; message caps are checked before sending and when the
reply's length prefix arrives; a cancelled or timed-out call resets its stream (RST_STREAM
CANCEL). A stream the server provably did not process (GOAWAY with a lower last stream id,
RST_STREAM REFUSED_STREAM) is retried once on a fresh connection.

Compression (``Endpoint.compression``, ``gzip`` or ``deflate``): every request message is sent
compressed (flag 1, ``grpc-encoding``), and ``grpc-accept-encoding: identity,deflate,gzip`` tells
the server it may compress its replies, which are decompressed within the receive cap. Without
it nothing is advertised, so servers answer uncompressed (the gateway's calls to its workers
stay plain). Message caps apply to the uncompressed message.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.streams.tls

from kserve_trio.client._h2_call import _Call
from kserve_trio.client._h2_connection import (
    CONNECTION_ERRORS,
    MAX_FRAME_BYTES,
    WINDOW_BYTES,
    Buffer,
    Connection,
    describe,
)
from kserve_trio.client.endpoint import Endpoint
from kserve_trio.client.errors import RpcError
from kserve_trio.client.tls import client_ssl_context, handshake_error_message
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol import (
    ACCEPT_ENCODING,
    InferRequestMessage,
    InferResponseMessage,
    WirePieces,
    compress,
    format_timeout,
    infer_request_pieces,
    metadata_headers,
)
from kserve_trio.http2 import Header, check_engine

R = TypeVar("R")

CLOSE_SECONDS = 1.0
USER_AGENT = b"kserve_trio-h2/1"


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------------------------
# The transport


def _message_pieces(request: Any) -> tuple[Sequence[Buffer], int]:
    """A request message as the buffers to send and their total size: a ModelInfer message
    as its encoded pieces (its tensors' own buffers, not joined), a buffer as it is, anything
    else as ``bytes(request)``."""
    if type(request) is bytes:
        return [request], len(request)
    if type(request) is InferRequestMessage:
        wire = infer_request_pieces(request)
        return wire.pieces, wire.nbytes
    if type(request) is WirePieces:
        return request.pieces, request.nbytes
    if isinstance(request, (bytearray, memoryview)):
        view = memoryview(request).cast("B")
        return [view], view.nbytes
    data = bytes(request)
    return [data], len(data)


_NOT_SET: Any = object()
_DEADLINE_TIE_SECONDS = 0.01
"""A server's DEADLINE_EXCEEDED this close to our own deadline is our deadline (a tie)."""


class H2Transport:
    """A ``Transport`` over one HTTP/2 connection on anyio streams (asyncio or trio).

    Bound to the event loop of its first call. ``async with H2Transport(endpoint) as t`` closes
    it on exit; otherwise ``aclose()`` (from its loop) or ``close()`` (from any thread).
    ``server_hostname`` is the name the server's TLS certificate is checked against and the
    ``:authority`` sent, when it differs from the host connected to (the gateway connects to a
    worker's resolved address but verifies the name it was configured with).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._hostname = server_hostname or endpoint.host
        context = ssl_context or endpoint.ssl_context
        if context is None and endpoint.secure:
            context = client_ssl_context()
        self._ssl = context
        self._conn: Connection | None = None
        self._connecting: anyio.Lock | None = None
        self._address = endpoint.address
        scheme = b"https" if context is not None else b"http"
        self._base = [
            (b":method", b"POST"),
            (b":scheme", scheme),
            (b":path", b""),
            (b":authority", _authority(self._hostname, endpoint.port).encode("idna")),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"user-agent", USER_AGENT),
        ]
        self._compression = endpoint.compression
        if self._compression:
            self._base.append((b"grpc-accept-encoding", ACCEPT_ENCODING.encode()))
        self._engine = check_engine(endpoint.http2_engine)
        self._fixed: dict[str, list[Header]] = {}  # each method's fixed headers

    def __repr__(self) -> str:
        return f"H2Transport({self._address})"

    async def __aenter__(self) -> H2Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- connections -------------------------------------------------------------------------

    async def _connection(self, rpc: str) -> Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            if conn.calls or conn.reading:
                return conn
            if conn.peek_idle():
                await conn.catch_up(CLOSE_SECONDS)  # what the server sent while nobody read
            if conn.usable:
                return conn
        if self._connecting is None:
            self._connecting = anyio.Lock()
        async with self._connecting:
            conn = self._conn
            if conn is not None and conn.usable:
                return conn
            # A dead connection is closed even with calls on it (they have failed already): a
            # peer that stalls or goes silent would otherwise leave one socket per reconnect.
            # A draining one with calls is left to its last call, which closes it.
            if conn is not None and (conn.dead is not None or not conn.calls):
                with anyio.move_on_after(CLOSE_SECONDS):
                    await conn.aclose()
            self._conn = conn = await self._connect(rpc)
            return conn

    async def _connect(self, rpc: str) -> Connection:
        host, port, address = self.endpoint.host, self.endpoint.port, self._address
        try:
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(host, port)
        except OSError as exc:
            raise RpcError(
                StatusCode.UNAVAILABLE, f"cannot reach {address}: {describe(exc)}", method=rpc
            ) from None
        try:
            if self._ssl is not None:
                try:
                    stream = await anyio.streams.tls.TLSStream.wrap(
                        stream,
                        hostname=self._hostname,
                        ssl_context=self._ssl,
                        standard_compatible=False,
                    )
                except CONNECTION_ERRORS as exc:
                    raise RpcError(
                        StatusCode.UNAVAILABLE, handshake_error_message(address, exc), method=rpc
                    ) from None
                alpn = stream.extra(anyio.streams.tls.TLSAttribute.alpn_protocol, None)
                if alpn not in (None, "h2"):
                    raise RpcError(
                        StatusCode.UNAVAILABLE,
                        f"{address} negotiated {alpn!r} instead of HTTP/2 (ALPN h2)",
                        method=rpc,
                    )
            conn = Connection(stream, address, self._engine)
            await conn.start()
        except BaseException:  # cancellation included: the socket is not left to the GC
            await anyio.aclose_forcefully(stream)
            raise
        return conn

    # -- calls -------------------------------------------------------------------------------

    def _request_headers(
        self,
        method: str,
        timeout: float | None,
        metadata: Mapping[str, Any] | None,
        encoding: str | None,
    ) -> list[Header]:
        """The call's request headers: the method's fixed ones (built once), then
        ``grpc-timeout``, ``grpc-encoding`` and the caller's metadata."""
        fixed = self._fixed.get(method)
        if fixed is None:
            fixed = list(self._base)
            fixed[2] = (b":path", method.encode("ascii"))
            self._fixed[method] = fixed
        if timeout is None and not encoding and not metadata:
            return fixed
        headers = list(fixed)
        if timeout is not None:
            headers.append((b"grpc-timeout", format_timeout(timeout).encode("ascii")))
        if encoding:
            headers.append((b"grpc-encoding", encoding.encode()))
        if metadata:
            headers += metadata_headers(metadata)
        return headers

    def _deadline_error(self, rpc: str, timeout: float) -> RpcError:
        """The client's own DEADLINE_EXCEEDED; built only when a call ran out of time (an
        exception with its message costs about as much as the rest of a small call's set-up)."""
        return RpcError(
            StatusCode.DEADLINE_EXCEEDED,
            f"deadline of {timeout:.3f}s exceeded calling {rpc} on {self._address}",
            method=rpc,
        )

    async def unary(
        self,
        method: str,
        request: Any,
        reply_type: type[R],
        *,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
        compressed_with: str | None = None,
    ) -> R:
        """One unary call; see ``Transport.unary`` for the error contract.

        ``compressed_with`` names the ``grpc-encoding`` ``request`` is already compressed with
        (a proxy forwarding a compressed message as it received it): the message goes out
        flagged compressed, with that header. Otherwise, with the endpoint's ``compression``,
        the message is compressed here."""
        rpc = method[method.rfind("/") + 1 :]
        pieces, nbytes = _message_pieces(request)
        cap = self.endpoint.max_send_message_length
        if nbytes > cap:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"sent message larger than max ({nbytes} vs. {cap})",
                method=rpc,
                retryable=False,
            )
        if not compressed_with and self._compression:
            joined = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces = [compress(memoryview(joined), self._compression)]
            nbytes = len(pieces[0])
            compressed_with = self._compression
        flag = 1 if compressed_with else 0
        if timeout is None:
            headers = self._request_headers(method, None, metadata, compressed_with)
            data = await self._call(rpc, headers, pieces, nbytes, flag)
        else:
            if not timeout > 0:
                raise RpcError(
                    StatusCode.DEADLINE_EXCEEDED,
                    f"deadline exceeded before {rpc} was sent to {self._address}",
                    method=rpc,
                )
            headers = self._request_headers(method, timeout, metadata, compressed_with)
            data = _NOT_SET
            deadline = anyio.current_time() + timeout
            with anyio.CancelScope(deadline=deadline):
                try:
                    data = await self._call(rpc, headers, pieces, nbytes, flag)
                except RpcError as exc:
                    # The server holds the same deadline (grpc-timeout) and may answer first:
                    # a tie is our own deadline, told in our own words. (The slack covers the
                    # header's rounding; an earlier DEADLINE_EXCEEDED is the server's own.)
                    tie = anyio.current_time() >= deadline - _DEADLINE_TIE_SECONDS
                    if exc.status is StatusCode.DEADLINE_EXCEEDED and tie:
                        raise self._deadline_error(rpc, timeout) from None
                    raise
            if data is _NOT_SET:
                raise self._deadline_error(rpc, timeout)
        if reply_type is not InferResponseMessage and type(data) is not bytes:
            data = bytes(data)  # only the ModelInfer reply is parsed from a view
        try:
            return reply_type.FromString(data)  # type: ignore[attr-defined]
        except Exception as exc:
            raise RpcError(
                StatusCode.INTERNAL, f"cannot parse the {rpc} reply: {exc}", method=rpc
            ) from None

    async def _call(
        self, rpc: str, headers: list[Header], pieces: Sequence[Buffer], nbytes: int, flag: int = 0
    ) -> bytes | memoryview:
        cap = self.endpoint.max_receive_message_length
        for attempt in range(2):
            conn = await self._connection(rpc)
            call = _Call(rpc, cap)
            await conn.request(call, headers, pieces, nbytes, flag)
            if call.refused and attempt == 0:
                continue  # the server did not process it: once more, on a fresh connection
            return call.message(self._address)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection (from the loop that owns it); calls in flight fail UNAVAILABLE.
        The transport stays usable: a later call reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with anyio.move_on_after(CLOSE_SECONDS, shield=True):
                await conn.aclose()

    def close(self) -> None:
        """Close from any thread, best effort: the socket is shut down and the owning loop
        sees the end of the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


__all__ = ["MAX_FRAME_BYTES", "WINDOW_BYTES", "H2Transport"]
