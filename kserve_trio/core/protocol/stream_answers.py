"""The answers of a ModelStreamInfer stream, written by whoever serves its messages: the
worker (in one process or in its device process) and the gateway.

A success is a ``ModelStreamInferResponse`` whose ``infer_response`` is the request's encoded
``ModelInferResponse``, embedded behind one tag and length without being decoded or copied; a
failure names why in ``error_message``, with the request's model and id.
"""

from __future__ import annotations

from kserve_trio.core.protocol.infer_wire import WirePieces
from kserve_trio.core.protocol.wire import encode_varint
from kserve_trio.proto import inference as pb

_INFER_RESPONSE_TAG = b"\x12"  # ModelStreamInferResponse.infer_response: field 2, bytes


def stream_reply(reply: WirePieces) -> WirePieces:
    """The answer around an encoded ``ModelInferResponse`` given as its pieces."""
    head = _INFER_RESPONSE_TAG + encode_varint(reply.nbytes)
    return WirePieces([head, *reply.pieces])


def stream_response(reply: bytes) -> bytes:
    """The answer around a ``ModelInferResponse``'s bytes (a worker's reply the gateway
    forwards as it is)."""
    return _INFER_RESPONSE_TAG + encode_varint(len(reply)) + reply


def stream_error(message: str, model: str = "", request_id: str = "") -> bytes:
    """The answer of a request that failed: why, and the request's model and id."""
    return bytes(
        pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(model_name=model, id=request_id),
        )
    )


__all__ = ["stream_error", "stream_reply", "stream_response"]
