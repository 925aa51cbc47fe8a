"""The small wrong statuses: each fault answers the status that names it, the same on a
worker and through a gateway.

- ModelControlStatus with bytes that are not a protobuf message: INVALID_ARGUMENT (it answered
  OK: betterproto2 reads garbage as unknown fields);
- RepositoryModelLoad / Unload of a name with a path separator, NUL or ``..``: INVALID_ARGUMENT
  on a worker in any mode and through the gateway (FAILED_PRECONDITION and NOT_FOUND before);
- a node file whose model repository does not exist: a configuration error, exit 2, before
  any child starts (a crash loop and exit 1 before);
- a status message is bounded in its encoded bytes, so a grpc-core client never sees
  RESOURCE_EXHAUSTED for a trailer it cannot take.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_trio.core.protocol.grpc_wire import MAX_MESSAGE_BYTES, decode_message, encode_message
from kserve_trio.core.protocol.request_bounds import name_too_long, shown
from tests.edge.edge_procs import raw_call, worker_and_gateway
from tests.ports import free_ports

CONTROL_STATUS = "/reactant_control.ControlService/ModelControlStatus"
GARBAGE = b"\xff\xfe not a protobuf message \x07\x00"


@pytest.fixture(scope="module")
def pair(demo_repo):
    with worker_and_gateway(demo_repo) as p:
        yield p


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_control_status_with_garbage_is_invalid_argument(pair):
    code, message, _ = raw_call(pair.worker.url, CONTROL_STATUS, GARBAGE)
    assert code.name == "INVALID_ARGUMENT", message
    assert "malformed request message" in message
    code, _, _ = raw_call(pair.worker.url, CONTROL_STATUS, b"")  # the real empty request
    assert code.name == "OK"


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["../../etc", "..", "a/b", "a\\b", "nul\x00byte"])
def test_load_of_a_path_is_invalid_argument_on_worker_and_gateway(pair, name):
    answers = []
    for url in (pair.worker.url, pair.gateway.url):
        client = grpcclient.InferenceServerClient(url)
        for call in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException) as info:
                call(name, client_timeout=30)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
            answers.append(info.value.message())
    assert "is not a model name" in answers[0]
    assert answers[0] == answers[2] and answers[1] == answers[3]  # the gateway says it as is


@pytest.mark.timeout(60)
def test_node_with_a_missing_model_repo_exits_2_before_starting(tmp_path):
    missing = tmp_path / "no-such-repo"
    node = tmp_path / "node.yaml"
    node.write_text(f"model_repo: {missing}\nbase_port: {free_ports(2)}\n")
    out = subprocess.run(
        [sys.executable, "-m", "kserve_trio", "node", "--node", str(node)],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "KSERVE_TRIO_RUNTIME_DIR": str(tmp_path / "run")},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "configuration error" in out.stdout and str(missing) in out.stdout
    assert "[worker0]" not in out.stdout  # nothing was started
    assert out.stdout.rstrip().endswith("[supervisor] node stopped (exit 2)")


@pytest.mark.parametrize("char", ["e", "\u00e9", "\u20ac", "\U0001f600"])
def test_status_message_fits_its_encoded_budget(char):
    message = "model " + char * 100_000
    encoded = encode_message(message)
    assert len(encoded) <= MAX_MESSAGE_BYTES
    decoded = decode_message(encoded)
    assert decoded.startswith("model " + char * 8)
    assert decoded.endswith(f"({len(message)} characters)")
    assert encode_message("short") == "short"


def test_shown_names_are_bounded_and_names_measured_in_utf8():
    assert shown("abc") == "'abc'"
    long = shown("x" * 10_000)
    assert len(long) < 100 and "(10000 characters)" in long
    assert name_too_long("a" * 256, 1024) == 0
    assert name_too_long("\U0001f600" * 256, 1024) == 0  # exactly 1024 bytes
    assert name_too_long("\U0001f600" * 257, 1024) == 1028
    assert name_too_long("a" * 2000, 0) == 0  # 0 turns the bound off
