"""ModelStreamInfer through the gateway: each message of the client's stream routed like a
unary ModelInfer, each answer written back on the stream.

Rules (``StreamInfer.__call__``, one call per client stream):
1. Messages are read from the client's stream in order; each becomes a task of the handler's
   own task group, so requests on one stream run concurrently, across workers, and nothing
   outlives the stream: when the client cancels, every task (and its worker call) is
   cancelled with it.
2. A message is admitted like a unary request (it counts against the inbound cap while it is
   in flight), peeked, and forwarded with a unary ModelInfer to a worker, exactly as
   ``Forwarder.infer`` forwards a unary call (same routing, failover, deadlines: the stream's
   own deadline bounds each message).
3. A worker's reply goes back as a ``ModelStreamInferResponse`` whose ``infer_response`` is the
   worker's ``ModelInferResponse`` bytes, unchanged (so it carries its request's id). A failing
   request (malformed, shed, unknown model, a worker's error) goes back as a response whose
   ``error_message`` is the error's message, with the request's model and id in
   ``infer_response``, and the stream stays open. Answers are written in completion order.
4. When the client ends its side, the stream ends OK once every answer is written. When the
   gateway drains, it stops reading, writes the answers in flight and ends the stream
   UNAVAILABLE (``gateway is shutting down``). A framing error ends the stream with its status.
"""

from __future__ import annotations

import anyio

from kserve_trio.core.errors import ServingError, Unavailable
from kserve_trio.core.wire import encode_varint
from kserve_trio.gateway.admission import SHUTTING_DOWN, Admission
from kserve_trio.gateway.forward import Forwarder
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import Call, RawMessage

_INFER_RESPONSE_TAG = b"\x12"  # ModelStreamInferResponse.infer_response: field 2, bytes


def stream_response(reply: bytes) -> bytes:
    """A ``ModelStreamInferResponse`` around a worker's ``ModelInferResponse`` bytes, which are
    embedded as they are (never decoded)."""
    return _INFER_RESPONSE_TAG + encode_varint(len(reply)) + reply


def stream_error(message: str, model: str = "", request_id: str = "") -> bytes:
    """The response of a request that failed: its error message, and its model and id."""
    return bytes(
        pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(model_name=model, id=request_id),
        )
    )


class StreamInfer:
    """The ModelStreamInfer handler (a ``serving.grpc.stream`` function); see the module
    docstring."""

    rpc = "ModelStreamInfer"

    def __init__(self, forwarder: Forwarder, admission: Admission) -> None:
        self.forwarder = forwarder
        self.admission = admission

    async def __call__(self, call: Call) -> None:
        reading = anyio.CancelScope()
        watching = anyio.CancelScope()

        async def stop_reading_on_drain() -> None:
            with watching:
                await self.admission.drain_started.wait()
                reading.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_reading_on_drain)
            with reading:
                while (message := await call.receive()) is not None:
                    tg.start_soon(self._one, call, message)
            watching.cancel()
        if reading.cancel_called:
            raise Unavailable(SHUTTING_DOWN)

    async def _one(self, call: Call, message: RawMessage) -> None:
        model = request_id = ""
        forwarder = self.forwarder
        try:
            self.admission.admit_inference()
        except ServingError as exc:
            await call.send(stream_error(exc.message, *self._ids(call, message)))
            return
        try:
            started = anyio.current_time()
            try:
                plain = call.plain(message)
                head = forwarder.peek(plain)
            except ServingError as exc:
                if forwarder.metrics is not None:
                    elapsed = anyio.current_time() - started
                    forwarder.metrics.observe_request(self.rpc, "", exc.status, elapsed)
                raise
            model, request_id = head.model_name, head.id
            reply = await forwarder.infer(
                message.data,
                plain=plain,
                compressed_with=call.encoding if message.compressed else None,
                head=head,
                deadline=call.deadline,
                rpc=self.rpc,
            )
            await call.send(stream_response(reply))
        except ServingError as exc:
            await call.send(stream_error(exc.message or exc.status.name, model, request_id))
        finally:
            self.admission.release_inference()

    def _ids(self, call: Call, message: RawMessage) -> tuple[str, str]:
        """Model and id of a request that was not admitted (best effort: malformed -> "")."""
        try:
            head = self.forwarder.peek(call.plain(message))
        except ServingError:
            return "", ""
        return head.model_name, head.id


__all__ = ["StreamInfer", "stream_error", "stream_response"]
