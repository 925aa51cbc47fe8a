"""A CLI worker and a CLI gateway in front of it, for the name, status and restricted-protocol
tests of the edge defences (``tests/gateway/procs.py`` runs them), and the probes those tests
share: the process's memory, a raw gRPC call, a REST request."""

from __future__ import annotations

import contextlib
import http.client
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port


@dataclass
class Pair:
    """A worker (gRPC and REST) and a gateway (gRPC and REST) routing to it."""

    worker: Worker
    worker_http: int
    gateway: Gateway
    gateway_http: int


@contextlib.contextmanager
def worker_and_gateway(
    repo: pathlib.Path,
    *,
    worker_env: dict[str, str] | None = None,
    gateway_env: dict[str, str] | None = None,
) -> Iterator[Pair]:
    """Start both (the gateway once the worker is ready), stop both afterwards."""
    worker_http = free_port()
    worker = Worker(
        repo,
        "127.0.0.1",
        free_port(),
        models="mlp",
        env={"INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": str(worker_http), **(worker_env or {})},
    )
    gateway = None
    try:
        worker.wait_ready(120)
        gateway_http = free_port()
        gateway = Gateway(
            repo.parent,
            {
                "KSERVE_TRIO_GATEWAY_WORKERS": worker.url,
                "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{gateway_http}",
                **(gateway_env or {}),
            },
        )
        gateway.wait_ready(60)
        yield Pair(worker, worker_http, gateway, gateway_http)
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def raw_call(
    url: str, method: str, body: bytes, metadata: tuple = (), timeout: float = 30.0
) -> tuple[grpc.StatusCode, str, float]:
    """One unary call with ``body`` as the request bytes: its status, message and seconds."""
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        fn = ch.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
        started = time.monotonic()
        try:
            fn(body, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", time.monotonic() - started  # type: ignore[attr-defined]
        return grpc.StatusCode.OK, "", time.monotonic() - started


def rest(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    """One REST request on loopback: its status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()
