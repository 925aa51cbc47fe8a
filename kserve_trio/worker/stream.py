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
from kserve_trio.core.infer_wire import WirePieces
from kserve_trio.core.wire import encode_varint
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import Call, RawMessage, StreamSession, parse_message, status_of
from kserve_trio.worker.dispatch import SHUTTING_DOWN

if TYPE_CHECKING:
    from kserve_trio.serving.admission import Admission
    from kserve_trio.worker.inference import InferenceCore, InferReply

RPC = "ModelStreamInfer"

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
            request = parse_message(call.plain(message), pb.ModelInferRequest, call.limits.edge)
        except ServingError as exc:
            return stream_error(exc.message), stream_error
        model, request_id = request.model_name, request.id

        def failed(why: str) -> bytes:
            return stream_error(why, model, request_id)

        try:
            reply = await self.core.infer(
                request,
                transport_deadline_ns=call.deadline_ns,
                admitted=self.admission is not None,
            )
        except ServingError as exc:
            return failed(exc.message or exc.status.name), failed
        except Exception as exc:  # TimeoutError, or a bug: the status_of wording
            return failed(status_of(exc, request_id=request_id, rpc=RPC)[1]), failed
        return stream_reply(reply), failed


__all__ = ["OpenStreams", "StreamInfer", "stream_error", "stream_reply"]
