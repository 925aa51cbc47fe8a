"""One request/answer stream (ModelStreamInfer): the engine the worker and the gateway share.

A ``StreamSession`` reads the client's messages, serves each one concurrently with the
server's ``serve_one`` function and writes the answers back on the same call. The two servers
differ only in what ``serve_one`` does (the worker runs the inference core, the gateway forwards
to a worker); the ordering, bounds and lifetime rules are these, for both:

1. *Bounded reading*: messages are read in order; each becomes a task of the session's task group,
   so requests on one stream run concurrently and nothing outlives the call. At most
   ``max_outstanding`` requests of a stream are read and not yet answered: past that the session
   stops reading until an answer is written, and HTTP/2 flow control holds the client back
   (backpressure, never an error).
2. *Process bounds*: the process's bounds hold a stream back the same way, never fail it: each
   message takes a slot of the server's ``admission`` before it is served
   (``Admission.wait_inference``: at the concurrency cap the reading waits, and its requests count
   against the cap like unary ones, so the outstanding bound sits inside the cap), and a message's
   bytes wait for room in the process's bytes in flight (``Call.receive(wait=True)``). Both are
   given back when its request has been served (``Call.done_with``), before its answer is written.
3. *One writer*: answers are written in completion order by one writer task from a memory object
   stream, so the frames of two answers never interleave. ``serve_one(call, message)`` turns every
   failure of its own request into an answer (the stream stays open) and returns it with a function
   that makes that request's error answer from a message: an answer over the send cap is replaced by
   the error answer saying so.
4. *The client's end*: at the end of the client's half the answers in flight are written, then the
   call ends OK. A framing error (a message cut short, a bad prefix, an announced length over the
   cap) stops the reading the same way and ends the call with its status once the answers are
   written.
5. *Cancellation*: the client's cancellation (RST_STREAM, a lost connection, the call's deadline)
   cancels the session's task group: every request still being served is cancelled with it.
6. *Drain*: once ``closing()`` returns, the session stops reading, writes the answers in flight
   and ends the call UNAVAILABLE with ``shutting_down`` as the message.
7. *Failed write*: a write that fails (the client is gone) cancels the whole session.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kserve_trio.core.errors import ResourceExhausted, ServingError, StatusCode, Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.admission import Admission
from kserve_trio.serving.grpc._call import Call
from kserve_trio.serving.grpc._messages import RawMessage
from kserve_trio.serving.rpc_codec import status_of

log = get_logger("kserve_trio.serving.grpc")

MAX_OUTSTANDING = 128
"""Requests of one stream read and not yet answered (*bounded reading*)."""

Answer = Any
"""What ``serve_one`` returns and the writer sends: bytes, ``WirePieces`` or a message."""


class StreamSession:
    """One stream's reader, request tasks and writer (module docstring)."""

    def __init__(
        self,
        call: Call,
        serve_one: Callable[[Call, RawMessage], Awaitable[tuple[Answer, Callable[[str], Answer]]]],
        *,
        closing: Callable[[], Awaitable[None]],
        shutting_down: str,
        max_outstanding: int = MAX_OUTSTANDING,
        admission: Admission | None = None,
    ) -> None:
        self.call = call
        self.serve_one = serve_one
        self.closing = closing
        self.shutting_down = shutting_down
        self.max_outstanding = max_outstanding
        self.admission = admission
        self.slots = anyio.Semaphore(max_outstanding)
        self.framing_error: ServingError | None = None
        self.drained = False
        self.broken = False

    async def run(self) -> None:
        """Serve the stream to its end and end the call (*one writer*, *the client's end*, *drain*
        and *failed write*)."""
        send, receive = anyio.create_memory_object_stream[tuple[Answer, Callable[[str], Answer]]](
            self.max_outstanding
        )
        reading = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write, receive, tg.cancel_scope)
            watcher = anyio.CancelScope()
            tg.start_soon(self._stop_reading_on_close, reading, watcher)
            with send:
                with reading:
                    await self._read(send, tg)
            watcher.cancel()
        call = self.call
        if self.broken:
            return  # the client is gone: nothing more can be written
        if self.framing_error is not None:
            status, message = status_of(self.framing_error, rpc=call.rpc)
            call.finish(status, message)
        elif self.drained:
            call.finish(StatusCode.UNAVAILABLE, self.shutting_down)
        else:
            call.finish(StatusCode.OK)

    async def _stop_reading_on_close(
        self, reading: anyio.CancelScope, watcher: anyio.CancelScope
    ) -> None:
        with watcher:
            await self.closing()
            self.drained = True
            reading.cancel()

    async def _read(
        self,
        send: MemoryObjectSendStream[tuple[Answer, Callable[[str], Answer]]],
        tg: anyio.abc.TaskGroup,
    ) -> None:
        call, admission = self.call, self.admission
        while True:
            await self.slots.acquire()  # released by the writer once the answer is out
            try:
                message = await call.receive(wait=True)
            except ServingError as exc:
                self.slots.release()
                self.framing_error = exc
                return
            if message is None:
                self.slots.release()
                return
            if admission is not None:
                try:
                    await admission.wait_inference()  # *process bounds*: backpressure at the cap
                except Unavailable:  # *drain*
                    call.done_with(message)
                    self.slots.release()
                    self.drained = True
                    return
            tg.start_soon(self._one, message, send.clone())

    async def _one(
        self,
        message: RawMessage,
        send: MemoryObjectSendStream[tuple[Answer, Callable[[str], Answer]]],
    ) -> None:
        with send:
            try:
                answer = await self.serve_one(self.call, message)
            finally:
                self.call.done_with(message)
                if self.admission is not None:
                    self.admission.release_inference()
            await send.send(answer)

    async def _write(
        self,
        answers: MemoryObjectReceiveStream[tuple[Answer, Callable[[str], Answer]]],
        scope: anyio.CancelScope,
    ) -> None:
        call = self.call
        with answers:
            async for answer, too_large in answers:
                try:
                    try:
                        await call.send(answer, encoding=call.reply_encoding())
                    except ResourceExhausted as exc:  # over the send cap: nothing was sent
                        await call.send(too_large(exc.message))
                except Exception as exc:
                    log.debug("stream_write_failed", rpc=call.rpc, error=repr(exc))
                    self.broken = True
                    scope.cancel()  # the stream is gone: stop reading, drop the requests
                    return
                finally:
                    self.slots.release()


__all__ = ["MAX_OUTSTANDING", "StreamSession"]
