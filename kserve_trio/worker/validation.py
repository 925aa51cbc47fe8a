"""Request input validation against a model's client-facing specs.

This module owns the one check between decode and scheduling: do the decoded input tensors match
what the model declares? Shapes and dim indices are row-major, so a message's
``dim i`` is the 0-based wire/numpy axis.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kserve_trio.core.bundles.manifest import DimKind, TensorSpec
from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol.request_bounds import shown
from kserve_trio.core.tensors.tensor import NamedTensor


def validate_inputs(
    model_name: str, specs: Sequence[TensorSpec], inputs: Sequence[NamedTensor]
) -> None:
    """Raise ``InvalidArgument`` unless ``inputs`` match ``specs`` exactly.

    ``inputs`` come from ``codec.decode_infer_request``, the one owner of the rule that each
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


def no_such_output(model_name: str, name: str, outputs: Iterable[str]) -> InvalidArgument:
    """The one error for a requested output the model does not have, whoever finds it (the
    worker before any device work, the response encoder for any other caller):
    ``model 'm' has no output 'x' (outputs: a, b)``."""
    return InvalidArgument(
        f"model '{model_name}' has no output {shown(name)} (outputs: {', '.join(sorted(outputs))})"
    )


def _wire(t: NamedTensor | TensorSpec) -> str:
    """The wire string when there is one (FP8 has none: fall back to the manifest token)."""
    return t.dtype.wire if t.dtype.has_wire else t.dtype.token


__all__ = ["no_such_output", "validate_inputs"]
