"""Client side of the codec: ``ModelInferRequest`` messages from tensors, and the tensors of a
``ModelInferResponse``.

Requests are ``InferRequestMessage``s (``core.protocol.infer_wire``) whose payloads view the caller's
arrays; responses are read from an ``InferResponseMessage`` (or a betterproto2
``ModelInferResponse``: the readers only use the fields both have). Raw data is viewed in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol.bytes_tensor import encode_bytes_tensor
from kserve_trio.core.protocol.codec._params import (
    deadline_params,
    in_shared_memory,
    shm_params,
    shm_ref,
)
from kserve_trio.core.protocol.codec._tensors import (
    checked_array,
    checked_nbytes,
    from_buffer,
    from_typed,
    shape_str,
    wire_dtype,
)
from kserve_trio.core.protocol.codec._types import RequestedOutput, ShmRef
from kserve_trio.core.protocol.infer_wire import (
    InferInputTensor,
    InferRequestedOutput,
    InferRequestMessage,
)
from kserve_trio.core.protocol.wire import Params, byte_view, plain_params
from kserve_trio.core.tensors import NamedTensor


def requested_tensors(items: Sequence[str | RequestedOutput]) -> list[InferRequestedOutput]:
    """Requested output tensors by name, or by reference into shared memory."""
    msgs = []
    for item in items:
        req = RequestedOutput(item) if isinstance(item, str) else item
        params = shm_params(req.shm) if req.shm is not None else None
        msgs.append(InferRequestedOutput(req.name, params))
    return msgs


def _input(tensor: NamedTensor, params: Params | None = None) -> InferInputTensor:
    return InferInputTensor(tensor.name, tensor.dtype.wire, tensor.shape, params)


def request_params(budget_ns: int, parameters: Mapping[str, Any] | None) -> Params:
    """``parameters`` as plain values, with ``TIMEOUT_NS_PARAM`` set when ``budget_ns > 0``."""
    params = plain_params(parameters)
    params.update(deadline_params(budget_ns))
    return params


def encode_infer_request(
    model_name: str,
    inputs: Sequence[NamedTensor],
    *,
    requested_outputs: Sequence[str | RequestedOutput] = (),
    id: str = "",
    budget_ns: int = 0,
    parameters: Mapping[str, Any] | None = None,
) -> InferRequestMessage:
    """A ``ModelInferRequest`` with every input inline in ``raw_input_contents`` (any wire dtype,
    FP16/BF16 included), each a view of its array: keep the arrays unchanged until it is sent.
    ``budget_ns > 0`` adds ``TIMEOUT_NS_PARAM`` over ``parameters`` (plain values, or
    betterproto2 ``InferParameter``s)."""
    return InferRequestMessage(
        model_name=model_name,
        id=id,
        parameters=request_params(budget_ns, parameters),
        inputs=[_input(t) for t in inputs],
        outputs=requested_tensors(requested_outputs),
        raw_input_contents=[_payload(model_name, t) for t in inputs],
    )


def _payload(model_name: str, tensor: NamedTensor) -> bytes | memoryview:
    """An input's raw contents: a view of its array, or a ``BYTES`` input's encoding."""
    arr = checked_array(model_name, tensor, "input")
    return encode_bytes_tensor(arr) if tensor.dtype.is_bytes else byte_view(arr)


def encode_infer_request_shm(
    model_name: str,
    inputs: Sequence[NamedTensor],
    region: str,
    offsets: Sequence[int],
    *,
    requested_outputs: Sequence[str | RequestedOutput] = (),
    id: str = "",
    budget_ns: int = 0,
    parameters: Mapping[str, Any] | None = None,
) -> InferRequestMessage:
    """A ``ModelInferRequest`` whose inputs are all staged in ``region`` at ``offsets`` (one per
    input; the caller wrote the bytes there). No ``raw_input_contents``."""
    if len(offsets) != len(inputs):
        raise ValueError(f"{len(offsets)} offsets given for {len(inputs)} inputs")
    for t in inputs:
        if t.dtype.is_bytes:
            raise ValueError(f"input '{t.name}' is BYTES: send it inline, not in shared memory")
    return InferRequestMessage(
        model_name=model_name,
        id=id,
        parameters=request_params(budget_ns, parameters),
        inputs=[
            _input(t, shm_params(ShmRef(region, int(off), t.nbytes)))
            for t, off in zip(inputs, offsets, strict=True)
        ],
        outputs=requested_tensors(requested_outputs),
    )


def raw_output_indices(outputs: Sequence[Any], n_raw: int) -> list[int | None] | None:
    """For each output, the index of its ``raw_output_contents`` entry, or None when it has
    none (typed ``contents``, or no entries at all).

    Two layouts exist, told apart by the entry count:
    1. Positional (Triton's, and this server's): one entry per output without typed contents,
       in output order; an output written to shared memory has an empty placeholder entry,
       and its index points there. This is how tritonclient's ``as_numpy`` finds an output.
    2. Inline-only (servers before the positional layout): one entry per output with neither
       typed contents nor shared memory; an output in shared memory gets None.
    With no output in shared memory both are the same. ``n_raw == 0`` means no output carries
    raw data. Any other count matches neither layout: None. Callers check for shared memory
    before reading an entry, so the common positional case never looks at parameters.
    """
    counted = [o.contents is None for o in outputs]
    if n_raw != sum(counted):
        counted = [c and not in_shared_memory(o) for c, o in zip(counted, outputs, strict=True)]
        if n_raw == 0:
            nothing: list[int | None] = [None] * len(outputs)
            return nothing
        if n_raw != sum(counted):
            return None
    indices: list[int | None] = []
    position = 0
    for takes_raw in counted:
        indices.append(position if takes_raw else None)
        position += takes_raw
    return indices


def decode_infer_response(msg: Any, *, skip_shm: bool = False) -> list[NamedTensor]:
    """The outputs of a ``ModelInferResponse`` as ``NamedTensor`` (response order).

    Raw entries are matched to outputs by ``raw_output_indices`` (the positional layout, or the
    older inline-only one); outputs with typed ``contents`` are read from those. Raw data is
    viewed in place (``np.frombuffer``). An output written to shared memory raises
    ``InvalidArgument`` unless ``skip_shm`` is true, in which case it is left out (the caller
    reads it from its own memory).
    """
    model = msg.model_name
    raw = msg.raw_output_contents
    indices = raw_output_indices(msg.outputs, len(raw))
    if indices is None:
        untyped = [o for o in msg.outputs if o.contents is None]
        shm = sum(in_shared_memory(o) for o in untyped)
        raise InvalidArgument(
            f"response from model '{model}' has {len(raw)} raw_output_contents entries but "
            f"{len(untyped)} output(s) without typed contents ({shm} of them in shared memory)"
        )
    result: list[NamedTensor] = []
    for out, index in zip(msg.outputs, indices, strict=True):
        what = f"output '{out.name}' of model '{model}'"
        dtype = wire_dtype(what, out.datatype)
        shape = tuple(int(d) for d in out.shape)
        count, nbytes = checked_nbytes(what, shape, dtype)
        ref = shm_ref(what, out.parameters)
        if ref is not None:
            if skip_shm:
                continue
            raise InvalidArgument(
                f"{what} was written to shared memory region '{ref.region}'; read it from there"
            )
        if out.contents is not None:
            data = from_typed(what, out.contents, dtype, shape, count)
        else:
            buf = None if index is None else raw[index]
            if buf is None:
                raise InvalidArgument(
                    f"{what} has no data: no raw_output_contents entry or contents"
                )
            size = len(buf) if buf.__class__ is bytes else memoryview(buf).nbytes
            if size != nbytes and not dtype.is_bytes:
                raise InvalidArgument(
                    f"{what} has {size} bytes of raw data, expected {nbytes} "
                    f"(shape {shape_str(shape)} x {dtype.wire})"
                )
            data = from_buffer(buf, dtype, shape, what)
        result.append(NamedTensor(out.name, dtype, shape, data))
    return result
