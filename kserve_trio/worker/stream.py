"""ModelStreamInfer on the worker: a thin stream adapter over the inference core.

Each message of the client's stream is a ModelInfer request served exactly as a unary call
serves it (``InferenceCore.infer``: admission against ``endpoints.max_concurrent_requests``,
lookup, decode, validation, the scheduler's queue, where it coalesces with every other request,
and the observer's bookkeeping). The stream only adds the ordering and lifetime rules:

1. Messages are read in order; each becomes a task of the call's own task group, so requests on
   one stream run concurrently and nothing outlives the call. At most ``MAX_OUTSTANDING``
   requests of a stream are read and not yet answered: past that the worker stops reading the
   stream until an answer is written, and HTTP/2 flow control holds the client back.
2. Answers are ``ModelStreamInferResponse`` messages in completion order, written by one writer
   task from a memory object stream, so the frames of two answers never interleave. A success
   carries the request's ``ModelInferResponse`` (its model and id). A failing request (unknown
   model, bad input, over the concurrency cap, queue full, deadline, a reply over
   ``grpc.max_send_msg_bytes``) is an answer whose ``error_message`` says why, with the
   request's model and id in ``infer_response``; the stream stays open. So is a message that
   does not decompress or parse (with empty model and id: they could not be read).
3. The end of the client's half: the answers in flight are written, then the call ends OK.
   A framing error (a message cut short, a bad prefix, an announced length over the cap) stops
   the reading the same way and ends the call with its status once the answers are written.
4. Client cancellation (RST_STREAM, a lost connection, the call's deadline) cancels the call's
   task group: every request of the stream still queued is taken off the queue and never runs
   (one already executing finishes on the device and its result is dropped).
5. Shutdown: ``OpenStreams.close`` stops every stream's reading; the requests in flight are
   answered (queued ones UNAVAILABLE ``server is shutting down``), then the call ends
   UNAVAILABLE ``server is shutting down``. The worker's drain waits for open streams as it
   waits for unary requests (``OpenStreams.count``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kserve_trio.core.errors import ResourceExhausted, ServingError, Unavailable
from kserve_trio.core.infer_wire import WirePieces
from kserve_trio.core.logging import get_logger
from kserve_trio.core.wire import encode_varint
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import MessageError, StreamCall, status_of

if TYPE_CHECKING:
    from kserve_trio.core.infer_wire import InferRequestMessage
    from kserve_trio.worker.inference import InferenceCore, InferReply

log = get_logger("kserve_trio.worker.stream")

RPC = "ModelStreamInfer"
SHUTTING_DOWN = "server is shutting down"
MAX_OUTSTANDING = 128
"""Requests of one stream read and not yet answered (rule 1)."""

_INFER_RESPONSE_TAG = b"\x12"  # ModelStreamInferResponse.infer_response: field 2, bytes


def stream_reply(reply: InferReply) -> WirePieces:
    """A ``ModelStreamInferResponse`` around an encoded ``ModelInferResponse``: its pieces
    behind one tag and length, nothing copied."""
    head = _INFER_RESPONSE_TAG + encode_varint(reply.nbytes)
    return WirePieces([head, *reply.pieces])


def stream_error(message: str, model: str = "", request_id: str = "") -> bytes:
    """The answer of a request that failed: why, and the request's model and id."""
    return bytes(
        pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(model_name=model, id=request_id),
        )
    )


class OpenStreams:
    """The worker's open ModelStreamInfer calls: how many there are (the drain waits for them)
    and the signal that stops their reading at shutdown. Lives on the event loop thread."""

    def __init__(self) -> None:
        self.count = 0
        self.closing = False
        self._closing_event: anyio.Event | None = None

    def close(self) -> None:
        """Shutdown has begun: every open stream stops reading (rule 5)."""
        self.closing = True
        if self._closing_event is not None:
            self._closing_event.set()

    async def wait_closing(self) -> None:
        """Return once ``close`` has been called."""
        if self.closing:
            return
        if self._closing_event is None:
            self._closing_event = anyio.Event()  # made on the loop, where it is waited for
        await self._closing_event.wait()


