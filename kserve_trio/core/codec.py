"""The KServe V2 codec: wire messages <-> boundary ``NamedTensor`` values.

This module owns the translation between the betterproto2 messages of ``inference`` and the
transport-agnostic forms the rest of the server works with: ``InferRequest`` (the scheduler's
unit of work), ``RequestedOutput``/``ShmRef`` and lists of ``NamedTensor``. It also owns the
request-level deadline parameters (``TIMEOUT_NS_PARAM``, Triton's ``timeout``) and the
shared-memory registry interface the codec reads and writes through (``ShmRegistryLike``).

Everything here is pure: messages in, values out, no I/O besides the registry calls. Shapes are
row-major on both sides: no axis is ever reversed here. Decoded arrays are
``np.frombuffer`` views of the received bytes or of the shared-memory mapping, never copies; the
only decode path that allocates is typed ``contents`` (Python lists must become arrays).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import betterproto2
import numpy as np

from kserve_trio.core.dtypes import DType, dtype_from_wire
from kserve_trio.core.errors import Internal, InvalidArgument
from kserve_trio.core.tensor import NamedTensor
from kserve_trio.proto import inference as pb

if TYPE_CHECKING:
    from kserve_trio.core.manifest import Manifest, TensorSpec

TIMEOUT_NS_PARAM = "reactant_timeout_ns"
"""Request parameter (``int64_param``): the caller's REMAINING budget in nanoseconds."""

TRITON_TIMEOUT_PARAM = "timeout"
"""Triton's request parameter (``int64_param``): a timeout in microseconds."""

SHM_REGION_PARAM = "shared_memory_region"
SHM_OFFSET_PARAM = "shared_memory_offset"
SHM_BYTE_SIZE_PARAM = "shared_memory_byte_size"

INT64_MAX = 2**63 - 1
MAX_TENSOR_BYTES = 2**62
"""Largest payload a tensor may declare; larger shapes are rejected before any allocation."""

MAX_RANK = 64
"""Most dimensions a tensor may have (numpy's own limit); more is malformed input."""

BUNDLE_VERSION = "1"
"""The one version every bundle is served as: requests may name it or leave the version empty."""

_CONTENTS_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)


# --------------------------------------------------------------------------------------------
# Boundary types


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A byte range of a registered shared-memory region (offset relative to the region)."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the caller asked for; ``shm`` says where to write it instead of inline."""

    name: str
    shm: ShmRef | None = None


