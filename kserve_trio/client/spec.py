"""A model's I/O spec on the client, and ``validate_io``: the dry run of a user's IO.

``ModelIOSpec(inputs, outputs)`` lists ``TensorMeta(name, datatype, shape)`` in model order,
with row-major wire shapes and ``-1`` for batch and variable axes: exactly what ModelMetadata
reports. ``model_io_spec(model)`` asks a server; ``manifest_io_spec(path)`` reads a bundle's
manifest offline through the server's own metadata encoder, so both agree for one model.

``validate_io(spec_or_model, io, items=1)`` runs the user's ``encode_chunk`` and
``decode_chunk`` for the first ``items`` items against a private heap slot and a synthetic,
spec-shaped zero response, inside ``with_bounds_checks``; see its docstring for the checks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kserve_trio.client.errors import IOValidationError
from kserve_trio.client.io import (
    InferInput,
    OutputSpec,
    as_descriptors,
    output_specs,
    with_bounds_checks,
)
from kserve_trio.client.loop_thread import refuse_in_event_loop
from kserve_trio.client.runtime import get_state
from kserve_trio.core.bundles import MANIFEST_FILE, load_manifest
from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import BufferPool, ScratchBuffer, pool_offset
from kserve_trio.core.protocol import InferOutputTensor, InferResponseMessage, encode_model_metadata
from kserve_trio.core.tensors import DType, dtype_from_wire, dtype_of
from kserve_trio.proto import inference as pb

log = get_logger("kserve_trio.client")

_ROW_MAJOR_HINT = "check the axis order: shapes are row-major, batch axis first"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of a model: ``name``, wire ``datatype`` (``"FP32"``) and row-major ``shape``
    with ``-1`` for batch and variable axes."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> DType:
        """The element type (``ValueError`` for a datatype kserve_trio cannot decode)."""
        return dtype_from_wire(self.datatype)


@dataclass(frozen=True)
class ModelIOSpec:
    """A model's inputs and outputs, in model order."""

    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    name: str = ""

    def input(self, name: str) -> TensorMeta:
        return _lookup(self.inputs, name, "input", self.name)

    def output(self, name: str) -> TensorMeta:
        return _lookup(self.outputs, name, "output", self.name)


def _lookup(metas: list[TensorMeta], name: str, kind: str, model: str) -> TensorMeta:
    for meta in metas:
        if meta.name == name:
            return meta
    known = ", ".join(m.name for m in metas) or "none"
    raise KeyError(f"model '{model}' has no {kind} '{name}' ({kind}s: {known})")


def io_spec_from_metadata(reply: pb.ModelMetadataResponse) -> ModelIOSpec:
    """``ModelIOSpec`` of a ``ModelMetadataResponse`` (shapes kept as sent: row-major)."""

    def meta(t: pb.ModelMetadataResponseTensorMetadata) -> TensorMeta:
        return TensorMeta(t.name, t.datatype, tuple(int(d) for d in t.shape))

    return ModelIOSpec(
        [meta(t) for t in reply.inputs], [meta(t) for t in reply.outputs], reply.name
    )


def model_io_spec(model: Any) -> ModelIOSpec:
    """The model's spec from its server's ModelMetadata RPC (blocking; from async code use
    ``await model.io_spec()``). Fails loudly when the server cannot answer."""
    refuse_in_event_loop("model_io_spec(model)", "'await model.io_spec()'")
    return get_state().run_blocking(model.io_spec)


def manifest_io_spec(path: str | os.PathLike[str]) -> ModelIOSpec:
    """The spec of a bundle, offline: ``path`` is its ``manifest.yaml`` or its directory. The
    model name is the bundle directory's name, as a worker would serve it."""
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_FILE
    manifest = load_manifest(p)
    return io_spec_from_metadata(encode_model_metadata(manifest.name, manifest, ""))


# --------------------------------------------------------------------------------------------
# validate_io


