"""The anyio byte-stream transport of a gRPC connection: how it runs on trio (TLS through
anyio's ``TLSStream``), and on any loop given a stream rather than a socket.

Two tasks beside the connection's own: the reader (bytes from the stream into
``ServerConnection.feed``, pausing while the connection says so) and the writer, the only task
that writes: the connection wakes it, and it writes everything ``data_to_send`` has in one
``send``, so replies finished in one loop turn share a write and a cancelled call can never
leave half a frame behind.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import anyio.abc

from kserve_trio.core.process import stream_attribute
from kserve_trio.serving.accept import Slot
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc._connection import OnClosed, ServerConnection
from kserve_trio.serving.grpc._methods import Method
from kserve_trio.serving.grpc._settings import ServerSettings

_RECEIVE_BYTES = 1 << 20
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class StreamTransport:
    """One connection's reader and writer on an anyio byte stream (module docstring)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.conn: ServerConnection | None = None
        self._want_write = False
        self._writer_wake: anyio.Event | None = None
        self._wrote: anyio.Event | None = None
        self._writing = 0  # bytes of the send in progress
        self._read_paused = False
        self._read_resumed: anyio.Event | None = None
        self._reading = anyio.CancelScope()

    async def read(self, conn: ServerConnection) -> None:
        """The reader: until the client leaves or the connection stops reading."""
        stream = self.stream
        with self._reading:
            try:
                while True:
                    while self._read_paused:
                        resumed = self._read_resumed = anyio.Event()
                        await resumed.wait()
                    data = await stream.receive(_RECEIVE_BYTES)
                    if not conn.feed(data):
                        return
            except _GONE:
                conn.lost()

    async def write(self, conn: ServerConnection) -> None:
        """The writer: what the connection queued, whenever it asks."""
        try:
            while True:
                if not self._want_write:
                    self._wake(self._wrote)
                    self._wrote = None
                    wake = self._writer_wake = anyio.Event()
                    await wake.wait()
                self._want_write = False
                data = conn.data_to_send()
                if data:
                    self._writing = len(data)
                    try:
                        await self.stream.send(data)
                    finally:
                        self._writing = 0
                    conn.writable()
        except _GONE:
            conn.lost()

    @staticmethod
    def _wake(event: anyio.Event | None) -> None:
        if event is not None:
            event.set()

    # ---- what the connection asks (``Transport``)

    def wake_writer(self) -> None:
        if not self._want_write:
            self._want_write = True
            wake = self._writer_wake
            if wake is not None:
                self._writer_wake = None
                wake.set()

    async def flush(self) -> None:
        self.wake_writer()
        while self._want_write or self._writing:
            event = self._wrote = self._wrote or anyio.Event()
            await event.wait()

    def pause_reading(self) -> None:
        self._read_paused = True

    def resume_reading(self) -> None:
        self._read_paused = False
        resumed = self._read_resumed
        if resumed is not None:
            self._read_resumed = None
            resumed.set()

    def buffered(self) -> int:
        return self._writing

    def stop(self) -> None:
        self._reading.cancel()

    async def linger(self) -> None:
        try:
            await self.stream.send_eof()
            while await self.stream.receive(_RECEIVE_BYTES):
                pass
        except (*_GONE, NotImplementedError):
            pass

    def peer(self) -> str:
        address = stream_attribute(self.stream, anyio.abc.SocketAttribute.remote_address, "")
        if isinstance(address, tuple):
            return f"{address[0]}:{address[1]}"
        return str(address)


async def serve_stream(
    stream: anyio.abc.ByteStream,
    methods: Mapping[str, Method],
    settings: ServerSettings,
    stats: EdgeStats,
    on_closed: OnClosed,
    started: OnClosed,
    slot: Slot | None = None,
) -> None:
    """Serve ``stream`` until its connection ends, then close it; ``slot``: its place under the
    port's cap (``serving.accept``)."""
    transport = StreamTransport(stream)
    conn = ServerConnection(methods, settings, transport, on_closed, stats, slot)
    started(conn)
    try:
        async with anyio.create_task_group() as tg:

            async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                await conn.run(task_status=task_status)
                tg.cancel_scope.cancel()  # the reader and the writer go with it

            conn.start()
            tg.start_soon(transport.write, conn)
            await tg.start(run)
            tg.start_soon(transport.read, conn)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()


__all__ = ["StreamTransport", "serve_stream"]
