"""Server side of the codec: a parsed ``ModelInferRequest`` decoded into an ``InferRequest``,
the scheduler's transport-agnostic unit of work (zero-copy views of the body or of shared
memory)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol.codec._params import (
    SHM_BYTE_SIZE_PARAM,
    deadline_from_parameters,
    shm_ref,
)
from kserve_trio.core.protocol.codec._tensors import (
    checked_nbytes,
    from_buffer,
    from_typed,
    shape_str,
    wire_dtype,
)
from kserve_trio.core.protocol.codec._types import RequestedOutput, ShmRef, ShmRegistryLike
from kserve_trio.core.protocol.infer_wire import InferRequestMessage
from kserve_trio.core.protocol.request_bounds import require_model_name
from kserve_trio.core.protocol.wire import Params, plain_params
from kserve_trio.core.tensors import DType, NamedTensor
from kserve_trio.proto import inference as pb

# --------------------------------------------------------------------------------------------
# The decoded request


@dataclass
class InferRequest:
    """A decoded inference request: the scheduler's transport-agnostic unit of work.

    ``deadline_ns`` is an absolute ``time.monotonic_ns()`` deadline (0 = none). ``leases`` hold
    the release callbacks of shared-memory views backing ``inputs``; whoever finishes with the
    request calls ``release()`` (idempotent) once the input arrays are no longer read.
    """

    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: list[NamedTensor] = field(default_factory=list)
    requested_outputs: list[RequestedOutput] = field(default_factory=list)
    deadline_ns: int = 0
    parameters: Params = field(default_factory=dict)
    leases: list[Callable[[], None]] = field(default_factory=list)

    def release(self) -> None:
        """Release every shared-memory lease once; later calls do nothing.

        Every callback runs even if one raises; the first exception is re-raised afterwards.
        """
        leases, self.leases = self.leases, []
        first: BaseException | None = None
        for release in leases:
            try:
                release()
            except BaseException as exc:
                if first is None:
                    first = exc
        if first is not None:
            raise first

    def __enter__(self) -> InferRequest:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


# --------------------------------------------------------------------------------------------
# Server side: request decode


@dataclass(slots=True)  # not frozen: a frozen __init__ is slower, once per input
class _InputPlan:
    msg: Any
    what: str
    dtype: DType
    shape: tuple[int, ...]
    count: int
    nbytes: int
    shm: ShmRef | None
    typed: bool


def _plan_input(model_name: str, tensor: Any) -> _InputPlan:
    what = f"input '{tensor.name}' of model '{model_name}'"
    dtype = wire_dtype(what, tensor.datatype)
    shape = tuple(int(d) for d in tensor.shape)
    count, nbytes = checked_nbytes(what, shape, dtype)
    shm = shm_ref(what, tensor.parameters)
    if shm is not None and shm.byte_size != nbytes and not dtype.is_bytes:
        raise InvalidArgument(
            f"{what} has {SHM_BYTE_SIZE_PARAM} {shm.byte_size}, expected {nbytes} "
            f"(shape {shape_str(shape)} x {dtype.wire})"
        )
    typed = shm is None and tensor.contents is not None
    return _InputPlan(tensor, what, dtype, shape, count, nbytes, shm, typed)


def _decode_requested(model_name: str, msg: Any) -> list[RequestedOutput]:
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for out in msg.outputs:
        if not out.name:
            raise InvalidArgument(f"request for model '{model_name}' requests an unnamed output")
        if out.name in seen:
            raise InvalidArgument(
                f"output '{out.name}' of model '{model_name}' is requested more than once"
            )
        seen.add(out.name)
        what = f"requested output '{out.name}' of model '{model_name}'"
        requested.append(RequestedOutput(out.name, shm_ref(what, out.parameters)))
    return requested


def decode_infer_request(
    msg: InferRequestMessage | pb.ModelInferRequest,
    registry: ShmRegistryLike | None = None,
    *,
    now_ns: int | None = None,
) -> InferRequest:
    """Translate a parsed ``ModelInferRequest`` (``core.protocol.infer_wire``, or a betterproto2
    message built by hand) into an ``InferRequest``.

    Rules, in order (every violation raises ``InvalidArgument`` naming the tensor, except the
    registry's own ``UnregisteredRegionError``):
    1. ``model_name`` must be non-empty.
    2. The deadline is taken from the request parameters (``deadline_from_parameters``).
    3. Each input: unique name, known wire datatype, non-negative dims whose byte size is at most
       ``MAX_TENSOR_BYTES``. Its data source is, by priority, its shm parameters (region named:
       ``shared_memory_byte_size`` required and equal to the tensor's bytes, offset default 0),
       else typed ``contents`` when present, else the next ``raw_input_contents`` entry.
    4. Raw entries are assigned in order to the inputs with neither shm nor typed data; their
       count must match. A raw list covering every non-shm input while some input also has
       typed contents is the "both given" error; an input with no source at all is "no data".
    5. Raw and shm data become read-only ``np.frombuffer`` views (no copy) whose byte length
       must equal ``prod(shape) * itemsize``; typed data is converted to the exact dtype. A
       ``BYTES`` input is decoded instead, from its length-prefixed encoding (raw or shm, the
       whole ``shared_memory_byte_size`` range) or from ``bytes_contents``, into an ``object``
       array of ``bytes`` holding exactly ``prod(shape)`` elements.
    6. Shared memory is read last, through ``registry.read_view``; its leases go to
       ``InferRequest.leases``, and are released again if anything fails on the way.
    """
    model_name = msg.model_name
    require_model_name(model_name)
    deadline = deadline_from_parameters(msg.parameters, now_ns)

    plans: list[_InputPlan] = []
    seen: set[str] = set()
    for tensor in msg.inputs:
        if tensor.name in seen:
            raise InvalidArgument(
                f"duplicate input '{tensor.name}' in request for model '{model_name}'"
            )
        seen.add(tensor.name)
        plans.append(_plan_input(model_name, tensor))

    raw = msg.raw_input_contents
    needs_raw = [p for p in plans if p.shm is None and not p.typed]
    typed = [p for p in plans if p.typed]
    if raw and len(raw) != len(needs_raw):
        if typed and len(raw) == len(needs_raw) + len(typed):
            raise InvalidArgument(
                f"{typed[0].what} has both typed contents and a raw_input_contents entry"
            )
        raise InvalidArgument(
            f"request for model '{model_name}' has {len(raw)} raw_input_contents entries but "
            f"{len(needs_raw)} input(s) take their data from raw_input_contents"
        )
    if not raw and needs_raw:
        raise InvalidArgument(
            f"{needs_raw[0].what} has no data: no shared memory region, raw_input_contents entry "
            "or typed contents"
        )
    requested = _decode_requested(model_name, msg)

    arrays: dict[int, np.ndarray] = {}
    for plan, buf in zip(needs_raw, raw, strict=True):
        if len(buf) != plan.nbytes and not plan.dtype.is_bytes:
            raise InvalidArgument(
                f"{plan.what} has {len(buf)} bytes of raw data, expected {plan.nbytes} "
                f"(shape {shape_str(plan.shape)} x {plan.dtype.wire})"
            )
        arrays[id(plan)] = from_buffer(buf, plan.dtype, plan.shape, plan.what)
    for plan in typed:
        assert plan.msg.contents is not None
        arrays[id(plan)] = from_typed(
            plan.what, plan.msg.contents, plan.dtype, plan.shape, plan.count
        )

    request = InferRequest(
        model_name=model_name,
        model_version=msg.model_version,
        id=msg.id,
        requested_outputs=requested,
        deadline_ns=deadline,
        parameters=(
            dict(msg.parameters)
            if type(msg) is InferRequestMessage
            else plain_params(msg.parameters)
        ),
    )
    try:
        for plan in plans:
            if plan.shm is None:
                continue
            if registry is None:
                raise InvalidArgument(
                    f"{plan.what} names shared memory region '{plan.shm.region}' but this "
                    "endpoint has no shared memory registry"
                )
            view, release = registry.read_view(plan.shm.region, plan.shm.offset, plan.shm.byte_size)
            request.leases.append(release)
            if view.nbytes != plan.nbytes and not plan.dtype.is_bytes:
                raise InvalidArgument(
                    f"{plan.what}: shared memory region '{plan.shm.region}' returned "
                    f"{view.nbytes} bytes, expected {plan.nbytes}"
                )
            arrays[id(plan)] = from_buffer(view, plan.dtype, plan.shape, plan.what)
    except BaseException:
        # The decode error is what the caller must see; a failing release must not mask it.
        with contextlib.suppress(Exception):
            request.release()
        raise
    request.inputs = [NamedTensor(p.msg.name, p.dtype, p.shape, arrays[id(p)]) for p in plans]
    return request
