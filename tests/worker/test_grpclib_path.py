"""The in-process worker tests that exercise ModelInfer's statuses, rerun on grpclib's own path.

The worker serves plain ModelInfer calls on the fast path by default (``serving.fast_unary``),
so tests/worker/test_server_inprocess.py covers that path; this module reruns the part of it
about ModelInfer's answers (cancellation, statuses, caps, deadlines, compression, coalescing)
with ``KSERVE_TRIO_GRPC_FAST_UNARY=0``, and checks that no call took the fast path.
"""

from __future__ import annotations

import pytest

from kserve_trio.serving.fast_unary import FAST_ENV, FastUnary
from tests.worker import test_server_inprocess as inprocess

server = inprocess.server  # the same module-scoped worker fixture, built for this module


@pytest.fixture(autouse=True, scope="module")
def grpclib_path():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAST_ENV, "0")
        before = FastUnary.calls
        yield
        assert FastUnary.calls == before, "a call took the fast path with the switch off"


test_64_concurrent_clients_get_their_own_results_and_batches_form = (
    inprocess.test_64_concurrent_clients_get_their_own_results_and_batches_form
)
test_cancelled_queued_requests_are_never_executed = (
    inprocess.test_cancelled_queued_requests_are_never_executed
)
test_unknown_model_is_not_found = inprocess.test_unknown_model_is_not_found
test_bad_inputs_are_invalid_argument = inprocess.test_bad_inputs_are_invalid_argument
test_byte_length_mismatch_is_invalid_argument = (
    inprocess.test_byte_length_mismatch_is_invalid_argument
)
test_compressed_requests_are_served_and_an_unknown_encoding_is_unimplemented = (
    inprocess.test_compressed_requests_are_served_and_an_unknown_encoding_is_unimplemented
)
test_expired_deadline_is_deadline_exceeded = inprocess.test_expired_deadline_is_deadline_exceeded
test_concurrency_cap_and_message_size_are_resource_exhausted = (
    inprocess.test_concurrency_cap_and_message_size_are_resource_exhausted
)
