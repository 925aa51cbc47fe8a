"""The public surface of ``kserve_trio.core.protocol.codec`` is stated once and pinned here."""

from __future__ import annotations

from kserve_trio.core.protocol import codec

EXPECTED = {
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
}


def test_all_names_exactly_the_public_surface():
    assert set(codec.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(codec, name) is not None, name
