"""``KServeModel`` construction: target forms, URL parsing, options and message caps."""

from __future__ import annotations

import pytest

from kserve_trio.client import KServeModel, RetryPolicy
from kserve_trio.client.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENV_MAX_RECV,
    ENV_MAX_SEND,
    parse_url,
    resolve_message_cap,
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("localhost:8001", ("localhost", 8001, False)),
        ("grpc://10.0.0.1:8001", ("10.0.0.1", 8001, False)),
        ("http://host:1", ("host", 1, False)),
        ("GRPCS://Host:443", ("host", 443, True)),
        ("https://h.example:8443/", ("h.example", 8443, True)),
        ("[::1]:8001", ("::1", 8001, False)),
        ("grpc://[fe80::1]:9", ("fe80::1", 9, False)),
        ("  host:65535 ", ("host", 65535, False)),
    ],
)
def test_parse_url_accepts(url, expected):
    assert parse_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "host",
        "host:",
        ":8001",
        "host:0",
        "host:65536",
        "ftp://host:1",
        "grpc://host",
        "host:80a",
        "grpc:/host:1",
        "a:b:c",
        "",
        "host:8001/path",
    ],
)
def test_parse_url_rejects(url):
    with pytest.raises(ValueError) as info:
        parse_url(url)
    assert str(info.value) == (f"invalid gRPC URL '{url}'; expected [grpc[s]|http[s]://]host:port")


def test_three_target_forms_agree():
    a = KServeModel("127.0.0.1:8001", "m")
    b = KServeModel("grpc://127.0.0.1:8001", "m")
    c = KServeModel("127.0.0.1", 8001, "m")
    d = KServeModel("127.0.0.1:8001", model_name="m")
    for m in (a, b, c, d):
        assert (m.host, m.port, m.model_name, m.secure) == ("127.0.0.1", 8001, "m", False)
    assert repr(a) == "KServeModel('grpc://127.0.0.1:8001', 'm')"


def test_secure_from_the_scheme_or_the_keyword():
    assert KServeModel("grpcs://h:1", "m").secure
    assert KServeModel("h", 1, "m", secure=True).secure
    assert KServeModel("h", 1, "m", secure=True).url == "grpcs://h:1"


def test_defaults():
    m = KServeModel("h:1", "m")
    assert m.max_batch_size == 1
    assert m.deadline == 10.0
    assert m.shared_memory == "auto"
    assert m.retry == RetryPolicy()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"shared_memory": "yes"},
            ValueError,
            "shared_memory must be 'auto', 'on' or 'off', got 'yes'",
        ),
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be an integer >= 1, got 0"),
        ({"max_batch_size": 2.5}, ValueError, "max_batch_size must be an integer >= 1, got 2.5"),
        ({"retry": "no"}, TypeError, "retry must be a RetryPolicy, got str"),
    ],
)
def test_invalid_options(kwargs, error, message):
    with pytest.raises(error) as info:
        KServeModel("h:1", "m", **kwargs)
    assert str(info.value) == message


def test_invalid_targets():
    with pytest.raises(ValueError, match="needs a non-empty model name, got None"):
        KServeModel("h:1")
    with pytest.raises(ValueError, match=r"needs a non-empty model name, got None"):
        KServeModel("h", 8001)
    with pytest.raises(ValueError, match=r"port 70000 is outside \[1, 65535\]"):
        KServeModel("h", 70000, "m")
    with pytest.raises(TypeError, match="a second model name was given"):
        KServeModel("h:1", "m", "n")
    with pytest.raises(ValueError, match="invalid gRPC URL 'h'"):
        KServeModel("h", "m")


def test_message_caps_default_env_and_keyword(monkeypatch):
    monkeypatch.delenv(ENV_MAX_SEND, raising=False)
    monkeypatch.delenv(ENV_MAX_RECV, raising=False)
    m = KServeModel("h:1", "m")
    assert m.max_send_message_length == m.max_receive_message_length == DEFAULT_MAX_MESSAGE_BYTES
    assert DEFAULT_MAX_MESSAGE_BYTES == 512 << 20
    monkeypatch.setenv(ENV_MAX_SEND, "1000")
    monkeypatch.setenv(ENV_MAX_RECV, " 2000 ")
    m = KServeModel("h:1", "m")
    assert (m.max_send_message_length, m.max_receive_message_length) == (1000, 2000)
    m = KServeModel("h:1", "m", max_send_message_length=10, max_receive_message_length=20)
    assert (m.max_send_message_length, m.max_receive_message_length) == (10, 20)


def test_env_var_names():
    assert ENV_MAX_SEND == "KSERVE_TRIO_CLIENT_GRPC_MAX_SEND_MSG_BYTES"
    assert ENV_MAX_RECV == "KSERVE_TRIO_CLIENT_GRPC_MAX_RECV_MSG_BYTES"


def test_malformed_caps_are_errors():
    with pytest.raises(
        ValueError, match=r"KSERVE_TRIO_CLIENT_GRPC_MAX_SEND_MSG_BYTES='big' is not an integer"
    ):
        resolve_message_cap(None, ENV_MAX_SEND, {ENV_MAX_SEND: "big"})
    with pytest.raises(ValueError, match=r"='-1' must be a positive number of bytes"):
        resolve_message_cap(None, ENV_MAX_RECV, {ENV_MAX_RECV: "-1"})
    with pytest.raises(ValueError, match="message size cap must be a positive integer, got 0"):
        resolve_message_cap(0, ENV_MAX_SEND, {})
    assert resolve_message_cap(None, ENV_MAX_SEND, {ENV_MAX_SEND: ""}) == DEFAULT_MAX_MESSAGE_BYTES
