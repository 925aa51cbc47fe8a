"""The user-facing I/O vocabulary of the client: tensors in, tensors out, and streaming IOs.

This module owns:

- ``InferInput(name, array)``: a named input for a one-shot request (every wire dtype, FP16 and
  BF16 included: the bytes travel in ``raw_input_contents``), or, built over a ``pool_view``, a
  hand-made descriptor an ``InferenceIO`` may return from ``encode_chunk``.
- ``InferOutput(name, response, dtype=None)``: an output of a ``ModelInferResponse`` (the
  ``core.protocol.infer_wire.InferResponseMessage`` a call returns) as a numpy array viewing the received
  bytes (no copy).
- ``InferenceIO``: the protocol a dataset implements to be streamed through ``infer_async`` /
  ``infer_sync`` in chunks, and ``OutputSpec``, the outputs it wants read back through shared
  memory.
- ``scratch`` (from ``core.memory.buffer_pool``) and ``pool_view``: carving a chunk's input buffers from
  its pool slot, and the writable arrays over them.
- ``with_bounds_checks``: a context in which ``pool_view`` and ``InferOutput`` hand out
  ``CheckedArray`` views that refuse any index outside the tensor's extent (numpy would silently
  clip a slice, or wrap a negative index) and name the tensor in the ``IndexError``.
  ``validate_io`` runs the user's code inside it.

Every shape here is row-major numpy order, batch axis first; nothing is ever reversed.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

import numpy as np

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.memory import PoolSlot, ScratchBuffer, scratch
from kserve_trio.core.memory import pool_view as _core_pool_view
from kserve_trio.core.protocol import (
    SHM_REGION_PARAM,
    InferResponseMessage,
    bytes_tensor_from_values,
    decode_bytes_tensor,
    in_shared_memory,
    int64_param,
    raw_output_indices,
    string_param,
)
from kserve_trio.core.tensors import DType, NamedTensor, dtype_from_wire, dtype_of
from kserve_trio.proto import inference as pb

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Bounds checks

_BOUNDS_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kserve_trio_client_bounds_checks", default=False
)


def bounds_checks_enabled() -> bool:
    """Whether the current context hands out bounds-checked views."""
    return _BOUNDS_CHECKS.get()


@contextlib.contextmanager
def _bounds_context() -> Iterator[None]:
    token = _BOUNDS_CHECKS.set(True)
    try:
        yield
    finally:
        _BOUNDS_CHECKS.reset(token)


@overload
def with_bounds_checks() -> contextlib.AbstractContextManager[None]: ...
@overload
def with_bounds_checks(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...


def with_bounds_checks(fn: Callable[..., T] | None = None, /, *args: Any, **kwargs: Any) -> Any:
    """Force bounds-checked views for the code it covers (task- and thread-local, restored on
    exit): ``with with_bounds_checks(): ...``, or ``with_bounds_checks(fn, *args)`` to run
    ``fn`` inside the context and return its result."""
    if fn is None:
        return _bounds_context()
    with _bounds_context():
        return fn(*args, **kwargs)


class CheckedArray(np.ndarray):
    """A view whose ``[]`` refuses any index outside the tensor's extent.

    Rules, per indexed axis (``n`` its extent):
    1. An integer must lie in ``[0, n)``; a negative one, which numpy would wrap to the end, is
       refused too.
    2. A slice's explicit start and stop must lie in ``[-n, n]`` (numpy would clip them).
    3. An integer array's values must lie in ``[0, n)``; a boolean mask must match the shape of
       the axes it covers.
    4. More indices than axes is refused.
    The ``IndexError`` names the tensor. Views derived from a ``CheckedArray`` (``a[:, j]``)
    are checked against their own extents and keep the name.
    """

    tensor_name: str

    def __array_finalize__(self, obj: Any) -> None:
        self.tensor_name = getattr(obj, "tensor_name", "")

    def __getitem__(self, index: Any) -> Any:
        _check_index(self, index)
        return super().__getitem__(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        _check_index(self, index)
        super().__setitem__(index, value)


def checked(arr: np.ndarray, name: str) -> CheckedArray:
    """``arr`` as a bounds-checked view named ``name`` (no copy)."""
    view = arr.view(CheckedArray)
    view.tensor_name = name
    return view


def _where(arr: CheckedArray, axis: int) -> str:
    return f"axis {axis} of tensor '{arr.tensor_name}' (extent {arr.shape[axis]})"


def _check_index(arr: CheckedArray, index: Any) -> None:
    entries = index if isinstance(index, tuple) else (index,)
    consuming = 0
    for e in entries:
        if e is None or e is Ellipsis:
            continue
        if isinstance(e, np.ndarray) and e.dtype == np.bool_:
            consuming += max(e.ndim, 1)
        else:
            consuming += 1
    if consuming > arr.ndim:
        raise IndexError(
            f"too many indices for tensor '{arr.tensor_name}': {consuming} for "
            f"{arr.ndim} dim(s) {list(arr.shape)}"
        )
    axis = 0
    for e in entries:
        if e is None:
            continue
        if e is Ellipsis:
            axis += arr.ndim - consuming
            continue
        if isinstance(e, slice):
            n = arr.shape[axis]
            for bound in (e.start, e.stop):
                if bound is not None and not -n <= int(bound) <= n:
                    raise IndexError(f"slice {_slice_str(e)} reaches outside {_where(arr, axis)}")
            axis += 1
            continue
        if isinstance(e, int | np.integer):
            n = arr.shape[axis]
            if not 0 <= int(e) < n:
                raise IndexError(f"index {int(e)} is out of range for {_where(arr, axis)}")
            axis += 1
            continue
        idx = np.asarray(e)
        if idx.dtype == np.bool_:
            covered = arr.shape[axis : axis + max(idx.ndim, 1)]
            if tuple(idx.shape) != tuple(covered):
                raise IndexError(
                    f"boolean mask of shape {list(idx.shape)} does not match {_where(arr, axis)}"
                )
            axis += max(idx.ndim, 1)
            continue
        if idx.dtype.kind in "iu":
            n = arr.shape[axis]
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
                bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
                raise IndexError(f"index {bad} is out of range for {_where(arr, axis)}")
            axis += 1
            continue
        axis += 1  # anything else: numpy's own rules apply


def _slice_str(s: slice) -> str:
    parts = ["" if s.start is None else str(s.start), "" if s.stop is None else str(s.stop)]
    if s.step is not None:
        parts.append(str(s.step))
    return ":".join(parts)


@overload
def pool_view(desc: ScratchBuffer, /) -> np.ndarray: ...
@overload
def pool_view(slot: PoolSlot, shape: Any, dtype: Any, /) -> np.ndarray: ...
@overload
def pool_view(*descs: ScratchBuffer) -> np.ndarray | tuple[np.ndarray, ...]: ...


def pool_view(*descs: Any) -> np.ndarray | tuple[np.ndarray, ...]:
    """Writable zero-copy arrays over ``scratch`` descriptors: one array for one descriptor,
    else a tuple in argument order. ``pool_view(slot, shape, dtype)`` is the array at the start
    of a slot carved by hand with ``subslot`` (wrap it in an ``InferInput`` to send it through
    shared memory). Inside ``with_bounds_checks`` they are ``CheckedArray`` views named after
    their tensors."""
    if not descs:
        raise TypeError("pool_view() needs at least one scratch descriptor")
    if isinstance(descs[0], PoolSlot):
        slot, shape, dtype = descs  # the core view refuses any other arity
        arr = _core_pool_view(slot, shape, dtype)
        assert isinstance(arr, np.ndarray)  # one slot, one array
        return checked(arr, "subslot") if bounds_checks_enabled() else arr
    arrays = _core_pool_view(*descs)
    if bounds_checks_enabled():
        if isinstance(arrays, np.ndarray):  # exactly one descriptor
            return checked(arrays, descs[0].name)
        return tuple(checked(a, d.name) for a, d in zip(arrays, descs, strict=True))
    return arrays


# --------------------------------------------------------------------------------------------
# Inputs and outputs


def _numpy_dtype(name: str, dtype: Any) -> np.dtype:
    """A numpy dtype-like, a ``DType`` or a wire datatype string (``"FP32"``) as numpy's."""
    if isinstance(dtype, DType):
        return dtype.numpy
    if isinstance(dtype, str) and dtype.isupper():
        try:
            return dtype_from_wire(dtype).numpy
        except ValueError:
            raise TypeError(f"input '{name}' has unknown wire datatype {dtype!r}") from None
    return np.dtype(dtype)


