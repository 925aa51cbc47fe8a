"""The worker's REST port against hostile bodies: a CLI worker (``--http-port``) with a 48 MiB
body cap (``INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES``), attacked over raw loopback sockets.

Each test asserts the documented answer (400 for depth and shape faults and for chunk
extensions past their bound, 413 for the body cap, as sent, chunked or decompressed), the
worker's peak resident memory during the attack (reset before it) within a stated multiple of
the body or of the cap, or its CPU time, and that the worker is alive, back to its descriptors,
and serves a well-behaved REST inference afterwards; and that it reads HTTP/1.1 as RFC 9112
asks (Host, absolute-form targets, pipelining around a fault) and ignores an h2c upgrade.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.edge.memory_probe import fds as fd_count
from tests.edge.memory_probe import peak_growth_mib, reset_peak
from tests.edge.rest_peer import (
    MIB,
    RestWorker,
    chunk_extensions_are_bounded,
    deep_infer_body,
    endless_chunked,
    gzip,
    gzip_bomb,
    http11_rules_hold,
    metric,
    nested,
    number_list_body,
    read_reply,
    request,
    served,
    worker_metrics,
)
from tests.ports import free_port
from tests.waiting import wait_until

CAP = 48 * MIB
REFUSED = "worker_edge_refused_requests_total"
SLACK_MIB = 40
"""Allowance for the allocator, the interpreter and the socket buffers on top of each bound."""


@pytest.fixture(scope="module")
def worker(demo_repo):
    w = RestWorker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        metrics_port=free_port(),
        env={"INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES": str(CAP)},
    )
    try:
        w.wait_ready()
        assert served(w.http_port)
        yield w
    finally:
        assert w.stop() == 0, w.logs()


def still_serving(worker: RestWorker, fds: int) -> None:
    assert worker.alive(), worker.logs()
    assert served(worker.http_port)
    wait_until(lambda: fd_count(worker.proc.pid) <= fds, 10, f"descriptors back to {fds}")


@pytest.mark.timeout(60)
def test_a_body_nested_5000_deep_is_400_on_infer_and_on_other_json_endpoints(worker):
    fds = fd_count(worker.proc.pid)
    port = worker.http_port
    status, body = request(port, "POST", "/v2/models/mlp/infer", deep_infer_body(5000))
    assert status == 400, body
    assert "nests at least 5003 levels deep, more than the limit of 64" in body["error"]
    for path in (
        "/v2/repository/models/mlp/load",
        "/v2/systemsharedmemory/region/r/register",
        "/v2/logging",
    ):
        status, body = request(port, "POST", path, b'{"parameters":' + nested(5000) + b"}")
        assert status == 400, (path, body)
        assert "more than the limit of 64 (limits.max_json_depth)" in body["error"]
    # the same depth inside a string is no nesting at all
    status, body = request(port, "POST", "/v2/logging", b'{"log_format": "' + nested(5000) + b'"}')
    assert status == 400 and "log_format" in body["error"], body
    assert worker.logs().count('"rest_json_too_deep"') == 4  # once per refused request
    assert nested(5000).decode() not in worker.logs()  # logged without the body
    assert metric(worker_metrics(worker), REFUSED, "json_too_deep") == 4
    still_serving(worker, fds)


@pytest.mark.timeout(60)
def test_an_endless_chunked_body_is_413_once_it_passes_the_cap(worker):
    fds = fd_count(worker.proc.pid)
    for _ in range(2):  # a second round grows nothing further
        before = reset_peak(worker.proc.pid)
        status, body, sent = endless_chunked(
            worker.http_port, "/v2/models/mlp/infer", give_up_bytes=4 * CAP
        )
        assert status == 413, body
        assert body["error"].startswith("received message larger than max (")
        assert body["error"].endswith(f" vs. {CAP})")
        # answered once the cap passed: what was sent beyond it sits in socket buffers (the
        # kernel's on both sides, at most 8 chunks queued in the server)
        assert sent < CAP + 48 * MIB
        assert peak_growth_mib(worker.proc.pid, before) < CAP / MIB * 1.25 + SLACK_MIB
    still_serving(worker, fds)


@pytest.mark.timeout(60)
def test_a_content_length_over_the_cap_is_413_before_the_body_is_read(worker):
    head = (
        f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: test\r\nContent-Length: {CAP + 1}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", worker.http_port), timeout=30) as sock:
        sock.sendall(head)  # and not one byte of the body: the answer must come anyway
        status, body = read_reply(sock, time.monotonic() + 30)
    assert status == 413
    assert json.loads(body) == {"error": f"received message larger than max ({CAP + 1} vs. {CAP})"}
    assert worker.alive() and served(worker.http_port)


@pytest.mark.timeout(60)
def test_a_gzip_bomb_is_413_with_memory_near_the_cap(worker):
    bomb = gzip_bomb(6 * CAP)  # about 300 KiB that would inflate to 288 MiB
    fds = fd_count(worker.proc.pid)
    for _ in range(2):
        before = reset_peak(worker.proc.pid)
        status, body = request(
            worker.http_port,
            "POST",
            "/v2/models/mlp/infer",
            bomb,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert status == 413, body
        assert body == {"error": f"received message larger than max (more than {CAP} vs. {CAP})"}
        assert peak_growth_mib(worker.proc.pid, before) < CAP / MIB * 1.25 + SLACK_MIB
    assert metric(worker_metrics(worker), REFUSED, "body_too_large") >= 2
    still_serving(worker, fds)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_number_list_costs_a_small_multiple_of_its_size(worker):
    """Bound: a refused count costs the body (1x, a 40 MiB body); a decoded FP32 list of
    4-byte numbers costs the body plus its array (one more 1x) plus one 1 MiB piece's Python
    numbers."""
    count = 10 * MIB  # "0.5," is 4 bytes: a 40 MiB body
    fds = fd_count(worker.proc.pid)
    # the count disagrees with the shape: 400 before any number is decoded
    body = number_list_body(count, [1, 16])
    body_mib = len(body) / MIB
    before = reset_peak(worker.proc.pid)
    status, reply = request(worker.http_port, "POST", "/v2/models/mlp/infer", body)
    assert status == 400, reply
    assert f"has {count} elements in fp32_contents, expected 16 (shape [1, 16])" in reply["error"]
    assert peak_growth_mib(worker.proc.pid, before) < 1.5 * body_mib + SLACK_MIB
    # the count agrees with its own shape: decoded into one FP32 array, then the model's shape
    # rule refuses it (16 MiB of it: decoding runs at JSON's speed)
    count = 4 * MIB
    body = number_list_body(count, [1, count])
    body_mib = len(body) / MIB
    before = reset_peak(worker.proc.pid)
    status, reply = request(worker.http_port, "POST", "/v2/models/mlp/infer", body)
    assert status == 400, reply
    assert "input_0" in reply["error"]
    assert peak_growth_mib(worker.proc.pid, before) < 2.5 * body_mib + SLACK_MIB
    still_serving(worker, fds)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_gzipped_number_list_is_bounded_by_what_it_inflates_to(worker):
    """64 KiB of gzip that inflates to 24 MiB of ``0,``: the count is checked on the inflated
    text, before decoding (bound: the inflated body, 1.5x, plus slack)."""
    count = 12 * MIB
    plain = number_list_body(count, [1, 16], number=b"0")
    packed = gzip(plain)
    assert len(packed) < 64 << 10
    before = reset_peak(worker.proc.pid)
    status, reply = request(
        worker.http_port,
        "POST",
        "/v2/models/mlp/infer",
        packed,
        headers={"Content-Encoding": "gzip"},
    )
    assert status == 400, reply
    assert f"has {count} elements in fp32_contents, expected 16" in reply["error"]
    assert peak_growth_mib(worker.proc.pid, before) < 1.5 * len(plain) / MIB + SLACK_MIB
    assert served(worker.http_port)


@pytest.mark.timeout(60)
def test_shape_and_element_mismatches_are_400_with_a_clear_message(worker):
    port = worker.http_port
    status, body = request(port, "POST", "/v2/models/mlp/infer", number_list_body(15, [1, 16]))
    assert (status, body) == (
        400,
        {
            "error": "input 'input_0' of model 'mlp' has 15 elements in fp32_contents, "
            "expected 16 (shape [1, 16])"
        },
    )
    mixed = (
        b'{"inputs":[{"name":"input_0","shape":[1,16],"datatype":"FP32",'
        b'"data":[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,[16]]]}]}'
    )
    status, body = request(port, "POST", "/v2/models/mlp/infer", mixed)
    assert status == 400 and "'data' mixes lists and values" in body["error"], body
    assert served(port)


@pytest.mark.timeout(60)
def test_an_endless_chunk_extension_is_400_at_once_and_costs_no_core(worker):
    fds = fd_count(worker.proc.pid)
    counted = metric(worker_metrics(worker), REFUSED, "chunk_extensions")
    chunk_extensions_are_bounded(worker.http_port, [worker.proc.pid])
    assert metric(worker_metrics(worker), REFUSED, "chunk_extensions") == counted + 2
    still_serving(worker, fds)


@pytest.mark.timeout(90)
def test_http11_host_targets_pipelining_and_h2c_upgrades(worker):
    fds = fd_count(worker.proc.pid)
    http11_rules_hold(worker.http_port)
    still_serving(worker, fds)
