"""``FrontendLink``: the device process's side of one front end's channel.

Each ``REQUEST`` becomes a task of the link's task group, in a cancel scope the front end's
``CANCEL`` cancels; whatever ends it (a reply, a status, the cancel) is answered with one
``DONE``, so the front end always learns when the request is over and may reuse its request
slot. A reply is written once into the reply arena (the front end copies it out and returns the
slot in a ``FREE``), or travels in the frame when the arena has no room. ``ping`` is the
liveness probe the device process's watch sends (``serving.liveness``).

When the front end is gone (its end of the channel closes: it exited or was killed) the link's
task group is cancelled: its queued requests leave the scheduler's queues, those executing
finish on the device and their results are dropped; the arenas are unmapped once no request
views them.
"""

from __future__ import annotations

from typing import Any

import anyio

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.grpc import status_of
from kserve_trio.serving.ipc import (
    CANCEL,
    DONE,
    EDGE,
    FREE,
    PING,
    PONG,
    READY,
    REQUEST,
    Arena,
    Channel,
    ChannelClosed,
    Ring,
)
from kserve_trio.worker.forwarded import ForwardedRpcs

log = get_logger("kserve_trio.worker.frontends")


class FrontendLink:
    """One front end's requests, served in the device process (module docstring)."""

    def __init__(
        self,
        index: int,
        channel: Channel,
        requests: Arena,
        replies: Arena,
        rpcs: ForwardedRpcs,
    ) -> None:
        self.index = index
        self.channel = channel
        self._requests = requests
        self._replies = replies
        self._ring = Ring(replies.size)
        self._rpcs = rpcs
        self._calls: dict[int, anyio.CancelScope] = {}
        self.ready = anyio.Event()
        self.ports: tuple[int, int] = (0, 0)
        self.edge_exposition = ""
        """The front end's edge counters as it last sent them (Prometheus text)."""
        self.served = 0
        """Requests this front end forwarded (the ``worker_frontend_requests`` counter)."""
        self._pings = 0
        self._pongs = 0
        self._pong = anyio.Event()

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
                op = message[0]
                if op == REQUEST:
                    scope = anyio.CancelScope()
                    calls[message[1]] = scope
                    self.served += 1
                    tg.start_soon(self._serve, message, scope)
                elif op == CANCEL:
                    scope = calls.get(message[1])
                    if scope is not None:
                        scope.cancel()
                elif op == FREE:
                    free = self._ring.free
                    for slot in message[1]:
                        free(slot)
                elif op == EDGE:
                    self.edge_exposition = message[1]
                elif op == PONG:
                    self._pongs = max(self._pongs, message[1])
                    self._pong.set()
                elif op == READY:
                    self.ports = (message[1], message[2])
                    self.ready.set()

    async def ping(self) -> bool:
        """Send ``PING`` and return once the front end has answered it (its reader runs on
        the event loop that serves its connections, so an answer says that loop turns)."""
        self._pings += 1
        seq = self._pings
        self.channel.send((PING, seq))
        while self._pongs < seq:
            self._pong = anyio.Event()
            await self._pong.wait()
        return True

    async def _serve(self, message: tuple, scope: anyio.CancelScope) -> None:
        _, rid, kind, rpc, deadline_ns, payload = message
        status, text, pieces, extra = 0, "", (), None
        with scope:
            try:
                data: Any = self._requests.view(*payload) if isinstance(payload, tuple) else payload
                pieces, extra = await self._rpcs.serve(kind, rpc, data, deadline_ns)
            except Exception as exc:
                code, text = status_of(exc, rpc=rpc if isinstance(rpc, str) else "REST")
                status = int(code)
            finally:
                data = None
        if scope.cancelled_caught:
            status, text, pieces = int(StatusCode.CANCELLED), "cancelled by the client", ()
        del self._calls[rid]
        self.channel.send((DONE, rid, status, text, self._place(pieces), extra))

    def _place(self, pieces) -> Any:
        """The reply in the reply arena (its slot), or as bytes when it has no room."""
        nbytes = sum(memoryview(p).nbytes for p in pieces)
        if not nbytes:
            return b""
        slot = self._ring.alloc(nbytes)
        if slot is None:
            return b"".join(pieces)
        self._replies.write(slot, pieces)
        return (slot, nbytes)


__all__ = ["FrontendLink"]