@dataclass(slots=True)
class _Answer:
    """One answer on its way to the writer: the request's model and id, and either its reply
    or its error message."""

    model: str
    request_id: str
    reply: InferReply | None = None
    error: str = ""

    def encoded(self) -> WirePieces | bytes:
        if self.reply is not None:
            return stream_reply(self.reply)
        return stream_error(self.error, self.model, self.request_id)


class StreamInfer:
    """The ModelStreamInfer handler (a ``serving.grpc.typed_stream`` function)."""

    def __init__(self, core: InferenceCore, streams: OpenStreams) -> None:
        self.core = core
        self.streams = streams

    async def __call__(self, call: StreamCall) -> None:
        streams = self.streams
        streams.count += 1
        try:
            session = _Session(self.core, call)
            await session.run(streams)
            if session.broken:
                return  # the client is gone: nothing more can be written
            if session.framing_error is not None:
                await call.end(session.framing_error)
            elif session.drained:
                await call.end(Unavailable(SHUTTING_DOWN))
            else:
                await call.end()
        finally:
            streams.count -= 1


class _Session:
    """One stream's reader, request tasks and writer (the module docstring's rules)."""

    def __init__(self, core: InferenceCore, call: StreamCall) -> None:
        self.core = core
        self.call = call
        self.slots = anyio.Semaphore(MAX_OUTSTANDING)
        self.framing_error: ServingError | None = None
        self.drained = False
        self.broken = False

    async def run(self, streams: OpenStreams) -> None:
        send, receive = anyio.create_memory_object_stream[_Answer](MAX_OUTSTANDING)
        reading = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write, receive, tg.cancel_scope)
            watcher = anyio.CancelScope()
            tg.start_soon(self._stop_reading_on_close, streams, reading, watcher)
            with send:
                with reading:
                    await self._read(send, tg)
            watcher.cancel()

    async def _stop_reading_on_close(
        self, streams: OpenStreams, reading: anyio.CancelScope, watcher: anyio.CancelScope
    ) -> None:
        with watcher:
            await streams.wait_closing()
            self.drained = True
            reading.cancel()

    async def _read(self, send: MemoryObjectSendStream[_Answer], tg: anyio.abc.TaskGroup) -> None:
        call = self.call
        while True:
            await self.slots.acquire()  # released by the writer once the answer is out
            try:
                request = await call.receive()
            except MessageError as exc:
                await send.send(_Answer("", "", error=exc.error.message))
                continue
            except ServingError as exc:
                self.slots.release()
                self.framing_error = exc
                return
            if request is None:
                self.slots.release()
                return
            tg.start_soon(self._one, request, send.clone())

    async def _one(
        self, request: InferRequestMessage, send: MemoryObjectSendStream[_Answer]
    ) -> None:
        with send:
            answer = _Answer(request.model_name, request.id)
            try:
                answer.reply = await self.core.infer(
                    request, transport_deadline_ns=self.call.deadline_ns
                )
            except ServingError as exc:
                answer.error = exc.message or exc.status.name
            except Exception as exc:  # TimeoutError, or a bug: the status_error wording
                answer.error = status_of(exc, request_id=request.id, rpc=RPC)[1]
            await send.send(answer)

    async def _write(
        self, answers: MemoryObjectReceiveStream[_Answer], scope: anyio.CancelScope
    ) -> None:
        call = self.call
        with answers:
            async for answer in answers:
                try:
                    try:
                        await call.send(answer.encoded())
                    except ResourceExhausted as exc:  # over the send cap: nothing was sent
                        await call.send(stream_error(exc.message, answer.model, answer.request_id))
                except Exception as exc:
                    log.debug("stream_write_failed", rpc=RPC, error=repr(exc))
                    self.broken = True
                    scope.cancel()  # the stream is gone: stop reading, drop the requests
                    return
                finally:
                    self.slots.release()


__all__ = [
    "MAX_OUTSTANDING",
    "OpenStreams",
    "StreamInfer",
    "stream_error",
    "stream_reply",
]