def _shape_matches(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    return len(shape) == len(expected) and all(
        e == -1 or s == e for s, e in zip(shape, expected, strict=True)
    )


def _mismatch(what: str, got: tuple[int, ...], expected: tuple[int, ...], model: str) -> str:
    msg = f"{what} has shape {list(got)} but model '{model}' expects {list(expected)}"
    if len(got) > 1 and _shape_matches(tuple(reversed(got)), expected):
        msg += f" (the reversed shape would match: {_ROW_MAJOR_HINT})"
    return msg


def _check_output_specs(spec: ModelIOSpec, declared: list[OutputSpec]) -> None:
    model = spec.name
    known = {m.name: m for m in spec.outputs}
    seen: set[str] = set()
    for out in declared:
        if out.name in seen:
            raise IOValidationError(f"output_specs() declares output '{out.name}' twice")
        seen.add(out.name)
        meta = known.get(out.name)
        if meta is None:
            raise IOValidationError(
                f"output_specs() declares output '{out.name}', which model '{model}' does not "
                f"have (outputs: {', '.join(known) or 'none'})"
            )
        if out.dtype.wire != meta.datatype:
            raise IOValidationError(
                f"output_specs() declares output '{out.name}' as {out.dtype.wire}, but model "
                f"'{model}' produces {meta.datatype}"
            )
        if not meta.shape or meta.shape[0] != -1:
            raise IOValidationError(
                f"output '{out.name}' of model '{model}' has no leading batch axis (shape "
                f"{list(meta.shape)}); it cannot be read back per item: leave it out of "
                "output_specs()"
            )
        per_item = meta.shape[1:]
        if not _shape_matches(out.per_item_dims, per_item):
            msg = (
                f"output_specs() declares output '{out.name}' with per-item dims "
                f"{list(out.per_item_dims)}, but model '{model}' produces {list(per_item)} per item"
            )
            if len(out.per_item_dims) > 1 and _shape_matches(
                tuple(reversed(out.per_item_dims)), per_item
            ):
                msg += f" (the reversed dims would match: {_ROW_MAJOR_HINT})"
            raise IOValidationError(msg)


def _check_inputs(
    spec: ModelIOSpec, descs: list, pool: BufferPool, items: int, per_item: int
) -> None:
    model = spec.name
    known = {m.name: m for m in spec.inputs}
    seen: set[str] = set()
    carved = 0
    for d in descs:
        if d.name in seen:
            raise IOValidationError(f"encode_chunk returned input '{d.name}' twice")
        seen.add(d.name)
        meta = known.get(d.name)
        if meta is None:
            raise IOValidationError(
                f"encode_chunk returned input '{d.name}', which model '{model}' does not have "
                f"(inputs: {', '.join(known) or 'none'})"
            )
        if isinstance(d, ScratchBuffer):
            dtype, shape = dtype_of(d.dtype), d.shape
            carved += d.nbytes
        else:
            assert isinstance(d, InferInput)
            dtype, shape = d.dtype, d.shape
            if pool_offset(pool, d.array) is not None:
                carved += d.nbytes
        if dtype.wire != meta.datatype:
            raise IOValidationError(
                f"input '{d.name}' is {dtype.wire} ({dtype.numpy}), but model '{model}' expects "
                f"{meta.datatype}"
            )
        if not _shape_matches(tuple(shape), meta.shape):
            raise IOValidationError(_mismatch(f"input '{d.name}'", tuple(shape), meta.shape, model))
    missing = [name for name in known if name not in seen]
    if missing:
        raise IOValidationError(
            f"encode_chunk returned no input '{missing[0]}' (model '{model}' expects "
            f"{', '.join(known)})"
        )
    if carved != items * per_item:
        raise IOValidationError(
            f"item_input_bytes() is {per_item} bytes per item, but encode_chunk carved "
            f"{carved} bytes of slot for {items} item(s); they must agree (the driver sizes "
            "each chunk's slot from item_input_bytes())"
        )


def synthetic_response(
    spec: ModelIOSpec, declared: list[OutputSpec], items: int
) -> InferResponseMessage:
    """A zero-filled response shaped like ``spec`` for ``items`` items, of the type a real
    ModelInfer call hands ``decode_chunk`` (``core.protocol.infer_wire.InferResponseMessage``).

    The outputs are the declared ones in declared order (explicit-output mode) or else every
    output of the model. A leading ``-1`` is the item count; any other ``-1`` takes the
    declared per-item dim, else 1. Outputs of a datatype the client cannot decode are left out
    with a warning.
    """
    declared_by_name = {d.name: d for d in declared}
    metas = [spec.output(d.name) for d in declared] if declared else list(spec.outputs)
    response = InferResponseMessage(model_name=spec.name, id="validate_io")
    for meta in metas:
        try:
            dtype = meta.dtype
        except ValueError as exc:
            log.warning("validate_io_output_skipped", output=meta.name, reason=str(exc))
            continue
        per_item = declared_by_name.get(meta.name)
        shape = []
        for axis, dim in enumerate(meta.shape):
            if dim != -1:
                shape.append(dim)
            elif axis == 0:
                shape.append(items)
            elif per_item is not None and axis - 1 < len(per_item.per_item_dims):
                shape.append(per_item.per_item_dims[axis - 1])
            else:
                shape.append(1)
        response.outputs.append(InferOutputTensor(meta.name, meta.datatype, shape))
        count = math.prod(shape)
        # BYTES: ``count`` empty elements (a 4-byte zero length each)
        response.raw_output_contents.append(
            bytes(count * (4 if dtype.is_bytes else dtype.itemsize))
        )
    return response


def _user_failure(method: str, items: range, exc: Exception) -> IOValidationError:
    return IOValidationError(
        f"{method}({items}) failed during validate_io: {type(exc).__name__}: {exc}"
    )


def validate_io(spec_or_model: Any, io: Any, items: int = 1) -> None:
    """Dry-run ``io`` against a model's I/O spec; no inference request is sent.

    ``spec_or_model`` is a ``ModelIOSpec`` (``manifest_io_spec``, ``model_io_spec``) or a
    ``KServeModel`` (its spec is fetched, blocking). Checks, in order, each failure an
    ``IOValidationError`` naming the tensor:
    1. ``output_specs()``: each declared output exists, has the model's dtype and per-item
       shape (``-1`` matches anything), and has a leading batch axis.
    2. ``encode_chunk(range(items), slot)`` runs on a private heap slot sized from
       ``item_input_bytes()`` inside ``with_bounds_checks``; what it raises is re-raised with
       context (an out-of-range index into a ``pool_view`` names the tensor).
    3. Each returned descriptor names a model input, once, with its dtype and a matching
       shape (a hint when the reversed shape would match); every input is provided; the bytes
       carved equal ``items * item_input_bytes()``.
    4. ``decode_chunk(range(items), response)`` runs on a zero response shaped by
       ``synthetic_response``, inside ``with_bounds_checks`` (``InferOutput`` views are
       bounds-checked too).
    The user's methods really run, so they may write into the IO's own buffers for those items.
    An empty IO validates nothing (a warning is logged).
    """
    spec = spec_or_model if isinstance(spec_or_model, ModelIOSpec) else model_io_spec(spec_or_model)
    n = len(io)
    if n == 0:
        log.warning("validate_io_empty", model=spec.name, reason="the IO has no items")
        return
    if items < 1:
        raise ValueError(f"validate_io needs items >= 1, got {items}")
    count = min(items, n)
    rng = range(count)
    declared = output_specs(io)
    _check_output_specs(spec, declared)
    per_item = int(io.item_input_bytes())
    if per_item <= 0:
        raise IOValidationError(f"item_input_bytes() must be > 0, got {per_item}")
    out_bytes = sum(d.item_bytes for d in declared)
    pool = BufferPool(
        count * (per_item + out_bytes) + 8 * (16 + len(declared)), 1, False, "validate_io"
    )
    try:
        slot = pool.acquire_nowait(1)
        assert slot is not None
        with with_bounds_checks():
            try:
                descs = as_descriptors(io.encode_chunk(rng, slot))
            except Exception as exc:
                raise _user_failure("encode_chunk", rng, exc) from exc
            _check_inputs(spec, descs, pool, count, per_item)
            response = synthetic_response(spec, declared, count)
            try:
                io.decode_chunk(rng, response)
            except Exception as exc:
                raise _user_failure("decode_chunk", rng, exc) from exc
    finally:
        pool.close()


__all__ = [
    "ModelIOSpec",
    "TensorMeta",
    "io_spec_from_metadata",
    "manifest_io_spec",
    "model_io_spec",
    "synthetic_response",
    "validate_io",
]
