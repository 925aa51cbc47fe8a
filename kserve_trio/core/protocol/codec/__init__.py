"""The KServe V2 codec: ModelInfer messages <-> boundary ``NamedTensor`` values.

This package's face states the whole public surface once; its parts, by what each does:

- ``_types``: the boundary types (``RequestedOutput``, ``ShmRef``, ``ShmRegistryLike``);
- ``_params``: the request parameters (deadlines, Triton's ``timeout``, shared memory) and
  their accessors;
- ``_tensors``: checked tensor sizes, wire dtypes, zero-copy array views and payload bytes;
- ``_request``: request decode (``decode_infer_request``, from the ``InferRequestMessage`` that
  ``core.protocol.infer_wire`` parses, to ``InferRequest``);
- ``_response``: ``encode_infer_response``, outputs straight to ``WirePieces``, and
  ``response_outputs``, the output selection and shared-memory writes every encoder shares;
- ``_client``: the client's request encoders and response decoder;
- ``_metadata``: the ModelMetadata and RepositoryIndex encoders.

Everything here is pure: messages in, values out, no I/O besides the registry calls. Shapes are
row-major on both sides: no axis is ever reversed here. Parameters are plain values
(``core.protocol.wire.ParamValue``). Decoded arrays are ``np.frombuffer`` views of the received bytes or
of the shared-memory mapping, never copies; the only decode path that allocates is typed
``contents`` (Python lists must become arrays).
"""

from __future__ import annotations

from kserve_trio.core.protocol.codec._client import (
    decode_infer_response,
    encode_infer_request,
    encode_infer_request_shm,
    raw_output_indices,
)
from kserve_trio.core.protocol.codec._metadata import encode_model_metadata, encode_repository_index
from kserve_trio.core.protocol.codec._params import (
    INT64_MAX,
    SHM_BYTE_SIZE_PARAM,
    SHM_OFFSET_PARAM,
    SHM_REGION_PARAM,
    TIMEOUT_NS_PARAM,
    TRITON_TIMEOUT_PARAM,
    combine_deadlines,
    deadline_from_parameters,
    deadline_params,
    in_shared_memory,
    int64_param,
    shm_params,
    shm_ref,
    string_param,
)
from kserve_trio.core.protocol.codec._request import InferRequest, decode_infer_request
from kserve_trio.core.protocol.codec._response import (
    encode_infer_response,
    no_such_output,
    response_outputs,
)
from kserve_trio.core.protocol.codec._tensors import MAX_RANK, MAX_TENSOR_BYTES
from kserve_trio.core.protocol.codec._types import (
    BUNDLE_VERSION,
    RequestedOutput,
    ShmRef,
    ShmRegistryLike,
)

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
    "no_such_output",
    "raw_output_indices",
    "response_outputs",
    "shm_params",
    "shm_ref",
    "string_param",
]
