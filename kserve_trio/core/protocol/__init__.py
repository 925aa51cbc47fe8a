"""The KServe V2 protocol as it is on the wire, for the servers and the client alike.

- ``codec``: ModelInfer messages <-> boundary ``NamedTensor`` values (both sides), metadata;
- ``infer_wire``: the one module that codes ``ModelInferRequest``/``ModelInferResponse``;
- ``wire``: the protobuf wire primitives the hand-coded messages use;
- ``grpc_wire``: the gRPC-over-HTTP/2 wire rules (prefix, timeouts, metadata, trailers);
- ``compression``: ``grpc-encoding`` gzip and deflate, bounded by the message cap;
- ``rest_codec``: the REST inference body with Triton's binary extension, both directions,
  with ``json_depth`` and ``json_numbers`` (bounded JSON before it is parsed);
- ``bytes_tensor``: BYTES tensors' length-prefixed encoding;
- ``request_bounds``: names and repeated fields bounded before any per-entry work;
- ``stream_answers``: the answers of a ModelStreamInfer stream.

Stands on ``core.tensors`` and ``core.process`` (``rest_codec`` reads the edge limits); never on
the bundle format. The worker's validation of a request against its model is the worker's
(``worker/validation.py``). Code outside the domain imports the names below from this face, the codec's
too (``codec``'s own face serves the domain's modules); the modules import each other by module
path. Where two modules use one name, the face says which: ``parse_rest_request`` and
``encode_rest_response`` are ``rest_codec``'s REST-body coders (``parse_infer_request`` is the
protobuf one, ``encode_infer_response`` the codec's).
"""

from kserve_trio.core.protocol.bytes_tensor import (
    bytes_tensor_from_values,
    decode_bytes_tensor,
    encode_bytes_tensor,
)
from kserve_trio.core.protocol.codec import (
    BUNDLE_VERSION,
    SHM_BYTE_SIZE_PARAM,
    SHM_OFFSET_PARAM,
    SHM_REGION_PARAM,
    TIMEOUT_NS_PARAM,
    InferRequest,
    RequestedOutput,
    ShmRef,
    ShmRegistryLike,
    combine_deadlines,
    deadline_params,
    decode_infer_request,
    encode_infer_request,
    encode_infer_response,
    encode_model_metadata,
    encode_repository_index,
    in_shared_memory,
    int64_param,
    no_such_output,
    raw_output_indices,
    response_outputs,
    shm_params,
    string_param,
)
from kserve_trio.core.protocol.compression import (
    ACCEPT_ENCODING,
    DEFLATE,
    GZIP,
    IDENTITY,
    Inflater,
    compress,
    decompress,
    parse_accept_encoding,
    parse_encoding,
    reply_encoding,
)
from kserve_trio.core.protocol.grpc_wire import (
    OK_TRAILERS,
    PREFIX,
    PREFIX_BYTES,
    RESPONSE_HEADERS,
    custom_metadata,
    decode_message,
    format_timeout,
    message_prefix,
    metadata_headers,
    parse_timeout,
    status_from_http,
    status_from_reset,
    status_trailers,
    valid_bin,
    valid_timeout,
)
from kserve_trio.core.protocol.infer_wire import (
    Buffer,
    InferInputTensor,
    InferOutputTensor,
    InferRequestedOutput,
    InferRequestMessage,
    InferResponseMessage,
    WirePieces,
    infer_request_pieces,
    parse_infer_request,
    parse_infer_response,
)
from kserve_trio.core.protocol.json_depth import JsonTooDeep
from kserve_trio.core.protocol.request_bounds import (
    RequestBounds,
    check_count,
    check_infer_request,
    check_model_name,
    check_name,
    check_path_names,
    name_too_long,
    require_model_name,
    shown,
)
from kserve_trio.core.protocol.rest_codec import (
    DEFAULT_JSON_DEPTH,
    HEADER_LENGTH,
    RestInferRequest,
    RestReply,
    input_shape,
    load_json,
)
from kserve_trio.core.protocol.rest_codec import encode_infer_response as encode_rest_response
from kserve_trio.core.protocol.rest_codec import parse_infer_request as parse_rest_request
from kserve_trio.core.protocol.stream_answers import stream_error, stream_reply, stream_response
from kserve_trio.core.protocol.wire import Params, byte_view, decode_varint, iter_fields, signed

__all__ = [
    "ACCEPT_ENCODING",
    "BUNDLE_VERSION",
    "DEFAULT_JSON_DEPTH",
    "DEFLATE",
    "GZIP",
    "HEADER_LENGTH",
    "IDENTITY",
    "OK_TRAILERS",
    "PREFIX",
    "PREFIX_BYTES",
    "RESPONSE_HEADERS",
    "SHM_BYTE_SIZE_PARAM",
    "SHM_OFFSET_PARAM",
    "SHM_REGION_PARAM",
    "TIMEOUT_NS_PARAM",
    "Buffer",
    "InferInputTensor",
    "InferOutputTensor",
    "InferRequest",
    "InferRequestMessage",
    "InferRequestedOutput",
    "InferResponseMessage",
    "Inflater",
    "JsonTooDeep",
    "Params",
    "RequestBounds",
    "RequestedOutput",
    "RestInferRequest",
    "RestReply",
    "ShmRef",
    "ShmRegistryLike",
    "WirePieces",
    "byte_view",
    "bytes_tensor_from_values",
    "check_count",
    "check_infer_request",
    "check_model_name",
    "check_name",
    "check_path_names",
    "combine_deadlines",
    "compress",
    "custom_metadata",
    "deadline_params",
    "decode_bytes_tensor",
    "decode_infer_request",
    "decode_message",
    "decode_varint",
    "decompress",
    "encode_bytes_tensor",
    "encode_infer_request",
    "encode_infer_response",
    "encode_model_metadata",
    "encode_repository_index",
    "encode_rest_response",
    "format_timeout",
    "in_shared_memory",
    "infer_request_pieces",
    "input_shape",
    "int64_param",
    "iter_fields",
    "load_json",
    "message_prefix",
    "metadata_headers",
    "name_too_long",
    "no_such_output",
    "parse_accept_encoding",
    "parse_encoding",
    "parse_infer_request",
    "parse_infer_response",
    "parse_rest_request",
    "parse_timeout",
    "raw_output_indices",
    "reply_encoding",
    "require_model_name",
    "response_outputs",
    "shm_params",
    "shown",
    "signed",
    "status_from_http",
    "status_from_reset",
    "status_trailers",
    "stream_error",
    "stream_reply",
    "stream_response",
    "string_param",
    "valid_bin",
    "valid_timeout",
]
