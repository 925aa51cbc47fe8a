"""``Channel``: batches of messages over one Unix stream socket, one frame per batch.

A frame is a 4-byte big-endian length and its messages' records (``_framing``: a compact
record for each message of a request and its answer, a pickle for the others).
``first_batch`` reads the first frame off the socket before any event loop runs (a front end's
``Hello`` says which loop to run). ``send`` only queues a message; the writer task writes
everything queued since its last write as one frame, so under load the channel costs one write
and one read per batch of requests (or replies), not per request, and a message queued while a
write is in progress joins the next frame. Both ends wait
on the socket (and the writer on an event) and nothing polls: an idle channel costs no CPU.

Pickle is safe here because both ends are our own processes of one user, joined by a socket
pair created before the front end was started; no other program can reach the socket, and
client bytes never reach ``pickle.loads`` (they travel as opaque ``bytes`` in the records). A
frame that does not parse (a defect of the sender) is logged and ends the channel, as if the
peer had closed it: each end already knows how to outlive the other.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator

import anyio
import anyio.abc

from kserve_trio.core.logging import get_logger
from kserve_trio.serving.ipc._framing import MalformedFrame, decode, encode
from kserve_trio.serving.ipc._messages import Message

log = get_logger("kserve_trio.serving.ipc")

_HEADER = struct.Struct(">I")
_READ_BYTES = 1 << 20


class ChannelClosed(Exception):
    """The other end is gone."""


class Channel:
    """One end of a device/front-end socket pair (module docstring)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._outbox: list[Message] = []
        self._wake = anyio.Event()
        self.frames_sent = 0
        self.messages_sent = 0

    def send(self, message: Message) -> None:
        """Queue ``message`` for the next frame (never blocks)."""
        self._outbox.append(message)
        if len(self._outbox) == 1:
            self._wake.set()

    async def run_writer(self) -> None:
        """Write the queued messages, a frame per batch, until cancelled or the peer is gone
        (then ``ChannelClosed``)."""
        stream = self._stream
        while True:
            while not self._outbox:
                self._wake = anyio.Event()
                await self._wake.wait()
            batch, self._outbox = self._outbox, []
            data = encode(batch)
            try:
                await stream.send(_HEADER.pack(len(data)) + data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise ChannelClosed(str(exc)) from None
            self.frames_sent += 1
            self.messages_sent += len(batch)

    async def batches(self) -> AsyncIterator[list[Message]]:
        """Every batch the peer sends, in order, until it closes its end or sends a frame that
        does not parse (logged)."""
        stream = self._stream
        buffer = bytearray()
        header = _HEADER.size
        while True:
            try:
                chunk = await stream.receive(_READ_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            except OSError:
                return
            buffer += chunk
            start = 0
            while len(buffer) - start >= header:
                (n,) = _HEADER.unpack_from(buffer, start)
                end = start + header + n
                if end > len(buffer):
                    break
                try:
                    batch = decode(memoryview(buffer)[start + header : end])
                except MalformedFrame as exc:
                    log.error("channel_frame_malformed", error=str(exc), frame_bytes=n)
                    return
                start = end
                yield batch
            if start:
                del buffer[:start]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


def first_batch(sock: socket.socket) -> list[Message]:
    """The first frame on a blocking ``sock``, read before any event loop runs;
    ``ChannelClosed`` when the peer closes first or the frame does not parse."""

    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ChannelClosed("the peer closed the channel before its first frame")
            data += chunk
        return bytes(data)

    (n,) = _HEADER.unpack(exactly(_HEADER.size))
    try:
        return decode(exactly(n))
    except MalformedFrame as exc:
        raise ChannelClosed(f"the peer's first frame does not parse: {exc}") from None


__all__ = ["Channel", "ChannelClosed", "first_batch"]
