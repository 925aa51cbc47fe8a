"""Server side of the codec: the ``ModelInferResponse`` of a request's outputs, encoded.

``encode_infer_response`` goes straight from the model's ``NamedTensor`` outputs to
``WirePieces`` (``core.protocol.infer_wire``): the small fields are encoded once, each inline payload
stays the output array's own buffer, and nothing is built only to be taken apart again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol.codec._params import SHM_BYTE_SIZE_PARAM, shm_params
from kserve_trio.core.protocol.codec._tensors import checked_array, encoded_bytes, payload
from kserve_trio.core.protocol.codec._types import RequestedOutput, ShmRef, ShmRegistryLike
from kserve_trio.core.protocol.infer_wire import (
    InferOutputTensor,
    WirePieces,
    infer_response_pieces,
)
from kserve_trio.core.protocol.request_bounds import shown
from kserve_trio.core.protocol.wire import byte_view
from kserve_trio.core.tensors import NamedTensor


def no_such_output(model_name: str, name: str, outputs: Iterable[str]) -> InvalidArgument:
    """The one error for a requested output the model does not have, whoever finds it (the
    worker before any device work, the response encoder for any other caller):
    ``model 'm' has no output 'x' (outputs: a, b)``."""
    return InvalidArgument(
        f"model '{model_name}' has no output {shown(name)} (outputs: {', '.join(sorted(outputs))})"
    )


def encode_infer_response(
    model_name: str,
    request_id: str,
    outputs: Sequence[NamedTensor],
    requested: Sequence[RequestedOutput] | None = None,
    registry: ShmRegistryLike | None = None,
    *,
    model_version: str = "",
    zero_copy: bool = False,
) -> WirePieces:
    """The encoded ``ModelInferResponse`` for ``outputs`` (model order).

    ``zero_copy=True``: each inline payload is a view of its output array (the arrays must stay
    unchanged until the pieces are sent); otherwise a ``bytes`` copy of its own (none for an
    array that already views a whole ``bytes`` object, such as an echoed input).

    Rules:
    1. *Every output by default*: ``requested`` empty or None: every output, in model order, inline.
    2. *Requested outputs*: otherwise exactly the requested outputs in request order; a name the
       model does not produce raises ``no_such_output`` before anything is written.
    3. *Shared-memory outputs*: an output requested into shared memory must fit its ``byte_size``
       (else ``InvalidArgument`` naming both numbers); it is written through ``registry.write`` and
       its response tensor carries the three shm parameters with ``shared_memory_byte_size`` = the
       bytes actually written.
    4. *Raw contents by position*: ``raw_output_contents`` has one entry per output, in response
       order (Triton's layout, which tritonclient reads by position): the payload of an inline
       output, an empty entry for an output written to shared memory.
    5. *BYTES payloads*: a ``BYTES`` output's payload is its length-prefixed encoding
       (``core.protocol.bytes_tensor``), inline or in shared memory alike; an element that is neither
       ``bytes`` nor ``str`` is ``Internal`` (the model's bug).
    """
    tensors, raw = response_outputs(model_name, outputs, requested, registry, zero_copy=zero_copy)
    return infer_response_pieces(model_name, model_version, request_id, None, tensors, raw)


def response_outputs(
    model_name: str,
    outputs: Sequence[NamedTensor],
    requested: Sequence[RequestedOutput] | None = None,
    registry: ShmRegistryLike | None = None,
    *,
    zero_copy: bool = False,
) -> tuple[list[InferOutputTensor], list[bytes | memoryview]]:
    """The rules of ``encode_infer_response`` (*every output by default* to *BYTES payloads*)
    without the encoding: the response's output tensors and their payloads (an empty one for an
    output written to shared memory). Every response encoder (the gRPC message, the REST JSON and
    binary body) starts here."""
    if requested:
        by_name = {t.name: t for t in outputs}
        chosen: list[tuple[NamedTensor, ShmRef | None]] = []
        for req in requested:
            tensor = by_name.get(req.name)
            if tensor is None:
                raise no_such_output(model_name, req.name, by_name)
            chosen.append((tensor, req.shm))
    else:
        chosen = [(t, None) for t in outputs]

    prepared = []
    for tensor, shm in chosen:
        arr = checked_array(model_name, tensor)
        if tensor.dtype.is_bytes:  # variable-length elements: their encoding is the payload
            arr = np.frombuffer(encoded_bytes(model_name, tensor, arr), np.uint8)
        if shm is not None:
            what = f"output '{tensor.name}' of model '{model_name}'"
            if arr.nbytes > shm.byte_size:
                raise InvalidArgument(
                    f"{what} is {arr.nbytes} bytes, larger than the requested "
                    f"{SHM_BYTE_SIZE_PARAM} {shm.byte_size}"
                )
            if registry is None:
                raise InvalidArgument(
                    f"{what} was requested into shared memory region '{shm.region}' but this "
                    "endpoint has no shared memory registry"
                )
        prepared.append((tensor, arr, shm))

    tensors: list[InferOutputTensor] = []
    raw: list[bytes | memoryview] = []
    for tensor, arr, shm in prepared:
        params = None
        if shm is None:
            raw.append(byte_view(arr) if zero_copy else payload(arr))
        else:
            assert registry is not None
            registry.write(shm.region, shm.offset, np.ascontiguousarray(arr))
            params = shm_params(ShmRef(shm.region, shm.offset, arr.nbytes))
            raw.append(b"")
        tensors.append(InferOutputTensor(tensor.name, tensor.dtype.wire, tensor.shape, params))
    return tensors, raw
