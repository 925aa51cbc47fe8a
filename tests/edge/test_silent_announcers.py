"""Silent announcers against every server process class, on gRPC and REST at once: a CLI
worker, a worker with two front-end processes, and a gateway in front of a worker.

gRPC streams announce a message at the cap (a 5-byte prefix, nothing more) and REST POSTs
announce a body at the cap (``Content-Length``, one byte of body), all held open, while
tritonclient (gRPC) and a REST client keep being served with no error; the bytes-in-flight
gauge shows the announcers hold what arrived (a byte per REST body), not what they announced;
a ``Content-Length`` past the body cap is 413 at once and its connection closed.

Each server has 8 MiB of bytes in flight, a 32 MiB message cap (the announcers together
announce 32 times the budget) and a 30 s receive deadline, so the announcers stay for the
whole test.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import anyio
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from tests.edge.memory_probe import MiB, mlp_input
from tests.edge.rest_peer import good_infer_body, read_reply, request
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port
from tests.serving.grpc.h2_peer import Peer, grpc_frame

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

INFER = "/inference.GRPCInferenceService/ModelInfer"
REST_INFER = "/v2/models/mlp/infer"
INFLIGHT = 8 * MiB
MESSAGE_CAP = 32 * MiB
RECEIVE_SECONDS = 30.0
ANNOUNCERS = 4
"""Connections of each kind; each gRPC one opens 4 streams."""


class Target:
    """One server class under test: its gRPC address, REST port and bytes-in-flight gauge."""

    def __init__(self, name: str, grpc_port: int, http_port: int, metrics_url: str) -> None:
        self.name, self.grpc_port, self.http_port = name, grpc_port, http_port
        self.metrics_url = metrics_url
        self.gauge = ("gateway" if name == "gateway" else "worker") + "_edge_inflight_bytes"

    def inflight(self) -> float:
        """The gauge, summed over the process's front ends (each has its own budget)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == self.gauge
        )


def limits(prefix: str) -> dict[str, str]:
    return {
        f"{prefix}LIMITS_MAX_INFLIGHT_BYTES": str(INFLIGHT),
        f"{prefix}LIMITS_MESSAGE_RECEIVE_SECONDS": str(RECEIVE_SECONDS),
        f"{prefix}GRPC_MAX_RECV_MSG_BYTES": str(MESSAGE_CAP),
    }


def worker(demo_repo, http_port: int, env: dict[str, str]) -> Worker:
    return Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        metrics_port=free_port(),
        env={
            "INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": str(http_port),
            **limits("INFERENCE_SERVER_"),
            **env,
        },
    )


@pytest.fixture(scope="module", params=["worker", "frontends", "gateway"])
def target(request, demo_repo, tmp_path_factory) -> Iterator[Target]:
    http_port = free_port()
    with contextlib.ExitStack() as stack:
        if request.param == "gateway":
            behind = worker(demo_repo, free_port(), {})
            stack.callback(behind.stop)
            behind.wait_ready()
            env = {
                "KSERVE_TRIO_GATEWAY_WORKERS": behind.url,
                "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{http_port}",
                **limits("KSERVE_TRIO_GATEWAY_"),
            }
            gateway = Gateway(tmp_path_factory.mktemp("gateway"), env)
            stack.callback(gateway.stop)
            gateway.wait_ready()
            metrics = f"http://127.0.0.1:{gateway.metrics_port}/metrics"
            yield Target("gateway", gateway.port, http_port, metrics)
            assert gateway.alive(), gateway.logs()
            return
        extra = {"INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES": "2"}
        w = worker(demo_repo, http_port, extra if request.param == "frontends" else {})
        stack.callback(w.stop)
        w.wait_ready()
        metrics = f"http://127.0.0.1:{w.metrics_port}/metrics"
        yield Target(request.param, w.port, http_port, metrics)
        assert w.alive(), w.logs()


def rest_head(length: int) -> bytes:
    return (
        f"POST {REST_INFER} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def settles(target: Target, most: float, what: str) -> None:
    """Until the gauge is at most ``most`` (what earlier requests held is given back)."""
    deadline = time.monotonic() + 20
    while (seen := target.inflight()) > most:
        assert time.monotonic() < deadline, (what, seen)
        time.sleep(0.02)


@pytest.mark.timeout(180)
async def test_silent_announcers_hold_what_arrived_and_every_other_client_is_served(
    target: Target,
):
    await anyio.to_thread.run_sync(settles, target, 0, "the gauge at 0 before")
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(ANNOUNCERS):
            peer = await stack.enter_async_context(Peer.connect(target.grpc_port))
            await peer.until(lambda peer=peer: peer.conn.outbound_flow_control_window > MiB)
            for _ in range(4):
                sid = peer.open(INFER)
                peer.conn.send_data(sid, grpc_frame(b"")[:1] + MESSAGE_CAP.to_bytes(4, "big"))
            await peer.flush()
        for _ in range(ANNOUNCERS):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", target.http_port)))
            sock.sendall(rest_head(MESSAGE_CAP) + b"{")

        def served() -> list[str]:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{target.grpc_port}")
            outcomes = []
            for _ in range(5):
                try:
                    client.infer("mlp", [mlp_input()], client_timeout=30)
                    outcomes.append("OK")
                except grpcclient.InferenceServerException as exc:
                    outcomes.append(f"{exc.status()} {exc.message()}")
                status, body = request(target.http_port, "POST", REST_INFER, good_infer_body())
                outcomes.append("OK" if status == 200 else f"{status} {body[:200]!r}")
            return outcomes

        assert await anyio.to_thread.run_sync(served) == ["OK"] * 10
        # what the announcers hold: the byte each REST body sent, nothing of what they announced
        assert await anyio.to_thread.run_sync(target.inflight) <= ANNOUNCERS

        def beyond_the_cap() -> tuple[int, bytes, bytes]:
            with socket.create_connection(("127.0.0.1", target.http_port), timeout=30) as sock:
                sock.sendall(rest_head(MESSAGE_CAP + 1))
                status, body = read_reply(sock, time.monotonic() + 10)
                sock.settimeout(10)
                return status, body, sock.recv(1)  # b"": closed, its body will not be read

        status, body, after = await anyio.to_thread.run_sync(beyond_the_cap)
        assert (status, after) == (413, b""), body
        message = f"received message larger than max ({MESSAGE_CAP + 1} vs. {MESSAGE_CAP})"
        assert json.loads(body) == {"error": message}
    await anyio.to_thread.run_sync(settles, target, 0, "the announcers gone")
