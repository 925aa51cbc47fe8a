"""The gateway's REST port against hostile bodies: the gateway CLI (``KSERVE_TRIO_GATEWAY_LISTEN_
HTTP``, a 4 MiB body cap) in front of one CLI worker that publishes no REST port, so the gateway
reads, decompresses and parses every body itself (the translated path of ``rest_forward``) and
the worker only ever sees gRPC.

Each test asserts the documented answer (400 for depth and element-count faults and for chunk
extensions past their bound, 413 for the body cap as sent, chunked or decompressed), the
gateway's peak resident memory during the attack within a stated bound, or its CPU time, and
that the gateway is alive and serves a well-behaved REST inference afterwards; and that it
reads HTTP/1.1 as RFC 9112 asks and ignores an h2c upgrade, as the worker does.
"""

from __future__ import annotations

import types

import pytest

from tests.edge.memory_probe import peak_growth_mib, reset_peak
from tests.edge.rest_peer import (
    MIB,
    chunk_extensions_are_bounded,
    deep_infer_body,
    endless_chunked,
    gzip_bomb,
    http11_rules_hold,
    metric,
    nested,
    number_list_body,
    request,
    served,
)
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port

pytestmark = pytest.mark.slow  # a worker and a gateway CLI start for the module
G = "KSERVE_TRIO_GATEWAY_"
CAP = 4 * MIB
REFUSED = "gateway_edge_refused_requests_total"
SLACK_MIB = 40
"""Allowance for the allocator, the interpreter and the socket buffers on top of each bound."""


@pytest.fixture(scope="module")
def fleet(demo_repo, tmp_path_factory):
    worker = Worker(demo_repo, "127.0.0.1", free_port())
    gateway = None
    try:
        worker.wait_ready()
        http_port = free_port()
        env = {
            G + "WORKERS": worker.url,
            G + "LISTEN_HTTP": f"127.0.0.1:{http_port}",
            G + "GRPC_MAX_RECV_MSG_BYTES": str(CAP),
        }
        gateway = Gateway(tmp_path_factory.mktemp("edge_rest_gateway"), env)
        gateway.wait_ready()
        assert served(http_port)
        yield types.SimpleNamespace(gateway=gateway, worker=worker, port=http_port)
    finally:
        if gateway is not None:
            assert gateway.stop() == 0, gateway.logs()
        worker.stop()


def still_serving(fleet) -> None:
    assert fleet.gateway.alive(), fleet.gateway.logs()
    assert served(fleet.port)


@pytest.mark.timeout(60)
def test_a_body_nested_5000_deep_is_400_on_infer_and_on_fleet_endpoints(fleet):
    status, body = request(fleet.port, "POST", "/v2/models/mlp/infer", deep_infer_body(5000))
    assert status == 400, body
    assert "nests at least 5003 levels deep, more than the limit of 64" in body["error"]
    for path in ("/v2/repository/models/mlp/load", "/v2/systemsharedmemory/region/r/register"):
        status, body = request(fleet.port, "POST", path, b'{"key":' + nested(5000) + b"}")
        assert status == 400, (path, body)
        assert "more than the limit of 64 (limits.max_json_depth)" in body["error"]
    logs = fleet.gateway.logs()
    assert logs.count('"rest_json_too_deep"') == 3  # once per refused request
    assert nested(5000).decode() not in logs  # logged without the body
    assert metric(fleet.gateway.admin("/metrics")[1], REFUSED, "json_too_deep") == 3
    still_serving(fleet)


@pytest.mark.timeout(60)
def test_an_endless_chunked_body_is_413_once_it_passes_the_cap(fleet):
    pid = fleet.gateway.proc.pid
    counted = metric(fleet.gateway.admin("/metrics")[1], REFUSED, "body_too_large")
    for _ in range(2):
        before = reset_peak(pid)
        status, body, sent = endless_chunked(fleet.port, "/v2/models/mlp/infer", 64 * CAP)
        assert status == 413, body
        assert body["error"].endswith(f" vs. {CAP})")
        assert sent < CAP + 48 * MIB  # the cap, plus what the socket buffers took
        assert peak_growth_mib(pid, before) < 1.25 * CAP / MIB + SLACK_MIB
    assert metric(fleet.gateway.admin("/metrics")[1], REFUSED, "body_too_large") == counted + 2
    still_serving(fleet)


@pytest.mark.timeout(60)
def test_a_gzip_bomb_is_413_at_the_gateway_with_memory_near_the_cap(fleet):
    bomb = gzip_bomb(64 * CAP)  # about 256 KiB that would inflate to 256 MiB
    pid = fleet.gateway.proc.pid
    counted = metric(fleet.gateway.admin("/metrics")[1], REFUSED, "body_too_large")
    for _ in range(2):
        before = reset_peak(pid)
        status, body = request(
            fleet.port,
            "POST",
            "/v2/models/mlp/infer",
            bomb,
            headers={"Content-Encoding": "gzip"},
        )
        assert (status, body) == (
            413,
            {"error": f"received message larger than max (more than {CAP} vs. {CAP})"},
        )
        assert peak_growth_mib(pid, before) < 1.25 * CAP / MIB + SLACK_MIB
    assert metric(fleet.gateway.admin("/metrics")[1], REFUSED, "body_too_large") == counted + 2
    still_serving(fleet)


@pytest.mark.timeout(60)
def test_an_element_count_that_disagrees_with_the_shape_is_400_at_the_gateway(fleet):
    count = MIB  # a 4 MiB-wide list of "0," under the cap: the count is refused, not decoded
    body = number_list_body(count, [1, 16], number=b"0")
    assert len(body) < CAP
    pid = fleet.gateway.proc.pid
    before = reset_peak(pid)
    status, reply = request(fleet.port, "POST", "/v2/models/mlp/infer", body)
    assert (status, reply) == (
        400,
        {
            "error": f"input 'input_0' of model 'mlp' has {count} elements in fp32_contents, "
            "expected 16 (shape [1, 16])"
        },
    )
    assert peak_growth_mib(pid, before) < 1.5 * len(body) / MIB + SLACK_MIB
    still_serving(fleet)


@pytest.mark.timeout(60)
def test_an_endless_chunk_extension_is_400_at_once_and_costs_no_core(fleet):
    counted = metric(fleet.gateway.admin("/metrics")[1], REFUSED, "chunk_extensions")
    chunk_extensions_are_bounded(fleet.port, [fleet.gateway.proc.pid])
    assert metric(fleet.gateway.admin("/metrics")[1], REFUSED, "chunk_extensions") == counted + 2
    still_serving(fleet)


@pytest.mark.timeout(90)
def test_http11_host_targets_pipelining_and_h2c_upgrades(fleet):
    http11_rules_hold(fleet.port)
    still_serving(fleet)
