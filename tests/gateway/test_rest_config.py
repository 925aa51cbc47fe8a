"""``worker_http_endpoints``: the workers' REST addresses the gateway forwards model requests to.

Configuration (YAML key, ``KSERVE_TRIO_GATEWAY_WORKER_HTTP_ENDPOINTS``, validation) and
discovery (each worker behind a name takes the REST address equal to its own), and the pure
parts of the forwarding: headers passed on and back, the status the failover rules read, the
shape peeked from a REST body.
"""

from __future__ import annotations

import json
import re

import pytest

from kserve_trio.core.errors import ConfigError, StatusCode
from kserve_trio.gateway.config import gateway_config_to_raw, load_gateway_config
from kserve_trio.gateway.fleet.discovery import Discovery, expand_workers
from kserve_trio.gateway.request_path.rest_forward import (
    forwarded_headers,
    peek_shape,
    reply_headers,
    reply_status,
)
from tests.gateway.test_discovery import FakeDns

G = "KSERVE_TRIO_GATEWAY_"
TWO = {G + "WORKERS": "127.0.0.1:9001,127.0.0.1:9002"}


def config_error(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_gateway_config(env=env)
    return info.value


def test_the_environment_sets_them_index_aligned_with_the_workers():
    env = {**TWO, G + "WORKER_HTTP_ENDPOINTS": " 127.0.0.1:8001 , 127.0.0.1:8002 "}
    cfg = load_gateway_config(env=env).config
    assert cfg.worker_http_endpoints == ("127.0.0.1:8001", "127.0.0.1:8002")
    assert gateway_config_to_raw(cfg)["worker_http_endpoints"] == list(cfg.worker_http_endpoints)
    assert load_gateway_config(env=TWO).config.worker_http_endpoints == ()  # off by default


def test_the_yaml_key(tmp_path):
    f = tmp_path / "gateway.yml"
    f.write_text("endpoints: [w:9001]\nworker_http_endpoints: [w:8000]\n")
    assert load_gateway_config(f, env={}).config.worker_http_endpoints == ("w:8000",)


@pytest.mark.parametrize(
    ("http", "path", "message"),
    [
        ("127.0.0.1:8001", "worker_http_endpoints", r"one entry per endpoints entry.*got 1 for 2"),
        ("127.0.0.1:8001,nope,x:1", "worker_http_endpoints", r"got 3 for 2"),
        ("127.0.0.1:8001,nope", "worker_http_endpoints[1]", r"host:port"),
        ("127.0.0.1:8001,127.0.0.1:9002", "worker_http_endpoints[1]", r"is endpoints\[1\] itself"),
        ("127.0.0.1:8001,127.0.0.1:8001", "worker_http_endpoints[1]", r"repeats .*\[0\]"),
    ],
)
def test_bad_lists_fail_naming_the_entry(http, path, message):
    exc = config_error({**TWO, G + "WORKER_HTTP_ENDPOINTS": http})
    assert exc.path == path
    assert re.search(message, exc.message), exc.message


def test_an_endpoint_listed_twice_is_ambiguous_with_rest_endpoints_aligned():
    env = {G + "WORKERS": "w:1,w:1", G + "WORKER_HTTP_ENDPOINTS": "w:2,w:3"}
    exc = config_error(env)
    assert exc.path == "endpoints[1]" and "worker_http_endpoints" in exc.message


def test_workers_behind_one_name_each_take_their_own_rest_address():
    workers = expand_workers(
        [("pods", 9001), ("static", 9001)],
        [["10.0.0.2", "10.0.0.1"], ["10.0.1.1"]],
        http=[("pods", 8000), ("proxy", 7000)],
        http_resolved=[["10.0.0.1", "10.0.0.2"], ["10.0.9.9"]],
    )
    assert [(w.target, w.http_target) for w in workers] == [
        ("10.0.0.1:9001", "10.0.0.1:8000"),
        ("10.0.0.2:9001", "10.0.0.2:8000"),
        ("10.0.1.1:9001", "10.0.9.9:7000"),  # another host: paired by position
    ]
    (alone,) = expand_workers([("w", 1)], [["10.0.0.1"]])
    assert alone.http is None and alone.http_target is None


@pytest.mark.anyio
async def test_discovery_resolves_the_rest_entries_each_round():
    dns = FakeDns({"pods.test": ["127.0.0.1", "127.0.0.2"]})
    discovery = Discovery(["pods.test:9001"], http=["pods.test:8000"], resolver=dns)
    first = await discovery.refresh()
    assert [w.http_target for w in first.workers] == ["127.0.0.1:8000", "127.0.0.2:8000"]
    dns.table["pods.test"] = ["127.0.0.2", "127.0.0.3"]
    second = await discovery.refresh()
    assert [w.http_target for w in second.workers] == ["127.0.0.2:8000", "127.0.0.3:8000"]
    assert sorted(dns.calls) == sorted([("pods.test", 9001), ("pods.test", 8000)] * 2)


def test_end_to_end_headers_go_on_and_come_back_hop_by_hop_ones_do_not():
    sent = forwarded_headers(
        {
            "host": "gateway:8000",
            "content-length": "10",
            "connection": "keep-alive",
            "transfer-encoding": "chunked",
            "expect": "100-continue",
            "inference-header-content-length": "7",
            "content-type": "application/octet-stream",
            "content-encoding": "gzip",
            "accept-encoding": "gzip",
            "x-request-tag": "t1",
        }
    )
    assert sent == {
        "inference-header-content-length": "7",
        "content-type": "application/octet-stream",
        "content-encoding": "gzip",
        "accept-encoding": "gzip",
        "x-request-tag": "t1",
    }
    content_type, back = reply_headers(
        [
            (b"Content-Type", b"application/octet-stream"),
            (b"Content-Length", b"99"),
            (b"Inference-Header-Content-Length", b"42"),
            (b"Content-Encoding", b"gzip"),
            (b"Connection", b"close"),
        ]
    )
    assert content_type == "application/octet-stream"
    assert back == (("inference-header-content-length", "42"), ("content-encoding", "gzip"))


def test_a_workers_rest_status_is_read_as_the_grpc_status_it_stands_for():
    def body(message: str) -> bytes:
        return json.dumps({"error": message}).encode()

    assert reply_status(404, body("unknown model: m")) is StatusCode.NOT_FOUND
    assert reply_status(503, b"") is StatusCode.UNAVAILABLE
    assert reply_status(429, body("busy")) is StatusCode.RESOURCE_EXHAUSTED
    assert reply_status(400, body("bad shape")) is StatusCode.INVALID_ARGUMENT
    stale = body("unregistered shared memory region: r1")
    assert reply_status(400, stale) is StatusCode.FAILED_PRECONDITION  # the replay signal
    assert reply_status(400, b"not json") is StatusCode.INVALID_ARGUMENT
    assert reply_status(500, b"") is StatusCode.INTERNAL


def test_the_batch_inputs_shape_is_peeked_from_the_json_head_only():
    head = json.dumps({"inputs": [{"name": "a", "shape": [1]}, {"name": "x", "shape": [5, 16]}]})
    body = head.encode() + b"\x00\xff binary tail"
    assert peek_shape(body, len(head), "x") == (5, 16)
    assert peek_shape(head.encode(), None, "x") == (5, 16)
    assert peek_shape(head.encode(), None, "missing") is None
    assert peek_shape(b"{not json", None, "x") is None  # the worker answers it
    assert peek_shape(b'{"inputs": [{"name": "x", "shape": "no"}]}', None, "x") is None