def _wire_dtype_of(name: str, dtype: Any, what: str) -> DType:
    try:
        dt = dtype if isinstance(dtype, DType) else dtype_of(dtype)
    except ValueError:
        raise TypeError(
            f"{what} '{name}' has dtype {dtype}, which kserve_trio cannot send"
        ) from None
    if not dt.has_wire:
        raise TypeError(f"{what} '{name}' has dtype {dt.token}, which has no KServe wire datatype")
    return dt


@dataclass(frozen=True, slots=True, init=False)
class InferInput:
    """A named input tensor: ``array`` is sent as is (row-major, batch axis first); an
    ``object`` array of ``bytes``/``str`` is a ``BYTES`` tensor, sent inline in Triton's
    length-prefixed encoding.

    For a one-shot request the bytes go inline in ``raw_input_contents``. Returned from
    ``encode_chunk``, an ``InferInput`` over a ``pool_view`` of the chunk's slot travels through
    shared memory like a ``scratch`` descriptor; over any other array it is sent inline.
    """

    name: str
    array: np.ndarray
    dtype: DType

    def __init__(self, name: str, array: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"InferInput needs a non-empty name, got {name!r}")
        arr = np.asarray(array)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", _wire_dtype_of(name, arr.dtype, "input"))
        object.__setattr__(self, "array", arr)

    @classmethod
    def from_buffer(
        cls, name: str, buffer: Any, shape: Sequence[int], dtype: Any = None
    ) -> InferInput:
        """An input from a flat buffer and its explicit row-major ``shape``.

        ``buffer`` is an array of any shape (read in C order) or a bytes-like object, which
        then needs ``dtype`` (a numpy dtype-like, a ``DType`` or a wire string such as
        ``"FP32"``). No copy when the buffer is contiguous, so a ``pool_view`` stays a view of
        its slot. The element count must equal the shape's."""
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"input '{name}' shape {list(dims)} has a negative dimension")
        dt = None if dtype is None else _numpy_dtype(name, dtype)
        if isinstance(buffer, bytes | bytearray | memoryview):
            if dt is None:
                raise TypeError(f"input '{name}': a bytes buffer needs a dtype")
            if len(memoryview(buffer).cast("B")) % dt.itemsize:
                raise ValueError(
                    f"input '{name}': {len(memoryview(buffer).cast('B'))} bytes is not a "
                    f"whole number of {dt.name} elements"
                )
            flat = np.frombuffer(buffer, dtype=dt)
        else:
            flat = np.asarray(buffer, dtype=dt).reshape(-1)
        if flat.size != math.prod(dims):
            raise ValueError(
                f"input '{name}': {flat.size} element(s) do not fill shape {list(dims)} "
                f"({math.prod(dims)} element(s))"
            )
        return cls(name, flat.reshape(dims))

    @classmethod
    def from_contents(
        cls, name: str, contents: Sequence[Any], shape: Sequence[int], datatype: Any
    ) -> InferInput:
        """An input from typed contents: a flat sequence of Python values (as KServe's typed
        ``contents`` fields carry them, ``bool_contents`` ... ``bytes_contents``), the row-major
        ``shape`` and the wire ``datatype`` (``"FP32"``, ``"BYTES"``, ... or a numpy dtype).

        The values are converted to that datatype exactly once, here (a value it cannot hold is
        a ``ValueError``, not a silent wrap-around), and the tensor is sent like any other
        input, in ``raw_input_contents``."""
        dt = _numpy_dtype(name, datatype)
        values = list(contents)
        if dt == np.dtype(object):
            flat = np.empty(len(values), dtype=object)
            flat[:] = values
        else:
            try:
                flat = np.array(values, dtype=dt)
            except (OverflowError, ValueError, TypeError) as exc:
                raise ValueError(f"input '{name}': contents do not fit {dt.name}: {exc}") from None
            if flat.ndim != 1:
                raise ValueError(f"input '{name}': contents must be a flat sequence of values")
            if dt.kind in "iu" and not np.array_equal(np.array(values, dtype=object), flat):
                raise ValueError(f"input '{name}': contents do not fit {dt.name} exactly")
        return cls.from_buffer(name, flat, shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def datatype(self) -> str:
        """The KServe wire datatype, e.g. ``"FP32"``."""
        return self.dtype.wire

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def to_tensor(self) -> NamedTensor:
        return NamedTensor(self.name, self.dtype, self.shape, self.array)

    def __repr__(self) -> str:
        return f"InferInput({self.name!r}, {self.datatype}{list(self.shape)})"


Descriptor = ScratchBuffer | InferInput
"""What ``encode_chunk`` returns (one, or a list): ``scratch`` descriptors or ``InferInput``."""


def _output_names(response: InferResponseMessage | pb.ModelInferResponse) -> str:
    return ", ".join(o.name for o in response.outputs) or "none"


def InferOutput(
    name: str, response: InferResponseMessage | pb.ModelInferResponse, dtype: Any = None
) -> np.ndarray:
    """The output ``name`` of ``response`` as a read-only array of its wire shape (a
    betterproto2 ``ModelInferResponse`` built by hand reads the same).

    Raw bytes are viewed in place (``np.frombuffer``, no copy); typed ``contents`` become a new
    array; a ``BYTES`` output becomes an ``object`` array of ``bytes``. Entries of ``raw_output_contents`` are matched to outputs by position, in Triton's
    layout or the older inline-only one (``codec.raw_output_indices``). ``dtype``, when given
    (numpy dtype-like, ``DType`` or a wire string), must be the output's datatype: the bytes are
    never reinterpreted as another type. Raises ``KeyError`` for an unknown name, ``TypeError``
    for a dtype mismatch and ``ValueError`` for an output left in shared memory or a malformed
    payload, each naming the output.
    """
    position = next((i for i, o in enumerate(response.outputs) if o.name == name), None)
    if position is None:
        raise KeyError(
            f"response from model '{response.model_name}' has no output '{name}' "
            f"(outputs: {_output_names(response)})"
        )
    out = response.outputs[position]
    in_shm = in_shared_memory(out)
    what = f"output '{name}' of model '{response.model_name}'"
    try:
        wire = dtype_from_wire(out.datatype)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if dtype is not None:
        want = (
            dtype_from_wire(dtype)
            if isinstance(dtype, str) and dtype.isupper()
            else _wire_dtype_of(name, dtype, "output")
        )
        if want is not wire:
            raise TypeError(f"{what} is {wire.wire} ({wire.numpy}), not {want.wire} ({want.numpy})")
    shape = tuple(int(d) for d in out.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{what} has a negative dimension in shape {list(shape)}")
    nbytes = math.prod(shape) * wire.itemsize
    if in_shm:
        raise ValueError(
            f"{what} was written to shared memory region "
            f"'{string_param(out.parameters, SHM_REGION_PARAM)}'; read it from there"
        )
    if out.contents is not None:
        field = wire.contents_field
        if field is None:
            raise ValueError(f"{what} has datatype {wire.wire}, which has no typed contents")
        values = getattr(out.contents, field)
        if len(values) != math.prod(shape):
            raise ValueError(
                f"{what} has {len(values)} elements in {field}, expected {math.prod(shape)}"
            )
        if wire.is_bytes:
            arr = bytes_tensor_from_values(values, shape, what)
        else:
            arr = np.array(values, dtype=wire.numpy).reshape(shape)
    else:
        raw = response.raw_output_contents
        indices = raw_output_indices(response.outputs, len(raw))
        if indices is None:
            raise ValueError(
                f"{what} cannot be located: the response has {len(raw)} raw_output_contents "
                "entries, matching neither one per output without typed contents nor one per "
                "inline output"
            )
        index = indices[position]
        if index is None:
            raise ValueError(f"{what} has no raw_output_contents entry")
        buf = raw[index]
        if wire.is_bytes:
            try:
                arr = decode_bytes_tensor(buf, shape, what)
            except InvalidArgument as exc:
                raise ValueError(exc.message) from None
        elif len(buf) != nbytes:
            raise ValueError(
                f"{what} has {len(buf)} bytes of raw data, expected {nbytes} "
                f"(shape {list(shape)} x {wire.wire})"
            )
        else:
            arr = np.frombuffer(buf, dtype=wire.numpy).reshape(shape)
    if arr.flags.writeable:
        arr.flags.writeable = False
    return checked(arr, name) if bounds_checks_enabled() else arr


# --------------------------------------------------------------------------------------------
# Streaming IO


@dataclass(frozen=True, slots=True, init=False)
class OutputSpec:
    """An output to read back through shared memory: ``name``, element ``dtype`` (numpy
    dtype-like, ``DType`` or wire string) and its row-major ``per_item_dims``, batch axis
    excluded. Each chunk reserves ``itemsize * prod(per_item_dims) * items`` bytes for it."""

    name: str
    dtype: DType
    per_item_dims: tuple[int, ...]

    def __init__(self, name: str, dtype: Any, per_item_dims: int | Sequence[int] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"OutputSpec needs a non-empty name, got {name!r}")
        if isinstance(dtype, str) and dtype.isupper():
            dt = dtype_from_wire(dtype)
        else:
            dt = _wire_dtype_of(name, dtype, "output")
        if dt.is_bytes:
            raise ValueError(
                f"OutputSpec '{name}' is BYTES: its size is not known ahead, so it cannot be "
                "read back through shared memory; leave it out of output_specs() (it is then "
                "returned inline)"
            )
        dims = (
            (int(per_item_dims),)
            if isinstance(per_item_dims, int | np.integer)
            else tuple(int(d) for d in per_item_dims)
        )
        if any(d < 0 for d in dims):
            raise ValueError(
                f"OutputSpec '{name}' per_item_dims {list(dims)} must be known sizes (no -1): "
                "outputs with data-dependent shapes must stay inline"
            )
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "per_item_dims", dims)

    @property
    def item_bytes(self) -> int:
        """Bytes one item of this output occupies."""
        return self.dtype.itemsize * math.prod(self.per_item_dims)

    def shape(self, items: int) -> tuple[int, ...]:
        """The wire shape of this output for a chunk of ``items`` items."""
        return (items, *self.per_item_dims)


@runtime_checkable
class InferenceIO(Protocol):
    """A dataset streamed through batched inference by ``infer_async`` / ``infer_sync``.

    Implement (all synchronous; ``items`` is a 0-based ``range`` of item indices):

    - ``__len__()``: how many items.
    - ``item_input_bytes()``: input bytes per item, summed over every input; it must equal what
      ``encode_chunk`` carves per item, because the driver sizes each chunk's slot from it.
    - ``encode_chunk(items, slot)``: stage the chunk's inputs in ``slot`` (``scratch`` +
      ``pool_view``) and return one descriptor or a list. Keep no reference to the slot or its
      views afterwards: the pool reuses it.
    - ``decode_chunk(items, response)``: consume the chunk's ``ModelInferResponse`` (an
      ``InferResponseMessage``: read it with ``InferOutput``; copy what you keep, its buffers
      are the received message's).
    - ``output_specs()`` (optional, default ``[]``): outputs to read back through shared memory.
      Declaring any puts the request in explicit-output mode: the server returns exactly those
      outputs, in that order. The driver copies them into the response before ``decode_chunk``,
      so decoding reads the same on either transport.
    """

    def __len__(self) -> int: ...

    def item_input_bytes(self) -> int: ...

    def encode_chunk(self, items: range, slot: PoolSlot) -> Descriptor | list[Descriptor]: ...

    def decode_chunk(self, items: range, response: InferResponseMessage) -> None: ...

    def output_specs(self) -> list[OutputSpec]:
        return []


def output_specs(io: Any) -> list[OutputSpec]:
    """The IO's declared outputs (``[]`` when it does not implement ``output_specs``)."""
    method: Callable[[], Iterable[object]] | None = getattr(io, "output_specs", None)
    specs: list[OutputSpec] = []
    for spec in method() if callable(method) else ():
        if not isinstance(spec, OutputSpec):
            raise TypeError(f"output_specs() must return OutputSpec values, got {spec!r}")
        specs.append(spec)
    return specs


def item_output_bytes(io: Any) -> int:
    """Bytes per item of the IO's declared outputs (what the shm path reserves per item)."""
    return sum(s.item_bytes for s in output_specs(io))


def as_descriptors(value: Any, where: str = "encode_chunk") -> list[Descriptor]:
    """``encode_chunk``'s return value as a list of descriptors (one or a sequence)."""
    items = [value] if isinstance(value, ScratchBuffer | InferInput) else value
    if not isinstance(items, list | tuple):
        raise TypeError(
            f"{where} must return a scratch descriptor, an InferInput or a list of them, "
            f"got {type(value).__name__}"
        )
    for d in items:
        if not isinstance(d, ScratchBuffer | InferInput):
            raise TypeError(
                f"{where} returned {type(d).__name__}; expected scratch descriptors or InferInput"
            )
    return list(items)


__all__ = [
    "CheckedArray",
    "Descriptor",
    "InferInput",
    "InferOutput",
    "InferenceIO",
    "OutputSpec",
    "as_descriptors",
    "bounds_checks_enabled",
    "checked",
    "int64_param",
    "item_output_bytes",
    "output_specs",
    "pool_view",
    "scratch",
    "string_param",
    "with_bounds_checks",
]
