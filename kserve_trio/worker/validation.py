"""A request's one validation pass against a model's client-facing specs, in the worker.

This module owns the one check between decode and scheduling: do the decoded input tensors match
what the model declares, and does the model have every output the request asks for? It lives
beside its one user (``worker/inference.py``); the response encoder's own refusal of an unknown
output is the codec's ``no_such_output``, the one wording of that error. Shapes and dim indices
are row-major, so a message's ``dim i`` is the 0-based wire/numpy axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kserve_trio.core.bundles import DimKind, TensorSpec
from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol import InferRequest, RequestedOutput, no_such_output
from kserve_trio.core.tensors import NamedTensor

if TYPE_CHECKING:
    from kserve_trio.worker.registry import ModelBundle


def validate_inputs(
    model_name: str, specs: Sequence[TensorSpec], inputs: Sequence[NamedTensor]
) -> None:
    """Raise ``InvalidArgument`` unless ``inputs`` match ``specs`` exactly.

    ``inputs`` come from ``decode_infer_request``, the one owner of the rule that each
    input name is given once (``duplicate input 'x' in request for model 'm'``), so it is not
    checked again here. Rules, checked per input in request order, then for completeness:
    1. the name is declared (``input 'x' is not declared by model 'm'``);
    2. the wire datatype matches (``input 'x' of model 'm' has datatype FP64, expected FP32``);
    3. the rank matches (``input 'x' of model 'm' has rank 3, expected 2``);
    4. every FIXED axis has its size (``input 'x' dim i has extent E, expected S``, ``i`` the
       0-based row-major axis); BATCH and VARIABLE axes accept any extent;
    5. every declared input is present (``model 'm' requires input 'x'``), in spec order.
    """
    by_name = {spec.name: spec for spec in specs}
    seen: set[str] = set()
    for tensor in inputs:
        name = tensor.name
        seen.add(name)
        spec = by_name.get(name)
        if spec is None:
            raise InvalidArgument(f"input '{name}' is not declared by model '{model_name}'")
        if tensor.dtype is not spec.dtype:
            raise InvalidArgument(
                f"input '{name}' of model '{model_name}' has datatype {_wire(tensor)}, "
                f"expected {_wire(spec)}"
            )
        shape = tuple(tensor.shape)
        if len(shape) != len(spec.dims):
            raise InvalidArgument(
                f"input '{name}' of model '{model_name}' has rank {len(shape)}, "
                f"expected {len(spec.dims)}"
            )
        for axis, (extent, dim) in enumerate(zip(shape, spec.dims, strict=True)):
            if dim.kind is DimKind.FIXED and extent != dim.size:
                raise InvalidArgument(
                    f"input '{name}' dim {axis} has extent {extent}, expected {dim.size}"
                )
    for spec in specs:
        if spec.name not in seen:
            raise InvalidArgument(f"model '{model_name}' requires input '{spec.name}'")


def check_requested_outputs(
    model_name: str, specs: Sequence[TensorSpec], requested: Sequence[RequestedOutput]
) -> None:
    """Refuse an unknown requested output before any device work is spent on the request
    (``no_such_output``)."""
    known = {spec.name for spec in specs}
    for out in requested:
        if out.name not in known:
            raise no_such_output(model_name, out.name, known)


def validate_request(bundle: ModelBundle, request: InferRequest) -> None:
    """The request's one validation pass against the model's client-facing specs: its inputs
    (``validate_inputs``), then the outputs it asks for, if any."""
    manifest = bundle.manifest
    validate_inputs(bundle.name, manifest.wire_inputs, request.inputs)
    if request.requested_outputs:
        check_requested_outputs(bundle.name, manifest.wire_outputs, request.requested_outputs)


def _wire(t: NamedTensor | TensorSpec) -> str:
    """The wire string when there is one (FP8 has none: fall back to the manifest token)."""
    return t.dtype.wire if t.dtype.has_wire else t.dtype.token


__all__ = ["check_requested_outputs", "validate_inputs", "validate_request"]
