"""The pure half of the client transport: one call's reply.

No I/O: ``_Call`` accumulates what arrives on one stream (headers, DATA, trailers, a reset) and
turns it into the reply message or the call's ``RpcError`` (``_Call.message``), reading the
server's side with the gRPC wire rules of ``core.protocol.grpc_wire``. The wording of every error is one
vocabulary, whichever server answered. ``h2_transport`` drives it.

A compressed reply (flag 1) is decompressed with the algorithm of the reply's
``grpc-encoding`` (``core.protocol.compression``): the receive cap applies to the length announced on
the wire and again to the decompressed size, so a decompression bomb is RESOURCE_EXHAUSTED; a
reply that does not decompress, or is flagged compressed without an algorithm, is INTERNAL.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import ServingError, StatusCode
from kserve_trio.core.protocol import (
    IDENTITY,
    PREFIX,
    decode_message,
    decompress,
    parse_encoding,
    status_from_http,
    status_from_reset,
)
from kserve_trio.http2 import code_name


class _Call:
    """One unary call: what was received on its stream, and how it ended.

    ``headers`` / ``data`` / ``ended`` / ``reset`` feed it the stream's events; ``message``
    returns the reply message or raises the call's ``RpcError``. Pure: no I/O.
    """

    __slots__ = (
        "cap",
        "chunks",
        "compressed",
        "done",
        "encoding",
        "error",
        "event",
        "http_status",
        "length",
        "local_closed",
        "message_text",
        "nbytes",
        "refused",
        "remote_closed",
        "reset_code",
        "rpc",
        "status",
        "stream_id",
    )

    def __init__(self, rpc: str, cap: int) -> None:
        self.rpc = rpc
        self.cap = cap
        self.stream_id = 0
        self.chunks: list[bytes | memoryview] = []
        self.nbytes = 0
        self.length = -1
        self.http_status = 0
        self.status: int | None = None
        self.message_text = ""
        self.reset_code: int | None = None
        self.error: RpcError | None = None
        self.refused = False  # the server provably did not process it: safe to retry
        self.compressed = False  # the reply message's flag byte
        self.encoding: str | None = None  # the reply's grpc-encoding header
        self.done = False
        self.event: anyio.Event | None = None
        # the stream, kept by the connection: which sides have ended it (END_STREAM or a reset)
        self.local_closed = False
        self.remote_closed = False

    def headers(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        for name, value in headers:
            if name == b"grpc-status":
                try:
                    self.status = int(value)
                except ValueError:
                    self.status = StatusCode.UNKNOWN
            elif name == b"grpc-message":
                self.message_text = decode_message(value)
            elif name == b"grpc-encoding":
                self.encoding = value.decode("ascii", "replace")
            elif name == b":status":
                try:
                    self.http_status = int(value)
                except ValueError:
                    self.http_status = -1

    def data(self, data: bytes | memoryview) -> bool:
        """Buffer a DATA payload; False once the reply is refused (announced over the cap, a
        second message), with ``error`` set: the caller then resets the stream."""
        if not data:
            return True
        self.chunks.append(data)
        self.nbytes += len(data)
        if self.length < 0 and self.nbytes >= 5:
            first = self.chunks[0]
            head = first if len(first) >= 5 else b"".join(self.chunks)
            flag, self.length = PREFIX.unpack_from(head)
            self.compressed = flag == 1
            if flag > 1:
                self.error = RpcError(
                    StatusCode.INTERNAL,
                    f"malformed reply: compressed flag {flag}",
                    method=self.rpc,
                )
                return False
            if self.length > self.cap:
                self.error = RpcError(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({self.length} vs. {self.cap})",
                    method=self.rpc,
                    retryable=False,
                )
                return False
        if self.length >= 0 and self.nbytes > 5 + self.length:
            self.error = RpcError(
                StatusCode.INTERNAL,
                "the server sent more than one reply message for a unary call",
                method=self.rpc,
            )
            return False
        return True

    def fail(self, error: RpcError, *, refused: bool = False) -> None:
        if not self.done:
            self.error = error
            self.refused = refused
            self.done = True

    def message(self, address: str) -> bytes | memoryview:
        """The reply message, or the call's error (see the module docstring for the mapping).
        A reply that arrived in one DATA frame is a view of the received bytes."""
        rpc = self.rpc
        if self.error is not None:
            raise self.error
        status = self.status
        if self.reset_code is not None and status is None:
            raise RpcError(
                status_from_reset(self.reset_code),
                f"stream reset by {address} ({code_name(self.reset_code)})",
                method=rpc,
            )
        if status is None:
            if self.http_status not in (0, 200):
                code = self.http_status
                raise RpcError(
                    status_from_http(code), f"HTTP status {code} from {address}", method=rpc
                )
            raise RpcError(
                StatusCode.UNKNOWN, f"the reply from {address} has no grpc-status", method=rpc
            )
        if status != 0:
            try:
                code = StatusCode(status)
            except ValueError:
                code = StatusCode.UNKNOWN
            raise RpcError(code, self.message_text, method=rpc)
        chunks = self.chunks
        if not chunks:
            raise RpcError(StatusCode.INTERNAL, "the server sent no reply message", method=rpc)
        if self.length < 0 or self.nbytes < 5 + self.length:
            have = max(self.nbytes - 5, 0)
            raise RpcError(
                StatusCode.UNAVAILABLE,
                f"truncated reply ({have} of {max(self.length, 0)} bytes)",
                method=rpc,
            )
        first = chunks[0]
        if len(chunks) == 1:
            body = first[5:]
        elif len(first) >= 5:
            chunks[0] = first[5:]
            body = b"".join(chunks)
        else:
            body = b"".join(chunks)[5:]
        return self._inflate(body) if self.compressed else body

    def _inflate(self, body: bytes | memoryview) -> bytes:
        """A compressed reply's message (see the module docstring for the statuses)."""
        rpc = self.rpc
        if (self.encoding or IDENTITY).strip().lower() == IDENTITY:
            raise RpcError(
                StatusCode.INTERNAL,
                "the reply is flagged compressed but names no grpc-encoding",
                method=rpc,
                retryable=False,
            )
        try:
            algorithm = parse_encoding(self.encoding)
            return bytes(decompress(body, algorithm, self.cap))
        except ServingError as exc:  # the server's reply: another attempt gets the same
            status = StatusCode.INTERNAL
            if exc.status in (StatusCode.RESOURCE_EXHAUSTED, StatusCode.UNIMPLEMENTED):
                status = exc.status
            raise RpcError(status, exc.message, method=rpc, retryable=False) from None


__all__: list[str] = []
