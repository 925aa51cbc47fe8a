"""ModelStreamInfer on the worker: the shared stream engine over the inference core.

``serving.grpc.StreamSession`` owns the stream's rules (ordering, the bound on outstanding
requests, one writer, the ends, cancellation, drain). What the worker adds is how one message
is served (``StreamInfer._one``): it is a ModelInfer request served exactly as a unary call
serves it (``InferenceCore.infer``: lookup, decode, validation, the scheduler's queue, where it
coalesces with every other request, and the observer's bookkeeping), bounded by the stream's
own deadline. Its admission slot is the session's, taken before it is served: at
``endpoints.max_concurrent_requests`` the stream waits instead of failing. A success is a
``ModelStreamInferResponse`` carrying the request's ``ModelInferResponse`` (its pieces, not
copied); a failure (unknown model, bad input, a full queue, the deadline, a message that does
not decompress or parse) is an answer whose ``error_message`` says why, with the request's
model and id in ``infer_response`` when they could be read.

Shutdown: ``OpenStreams.close`` stops every stream's reading; the requests in flight are
answered (queued ones UNAVAILABLE ``server is shutting down``), then the call ends UNAVAILABLE.
The worker's drain waits for open streams as it waits for unary requests (``OpenStreams.count``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from kserve_trio.core.errors import ServingError
from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol import WirePieces, stream_error, stream_reply
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import Call, RawMessage, StreamSession
from kserve_trio.serving.rpc_codec import parse_message, status_of
from kserve_trio.serving.trace_settings import caller_context
from kserve_trio.worker.admission import SHUTTING_DOWN

if TYPE_CHECKING:
    from kserve_trio.serving.admission import Admission
    from kserve_trio.worker.inference import InferenceCore

RPC = "ModelStreamInfer"


class OpenStreams:
    """The worker's open ModelStreamInfer calls: how many there are (the drain waits for them)
    and the signal that stops their reading at shutdown. Lives on the event loop thread."""

    def __init__(self) -> None:
        self.count = 0
        self.closing = False
        self._closing_event: anyio.Event | None = None

    def close(self) -> None:
        """Shutdown has begun: every open stream stops reading."""
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


class StreamInfer:
    """The ModelStreamInfer handler (a ``serving.grpc.stream`` function)."""

    def __init__(
        self, core: InferenceCore, streams: OpenStreams, admission: Admission | None = None
    ) -> None:
        self.core = core
        self.streams = streams
        self.admission = admission
        """The worker's admission: the session takes each message's slot (waiting at the cap)."""

    async def __call__(self, call: Call) -> None:
        streams = self.streams
        streams.count += 1
        try:
            session = StreamSession(
                call,
                self._one,
                closing=streams.wait_closing,
                shutting_down=SHUTTING_DOWN,
                admission=self.admission,
            )
            await session.run()
        finally:
            streams.count -= 1

    async def _one(
        self, call: Call, message: RawMessage
    ) -> tuple[WirePieces | bytes, Callable[[str], bytes]]:
        try:
            data = call.plain(message)
        except ServingError as exc:
            return stream_error(exc.message), stream_error
        answer, model, request_id = await self.serve_message(
            data,
            call.deadline_ns,
            call.limits.edge,
            admitted=self.admission is not None,
            trace_context=caller_context(call.header) if self.core.traced else None,
        )
        return answer, lambda why: stream_error(why, model, request_id)

    async def serve_message(
        self,
        data,
        deadline_ns: int,
        bounds: EdgeLimits | None,
        *,
        admitted: bool,
        trace_context: str | None = None,
    ) -> tuple[WirePieces | bytes, str, str]:
        """One message of a stream (its plain bytes) served: the answer, and the request's
        model and id (for an error answer written later, one over the send cap). The front
        ends of a worker in several processes have their streams' messages served here too.
        With tracing on each message is a ``ModelStreamInfer`` span of its own, continuing
        the stream's ``trace_context`` (the headers that opened it)."""
        try:
            request = parse_message(data, pb.ModelInferRequest, bounds)
        except ServingError as exc:
            return stream_error(exc.message), "", ""
        model, request_id = request.model_name, request.id
        try:
            reply = await self.core.infer(
                request,
                transport_deadline_ns=deadline_ns,
                admitted=admitted,
                trace_context=trace_context,
                rpc=RPC,
            )
        except ServingError as exc:
            return (
                stream_error(exc.message or exc.status.name, model, request_id),
                model,
                request_id,
            )
        except Exception as exc:  # TimeoutError, or a bug: the status_of wording
            why = status_of(exc, request_id=request_id, rpc=RPC)[1]
            return stream_error(why, model, request_id), model, request_id
        return stream_reply(reply), model, request_id


__all__ = ["OpenStreams", "StreamInfer", "stream_error", "stream_reply"]
