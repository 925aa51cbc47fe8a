"""``endpoints.tls`` applies to the REST port: an in-process worker with a throwaway CA serves
HTTPS (mutual TLS when a client CA is set) and refuses plaintext; stop() closes the port."""

from __future__ import annotations

import http.client
import json
import socket
import ssl

import pytest

from kserve_trio.worker.server import serve, stop
from tests.client.test_tls import pki  # noqa: F401  (the session's throwaway PKI)
from tests.ports import free_port


def start(demo_repo, pki, *, mutual: bool):  # noqa: F811
    tls = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key")}
    if mutual:
        tls["client_ca_file"] = str(pki / "ca.pem")
    return serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        models_include=["scale4"],
        model_control_mode="static",
        endpoints={"port": 0, "http_port": free_port(), "tls": tls},
    )


def context(pki, *, client_cert: bool) -> ssl.SSLContext:  # noqa: F811
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return ctx


def get(port: int, path: str, ctx: ssl.SSLContext) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_https_only_with_server_tls(demo_repo, pki):  # noqa: F811
    running = start(demo_repo, pki, mutual=False)
    port = running.http_port
    try:
        assert port and port != running.port
        assert get(port, "/v2/health/ready", context(pki, client_cert=False)) == (
            200,
            {"ready": True},
        )
        conn = http.client.HTTPSConnection(
            "127.0.0.1", port, context=context(pki, client_cert=False), timeout=10
        )
        body = json.dumps(
            {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
        )
        conn.request("POST", "/v2/models/scale4/infer", body=body)
        reply = json.loads(conn.getresponse().read())
        assert reply["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
        conn.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            assert not sock.recv(100).startswith(b"HTTP/1.1 200")  # plaintext is not served
        assert get(port, "/v2/health/live", context(pki, client_cert=False))[0] == 200
    finally:
        stop(running)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_mutual_tls_needs_a_client_certificate(demo_repo, pki):  # noqa: F811
    running = start(demo_repo, pki, mutual=True)
    try:
        port = running.http_port
        assert get(port, "/v2", context(pki, client_cert=True))[1]["name"] == "kserve_trio"
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            get(port, "/v2", context(pki, client_cert=False))
    finally:
        stop(running)
