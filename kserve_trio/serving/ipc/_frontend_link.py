"""``FrontendLink``: the device process's side of one front end's channel, and ``RpcServer``,
the one thing it asks of the device process: serve this call.

Each ``Request`` becomes a task of the link's task group, in a cancel scope the front end's
``Cancel`` cancels; whatever ends it (a reply, a status, the cancel) is answered with one
``Done``, so the front end always learns when the request is over and may reuse its request
slot. A reply is written once into the reply arena (the front end copies it out and returns the
slot in a ``Free``), or travels in the frame when the arena has no room. ``ping`` is the
liveness probe the device process's watch sends (``serving.liveness``).

When the front end is gone (its end of the channel closes: it exited or was killed) the link's
task group is cancelled: its queued requests leave the scheduler's queues, those executing
finish on the device and their results are dropped; the arenas are unmapped once no request
views them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.abc

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.core.protocol import Buffer
from kserve_trio.serving.ipc._arena import Arena, Ring
from kserve_trio.serving.ipc._channel import Channel, ChannelClosed
from kserve_trio.serving.ipc._messages import (
    Call,
    Cancel,
    Detail,
    Done,
    Edge,
    Free,
    Payload,
    Ping,
    Pong,
    Ready,
    Request,
    Slot,
)
from kserve_trio.serving.rpc_codec import status_of

log = get_logger("kserve_trio.serving.ipc")

CANCELLED_TEXT = "cancelled by the client"


@dataclass(frozen=True, slots=True)
class Reply:
    """A served call's reply: the buffers of its encoding and what the call's class needs
    besides (``Done.detail``)."""

    pieces: Sequence[Buffer]
    detail: Detail = None


class RpcServer(Protocol):
    """What the device process serves its front ends' calls with."""

    async def serve(self, call: Call, data: Buffer, deadline_ns: int) -> Reply:
        """Serve ``call`` on ``data`` (its message, possibly a view of the request arena valid
        until this returns) before ``deadline_ns`` (``time.monotonic_ns()``; 0: none); raise
        what a server answers as a status (``rpc_codec.status_of``)."""
        ...


class FrontendLink:
    """One front end's requests, served in the device process (module docstring)."""

    def __init__(
        self, index: int, channel: Channel, requests: Arena, replies: Arena, server: RpcServer
    ) -> None:
        self.index = index
        self.channel = channel
        self._requests = requests
        self._replies = replies
        self._ring = Ring(replies.size)
        self._server = server
        self._calls: dict[int, anyio.CancelScope] = {}
        self.ready = anyio.Event()
        self.ports: tuple[int, int] = (0, 0)
        """The front end's gRPC and REST ports (``Ready``; REST 0: none)."""
        self.edge_exposition = ""
        """The front end's edge counters as it last sent them (Prometheus text)."""
        self.served = 0
        """Requests this front end forwarded (the ``worker_frontend_requests`` counter)."""
        self.inline_replies = 0
        """Replies that did not fit the reply arena and travelled in the frame."""
        self._pings = 0
        self._pongs = 0
        self._pong = anyio.Event()

    @property
    def in_flight(self) -> int:
        """Requests being served (answered ones are not)."""
        return len(self._calls)

    @property
    def reply_bytes_held(self) -> int:
        """Bytes of the reply arena the front end has not given back yet."""
        return self._ring.used

    async def serve(self) -> None:
        """Serve the front end's requests until its end of the channel closes."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write)
                await self._read(tg)
                tg.cancel_scope.cancel()
        finally:
            log.info(
                "frontend_link_closed",
                frontend_process=self.index,
                requests=self.served,
                frames_sent=self.channel.frames_sent,
                messages_sent=self.channel.messages_sent,
                inline_replies=self.inline_replies,
            )
            self._calls.clear()
            self._requests.close()
            self._replies.close()
            await self.channel.aclose()

    async def _write(self) -> None:
        try:
            await self.channel.run_writer()
        except ChannelClosed:
            pass  # the reader sees the end too

    async def _read(self, tg: anyio.abc.TaskGroup) -> None:
        calls = self._calls
        async for batch in self.channel.batches():
            for message in batch:
                match message:
                    case Request():
                        scope = anyio.CancelScope()
                        calls[message.id] = scope
                        self.served += 1
                        tg.start_soon(self._serve, message, scope)
                    case Free():
                        free = self._ring.free
                        for slot in message.slots:
                            free(slot)
                    case Cancel():
                        scope = calls.get(message.id)
                        if scope is not None:
                            scope.cancel()
                    case Edge():
                        self.edge_exposition = message.exposition
                    case Pong():
                        self._pongs = max(self._pongs, message.seq)
                        self._pong.set()
                    case Ready():
                        self.ports = (message.grpc_port, message.http_port)
                        self.ready.set()
                    case _:
                        log.warning(
                            "frontend_message_unexpected",
                            frontend_process=self.index,
                            message=type(message).__name__,
                        )

    async def ping(self) -> bool:
        """Send ``Ping`` and return once the front end has answered it (its reader runs on
        the event loop that serves its connections, so an answer says that loop turns)."""
        self._pings += 1
        seq = self._pings
        self.channel.send(Ping(seq))
        while self._pongs < seq:
            self._pong = anyio.Event()
            await self._pong.wait()
        return True

    async def _serve(self, request: Request, scope: anyio.CancelScope) -> None:
        status, text, pieces, detail = 0, "", (), None
        with scope:
            try:
                payload = request.payload
                data: Buffer | None = (
                    self._requests.view(payload.position, payload.nbytes)
                    if isinstance(payload, Slot)
                    else payload
                )
                reply = await self._server.serve(request.call, data, request.deadline_ns)
                pieces, detail = reply.pieces, reply.detail
            except Exception as exc:
                code, text = status_of(exc, rpc=request.call.rpc)
                status = int(code)
            finally:
                data = None  # the request arena's view goes before the slot is given back
        if scope.cancelled_caught:
            status, text, pieces, detail = int(StatusCode.CANCELLED), CANCELLED_TEXT, (), None
        del self._calls[request.id]
        self.channel.send(Done(request.id, status, text, self._place(pieces), detail))

    def _place(self, pieces: Sequence[Buffer]) -> Payload:
        """The reply in the reply arena (its slot), or as bytes when it has no room."""
        nbytes = sum(memoryview(p).nbytes for p in pieces)
        if not nbytes:
            return b""
        slot = self._ring.alloc(nbytes)
        if slot is None:
            self.inline_replies += 1
            return b"".join(pieces)
        self._replies.write(slot, pieces)
        return Slot(slot, nbytes)


__all__ = ["CANCELLED_TEXT", "FrontendLink", "Reply", "RpcServer"]
