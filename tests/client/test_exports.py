"""The public surface of ``kserve_trio.client`` is stated once and pinned here."""

from __future__ import annotations

import inspect

import kserve_trio.client as client

EXPECTED = {
    "BufferPool",
    "CheckedArray",
    "Endpoint",
    "H2Transport",
    "IOValidationError",
    "InferInput",
    "InferOutput",
    "InferenceIO",
    "KServeModel",
    "ModelIOSpec",
    "OutputSpec",
    "PoolAcquireTimeout",
    "PoolSlot",
    "RetryPolicy",
    "RpcError",
    "ScratchBuffer",
    "SharedMemoryUnavailable",
    "ShmUnrecoverableError",
    "TensorMeta",
    "Transport",
    "client_ssl_context",
    "infer_async",
    "infer_sync",
    "kserve_init",
    "kserve_shutdown",
    "manifest_io_spec",
    "model_io_spec",
    "pool_view",
    "scratch",
    "subslot",
    "validate_io",
    "with_bounds_checks",
}


def test_all_names_exactly_the_public_surface():
    assert set(client.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(client, name) is not None, name


def test_kserve_model_signature_is_pinned():
    params = inspect.signature(client.KServeModel).parameters
    assert list(params) == [
        "target",
        "port_or_model",
        "model_name",
        "secure",
        "max_batch_size",
        "deadline",
        "shared_memory",
        "retry",
        "max_send_message_length",
        "max_receive_message_length",
        "compression",
        "transport_factory",
        "root_certificates",
        "certificate_chain",
        "private_key",
        "ssl_context",
        "http2_engine",
    ]
    defaults = {n: p.default for n, p in params.items()}
    assert defaults["secure"] is False
    assert defaults["max_batch_size"] == 1
    assert defaults["deadline"] == 10.0
    assert defaults["shared_memory"] == "auto"
    assert defaults["compression"] is None
    assert defaults["http2_engine"] is None  # the environment's, else ngh2
    tls = ("root_certificates", "certificate_chain", "private_key", "ssl_context")
    assert all(defaults[n] is None for n in tls)
    kw_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert kw_only[0] == "secure"


def test_driver_and_helper_signatures():
    assert list(inspect.signature(client.infer_sync).parameters) == ["model", "inputs_or_io"]
    assert list(inspect.signature(client.infer_async).parameters) == ["model", "io"]
    assert inspect.iscoroutinefunction(client.infer_async)
    assert not inspect.iscoroutinefunction(client.infer_sync)
    assert list(inspect.signature(client.validate_io).parameters) == [
        "spec_or_model",
        "io",
        "items",
    ]
    assert inspect.signature(client.validate_io).parameters["items"].default == 1
    assert list(inspect.signature(client.kserve_init).parameters) == [
        "pool_bytes",
        "n_slots",
        "shm_reprobe_interval",
    ]


def test_retry_policy_defaults_follow_the_seed():
    p = client.RetryPolicy()
    assert (p.enabled, p.initial_backoff, p.factor, p.max_backoff) == (True, 1.0, 2.0, float("inf"))
    assert (p.min_budget, p.jitter, p.retry_unavailable) == (0.05, True, True)


def test_inference_io_is_a_subclassable_protocol_with_a_default_output_specs():
    class IO(client.InferenceIO):
        def __len__(self):
            return 0

        def item_input_bytes(self):
            return 4

        def encode_chunk(self, items, slot):
            return []

        def decode_chunk(self, items, response):
            return None

    assert IO().output_specs() == []
    assert isinstance(IO(), client.InferenceIO)
    assert not isinstance(object(), client.InferenceIO)