class ShmRegistryLike(Protocol):
    """What the codec needs from a shared-memory registry (implemented by ``core/shm.py``)."""

    def read_view(
        self, region: str, offset: int, byte_size: int
    ) -> tuple[memoryview, Callable[[], None]]:
        """A zero-copy view of ``byte_size`` bytes at ``offset`` and the callback that releases
        the lease on it. Raises ``UnregisteredRegionError`` or ``InvalidArgument``."""
        ...

    def write(self, region: str, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy ``data`` into the region at ``offset``. Raises ``UnregisteredRegionError``; the
        caller has already checked the size against what the client asked for."""
        ...


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
    parameters: dict[str, pb.InferParameter] = field(default_factory=dict)
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
# Deadlines


def _saturating_deadline(now_ns: int, budget_ns: int) -> int:
    return min(now_ns + budget_ns, INT64_MAX)


def int64_param(params: Mapping[str, pb.InferParameter], key: str) -> int | None:
    """The ``int64_param`` value of ``params[key]``; absent or another oneof variant -> None."""
    param = params.get(key)
    if param is None:
        return None
    kind, value = betterproto2.which_one_of(param, "parameter_choice")
    return value if kind == "int64_param" else None


def string_param(params: Mapping[str, pb.InferParameter], key: str) -> str | None:
    """The ``string_param`` value of ``params[key]``; absent or another oneof variant -> None."""
    param = params.get(key)
    if param is None:
        return None
    kind, value = betterproto2.which_one_of(param, "parameter_choice")
    return value if kind == "string_param" else None


def combine_deadlines(*deadlines_ns: int) -> int:
    """The effective deadline: the smallest non-zero absolute deadline, 0 when all are 0."""
    live = [d for d in deadlines_ns if d > 0]
    return min(live) if live else 0


def deadline_from_parameters(
    params: Mapping[str, pb.InferParameter], now_ns: int | None = None
) -> int:
    """Absolute monotonic deadline from a request's parameters (0 = none).

    Rules:
    1. ``reactant_timeout_ns`` (``int64_param``, remaining ns) -> ``now + budget``.
    2. Triton's ``timeout`` (``int64_param``, microseconds) -> ``now + timeout * 1000``.
    3. Absent, another oneof variant, or ``<= 0`` -> no deadline from that source.
    4. Sums saturate at int64 max; the smaller of the non-zero results wins.
    """
    now = time.monotonic_ns() if now_ns is None else now_ns
    found = []
    budget = int64_param(params, TIMEOUT_NS_PARAM)
    if budget is not None and budget > 0:
        found.append(_saturating_deadline(now, budget))
    micros = int64_param(params, TRITON_TIMEOUT_PARAM)
    if micros is not None and micros > 0:
        found.append(_saturating_deadline(now, micros * 1000))
    return combine_deadlines(*found)


def deadline_params(budget_ns: int) -> dict[str, pb.InferParameter]:
    """Request parameters carrying a remaining budget of ``budget_ns`` (empty for <= 0)."""
    if budget_ns <= 0:
        return {}
    return {TIMEOUT_NS_PARAM: pb.InferParameter(int64_param=min(int(budget_ns), INT64_MAX))}


# --------------------------------------------------------------------------------------------
# Shared helpers


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _checked_nbytes(what: str, shape: Sequence[int], dtype: DType) -> tuple[int, int]:
    """``(elements, bytes)`` of a wire shape; a rank above ``MAX_RANK``, a negative dimension or
    an oversized shape raises before any allocation (Python ints: the product cannot overflow).

    The size limit counts a zero dimension as one, so an empty tensor with huge other dimensions
    is refused too: numpy itself cannot even describe its shape.
    """
    if len(shape) > MAX_RANK:
        raise InvalidArgument(
            f"{what} has rank {len(shape)}, more than the limit of {MAX_RANK} dimensions"
        )
    for d in shape:
        if d < 0:
            raise InvalidArgument(f"{what} has a negative dimension in shape {_shape_str(shape)}")
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    extent = nbytes if count else math.prod(d for d in shape if d) * dtype.itemsize
    if extent > MAX_TENSOR_BYTES:
        needs = (
            f"needs {nbytes} bytes" if nbytes else f"spans {extent} bytes (zero dimensions aside)"
        )
        raise InvalidArgument(
            f"{what} shape {_shape_str(shape)} {needs}, more than the limit of "
            f"{MAX_TENSOR_BYTES} bytes"
        )
    return count, nbytes


def _wire_dtype(what: str, datatype: str) -> DType:
    try:
        return dtype_from_wire(datatype)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def _shm_ref(what: str, params: Mapping[str, pb.InferParameter]) -> ShmRef | None:
    """The three shm parameters of a tensor (wrong oneof variants count as absent)."""
    region = string_param(params, SHM_REGION_PARAM)
    if region is None:
        return None
    offset = int64_param(params, SHM_OFFSET_PARAM)
    offset = 0 if offset is None else offset
    byte_size = int64_param(params, SHM_BYTE_SIZE_PARAM)
    if byte_size is None:
        raise InvalidArgument(
            f"{what} names shared memory region '{region}' but has no {SHM_BYTE_SIZE_PARAM}"
        )
    if offset < 0:
        raise InvalidArgument(f"{what} has a negative {SHM_OFFSET_PARAM} {offset}")
    if byte_size < 0:
        raise InvalidArgument(f"{what} has a negative {SHM_BYTE_SIZE_PARAM} {byte_size}")
    return ShmRef(region, offset, byte_size)


def _shm_params(ref: ShmRef) -> dict[str, pb.InferParameter]:
    return {
        SHM_REGION_PARAM: pb.InferParameter(string_param=ref.region),
        SHM_OFFSET_PARAM: pb.InferParameter(int64_param=ref.offset),
        SHM_BYTE_SIZE_PARAM: pb.InferParameter(int64_param=ref.byte_size),
    }


def _from_buffer(buf: bytes | memoryview, dtype: DType, shape: Sequence[int]) -> np.ndarray:
    """A read-only array viewing ``buf`` (no copy)."""
    arr = np.frombuffer(buf, dtype=dtype.numpy).reshape(tuple(shape))
    if arr.flags.writeable:
        arr.flags.writeable = False
    return arr


def _from_typed(
    what: str,
    contents: pb.InferTensorContents,
    dtype: DType,
    shape: Sequence[int],
    count: int,
) -> np.ndarray:
    """Typed ``contents`` -> an array of exactly ``dtype`` (this path copies by nature)."""
    expected = dtype.contents_field
    if expected is None:
        raise InvalidArgument(
            f"{what} has datatype {dtype.wire}, which has no typed contents field; "
            "send it in raw_input_contents or shared memory"
        )
    for name in _CONTENTS_FIELDS:
        if name != expected and getattr(contents, name):
            raise InvalidArgument(
                f"{what} has datatype {dtype.wire} but carries data in {name}; expected {expected}"
            )
    values = getattr(contents, expected)
    if len(values) != count:
        raise InvalidArgument(
            f"{what} has {len(values)} elements in {expected}, expected {count} "
            f"(shape {_shape_str(shape)})"
        )
    try:
        arr = np.array(values, dtype=dtype.numpy)
    except (OverflowError, ValueError):
        raise InvalidArgument(
            f"{what} has a value in {expected} out of range for {dtype.wire}"
        ) from None
    return arr.reshape(tuple(shape))


def _payload(arr: np.ndarray) -> bytes:
    """The C-order bytes of ``arr`` for a ``bytes`` proto field.

    When ``arr`` is exactly a whole ``bytes`` object viewed in place (an echoed input, a
    pass-through output) that object is returned as is; otherwise one copy (``tobytes``, as
    cheap as any other single copy measured here).
    """
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if (
        isinstance(base, bytes)
        and arr.flags.c_contiguous
        and arr.nbytes == len(base)
        and (len(base) == 0 or arr.ctypes.data == np.frombuffer(base, np.uint8).ctypes.data)
    ):
        return base
    return arr.tobytes()


def _view(arr: np.ndarray) -> memoryview:
    """A flat byte view of ``arr`` (copied once only if it is not C-contiguous)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _checked_array(model_name: str, tensor: NamedTensor, kind: str = "output") -> np.ndarray:
    """The tensor's array after checking it is what the tensor claims (a mismatch is a bug)."""
    what = f"{kind} '{tensor.name}' of model '{model_name}'"
    if not tensor.dtype.has_wire:
        raise Internal(f"{what} has dtype {tensor.dtype.token}, which has no KServe wire datatype")
    arr = np.asarray(tensor.data)
    if arr.dtype != tensor.dtype.numpy or tuple(arr.shape) != tuple(tensor.shape):
        raise Internal(
            f"{what} declares {tensor.dtype.token}{_shape_str(tensor.shape)} but its data is "
            f"{arr.dtype}{_shape_str(arr.shape)}"
        )
    return arr


# --------------------------------------------------------------------------------------------
# Server side: request decode


@dataclass(frozen=True, slots=True)
class _InputPlan:
    msg: pb.ModelInferRequestInferInputTensor
    what: str
    dtype: DType
    shape: tuple[int, ...]
    count: int
    nbytes: int
    shm: ShmRef | None
    typed: bool


def _plan_input(model_name: str, tensor: pb.ModelInferRequestInferInputTensor) -> _InputPlan:
    what = f"input '{tensor.name}' of model '{model_name}'"
    dtype = _wire_dtype(what, tensor.datatype)
    shape = tuple(int(d) for d in tensor.shape)
    count, nbytes = _checked_nbytes(what, shape, dtype)
    shm = _shm_ref(what, tensor.parameters)
    if shm is not None and shm.byte_size != nbytes:
        raise InvalidArgument(
            f"{what} has {SHM_BYTE_SIZE_PARAM} {shm.byte_size}, expected {nbytes} "
            f"(shape {_shape_str(shape)} x {dtype.wire})"
        )
    typed = shm is None and tensor.contents is not None
    return _InputPlan(tensor, what, dtype, shape, count, nbytes, shm, typed)


def _decode_requested(model_name: str, msg: pb.ModelInferRequest) -> list[RequestedOutput]:
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
        requested.append(RequestedOutput(out.name, _shm_ref(what, out.parameters)))
    return requested


def decode_infer_request(
    msg: pb.ModelInferRequest,
    registry: ShmRegistryLike | None = None,
    *,
    now_ns: int | None = None,
) -> InferRequest:
    """Translate a parsed ``ModelInferRequest`` into an ``InferRequest``.

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
       must equal ``prod(shape) * itemsize``; typed data is converted to the exact dtype.
    6. Shared memory is read last, through ``registry.read_view``; its leases go to
       ``InferRequest.leases``, and are released again if anything fails on the way.
    """
    model_name = msg.model_name
    if not model_name:
        raise InvalidArgument("ModelInferRequest has an empty model_name")
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
        if len(buf) != plan.nbytes:
            raise InvalidArgument(
                f"{plan.what} has {len(buf)} bytes of raw data, expected {plan.nbytes} "
                f"(shape {_shape_str(plan.shape)} x {plan.dtype.wire})"
            )
        arrays[id(plan)] = _from_buffer(buf, plan.dtype, plan.shape)
    for plan in typed:
        assert plan.msg.contents is not None
        arrays[id(plan)] = _from_typed(
            plan.what, plan.msg.contents, plan.dtype, plan.shape, plan.count
        )

    request = InferRequest(
        model_name=model_name,
        model_version=msg.model_version,
        id=msg.id,
        requested_outputs=requested,
        deadline_ns=deadline,
        parameters=dict(msg.parameters),
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
            if view.nbytes != plan.nbytes:
                raise InvalidArgument(
                    f"{plan.what}: shared memory region '{plan.shm.region}' returned "
                    f"{view.nbytes} bytes, expected {plan.nbytes}"
                )
            arrays[id(plan)] = _from_buffer(view, plan.dtype, plan.shape)
    except BaseException:
        # The decode error is what the caller must see; a failing release must not mask it.
        with contextlib.suppress(Exception):
            request.release()
        raise
    request.inputs = [NamedTensor(p.msg.name, p.dtype, p.shape, arrays[id(p)]) for p in plans]
    return request


# --------------------------------------------------------------------------------------------
# Server side: response encode


def encode_infer_response(
    model_name: str,
    request_id: str,
    outputs: Sequence[NamedTensor],
    requested: Sequence[RequestedOutput] | None = None,
    registry: ShmRegistryLike | None = None,
    *,
    model_version: str = "",
    zero_copy: bool = False,
) -> pb.ModelInferResponse:
    """Build the ``ModelInferResponse`` for ``outputs`` (model order).

    ``zero_copy=True`` puts ``memoryview``s of the output arrays in ``raw_output_contents``
    instead of ``bytes`` (for a transport that serializes them with ``core.wire``).

    Rules:
    1. ``requested`` empty or None: every output, in model order, inline.
    2. Otherwise exactly the requested outputs in request order; a name the model does not
       produce raises ``InvalidArgument("model 'm' has no output 'x'")`` before anything is
       written.
    3. An output requested into shared memory must fit its ``byte_size`` (else
       ``InvalidArgument`` naming both numbers); it is written through ``registry.write`` and
       its response tensor carries the three shm parameters with ``shared_memory_byte_size`` =
       the bytes actually written.
    4. ``raw_output_contents`` has one entry per output, in response order (Triton's layout,
       which tritonclient reads by position): the payload of an inline output, an empty entry
       for an output written to shared memory.
    """
    by_name = {t.name: t for t in outputs}
    if requested:
        chosen: list[tuple[NamedTensor, ShmRef | None]] = []
        for req in requested:
            tensor = by_name.get(req.name)
            if tensor is None:
                raise InvalidArgument(f"model '{model_name}' has no output '{req.name}'")
            chosen.append((tensor, req.shm))
    else:
        chosen = [(t, None) for t in outputs]

    prepared = []
    for tensor, shm in chosen:
        arr = _checked_array(model_name, tensor)
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

    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version, id=request_id
    )
    for tensor, arr, shm in prepared:
        out = pb.ModelInferResponseInferOutputTensor(
            name=tensor.name, datatype=tensor.dtype.wire, shape=list(tensor.shape)
        )
        if shm is None:
            response.raw_output_contents.append(_view(arr) if zero_copy else _payload(arr))
        else:
            assert registry is not None
            registry.write(shm.region, shm.offset, np.ascontiguousarray(arr))
            out.parameters = _shm_params(ShmRef(shm.region, shm.offset, arr.nbytes))
            response.raw_output_contents.append(b"")
        response.outputs.append(out)
    return response


def encode_model_metadata(name: str, manifest: Manifest, platform: str) -> pb.ModelMetadataResponse:
    """``ModelMetadataResponse`` from the manifest's client-facing specs (wire shapes, -1 for
    batch and variable axes, ``versions=["1"]``: a bundle is served as ``BUNDLE_VERSION``)."""

    def meta(spec: TensorSpec) -> pb.ModelMetadataResponseTensorMetadata:
        return pb.ModelMetadataResponseTensorMetadata(
            name=spec.name, datatype=spec.dtype.wire, shape=list(spec.wire_shape())
        )

    return pb.ModelMetadataResponse(
        name=name,
        versions=[BUNDLE_VERSION],
        platform=platform,
        inputs=[meta(s) for s in manifest.wire_inputs],
        outputs=[meta(s) for s in manifest.wire_outputs],
    )


def encode_repository_index(
    entries: Iterable[str] | Iterable[tuple[str, bool]],
) -> pb.RepositoryIndexResponse:
    """``RepositoryIndexResponse`` in the given order: a bare name is READY, a ``(name, ready)``
    pair is READY or UNAVAILABLE. Sorting and filtering are the caller's business."""
    models = []
    for entry in entries:
        if isinstance(entry, str):
            name, ready = entry, True
        else:
            name, ready = entry
        models.append(
            pb.RepositoryIndexResponseModelIndex(
                name=name,
                version=BUNDLE_VERSION,
                state="READY" if ready else "UNAVAILABLE",
                reason="",
            )
        )
    return pb.RepositoryIndexResponse(models=models)


# --------------------------------------------------------------------------------------------
# Client side


def _requested_msgs(
    requested_outputs: Sequence[str | RequestedOutput],
) -> list[pb.ModelInferRequestInferRequestedOutputTensor]:
    msgs = []
    for item in requested_outputs:
        req = RequestedOutput(item) if isinstance(item, str) else item
        params = _shm_params(req.shm) if req.shm is not None else {}
        msgs.append(
            pb.ModelInferRequestInferRequestedOutputTensor(name=req.name, parameters=params)
        )
    return msgs


def _input_msg(
    tensor: NamedTensor, params: dict[str, pb.InferParameter] | None = None
) -> pb.ModelInferRequestInferInputTensor:
    return pb.ModelInferRequestInferInputTensor(
        name=tensor.name,
        datatype=tensor.dtype.wire,
        shape=list(tensor.shape),
        parameters=params or {},
    )


def _request_params(
    budget_ns: int, parameters: Mapping[str, pb.InferParameter] | None
) -> dict[str, pb.InferParameter]:
    params = dict(parameters or {})
    params.update(deadline_params(budget_ns))
    return params


def encode_infer_request(
    model_name: str,
    inputs: Sequence[NamedTensor],
    *,
    requested_outputs: Sequence[str | RequestedOutput] = (),
    id: str = "",
    budget_ns: int = 0,
    parameters: Mapping[str, pb.InferParameter] | None = None,
) -> pb.ModelInferRequest:
    """A ``ModelInferRequest`` with every input inline in ``raw_input_contents`` (any wire dtype,
    FP16/BF16 included). ``budget_ns > 0`` adds ``TIMEOUT_NS_PARAM`` over ``parameters``."""
    return pb.ModelInferRequest(
        model_name=model_name,
        id=id,
        parameters=_request_params(budget_ns, parameters),
        inputs=[_input_msg(t) for t in inputs],
        outputs=_requested_msgs(requested_outputs),
        raw_input_contents=[_payload(_checked_array(model_name, t, "input")) for t in inputs],
    )


def encode_infer_request_shm(
    model_name: str,
    inputs: Sequence[NamedTensor],
    region: str,
    offsets: Sequence[int],
    *,
    requested_outputs: Sequence[str | RequestedOutput] = (),
    id: str = "",
    budget_ns: int = 0,
    parameters: Mapping[str, pb.InferParameter] | None = None,
) -> pb.ModelInferRequest:
    """A ``ModelInferRequest`` whose inputs are all staged in ``region`` at ``offsets`` (one per
    input; the caller wrote the bytes there). No ``raw_input_contents``."""
    if len(offsets) != len(inputs):
        raise ValueError(f"{len(offsets)} offsets given for {len(inputs)} inputs")
    return pb.ModelInferRequest(
        model_name=model_name,
        id=id,
        parameters=_request_params(budget_ns, parameters),
        inputs=[
            _input_msg(t, _shm_params(ShmRef(region, int(off), t.nbytes)))
            for t, off in zip(inputs, offsets, strict=True)
        ],
        outputs=_requested_msgs(requested_outputs),
    )


def in_shared_memory(out: pb.ModelInferResponseInferOutputTensor) -> bool:
    """Whether the server wrote ``out`` to shared memory (its region parameter is set)."""
    return string_param(out.parameters, SHM_REGION_PARAM) is not None


def raw_output_indices(
    outputs: Sequence[pb.ModelInferResponseInferOutputTensor], n_raw: int
) -> list[int | None] | None:
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
            return [None] * len(outputs)
        if n_raw != sum(counted):
            return None
    indices: list[int | None] = []
    position = 0
    for takes_raw in counted:
        indices.append(position if takes_raw else None)
        position += takes_raw
    return indices


def decode_infer_response(
    msg: pb.ModelInferResponse, *, skip_shm: bool = False
) -> list[NamedTensor]:
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
        dtype = _wire_dtype(what, out.datatype)
        shape = tuple(int(d) for d in out.shape)
        count, nbytes = _checked_nbytes(what, shape, dtype)
        shm = _shm_ref(what, out.parameters)
        if shm is not None:
            if skip_shm:
                continue
            raise InvalidArgument(
                f"{what} was written to shared memory region '{shm.region}'; read it from there"
            )
        if out.contents is not None:
            data = _from_typed(what, out.contents, dtype, shape, count)
        else:
            buf = None if index is None else raw[index]
            if buf is None:
                raise InvalidArgument(
                    f"{what} has no data: no raw_output_contents entry or contents"
                )
            if len(buf) != nbytes:
                raise InvalidArgument(
                    f"{what} has {len(buf)} bytes of raw data, expected {nbytes} "
                    f"(shape {_shape_str(shape)} x {dtype.wire})"
                )
            data = _from_buffer(buf, dtype, shape)
        result.append(NamedTensor(out.name, dtype, shape, data))
    return result


__all__ = [
    "BUNDLE_VERSION",
    "INT64_MAX",
    "MAX_RANK",
    "MAX_TENSOR_BYTES",
    "SHM_BYTE_SIZE_PARAM",
    "SHM_OFFSET_PARAM",
    "SHM_REGION_PARAM",
    "TIMEOUT_NS_PARAM",
    "TRITON_TIMEOUT_PARAM",
    "InferRequest",
    "RequestedOutput",
    "ShmRef",
    "ShmRegistryLike",
    "combine_deadlines",
    "deadline_from_parameters",
    "deadline_params",
    "decode_infer_request",
    "decode_infer_response",
    "encode_infer_request",
    "encode_infer_request_shm",
    "encode_infer_response",
    "encode_model_metadata",
    "encode_repository_index",
    "in_shared_memory",
    "int64_param",
    "raw_output_indices",
    "string_param",
]
