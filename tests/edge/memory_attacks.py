"""The memory attacks of ``tests/edge/test_memory_*.py``, aimed at any gRPC port: the CLI
worker's, or the CLI gateway's in front of it (the same defences guard both; what differs is
the process measured and the metric prefix of its gauge).

Each attack is a raw HTTP/2 client (``tests.serving.grpc.h2_peer.Peer``) breaking a rule a gRPC
client keeps: window-0 connections whose replies can never be sent, a streaming client that
never reads its replies, partial messages that announce a length and go silent, and gzip bombs
sent beside a stock client. ``during`` hooks let a test serve a well-behaved client while the
attack holds the server.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import h2.settings
import tritonclient.grpc as grpcclient

from tests.edge.memory_probe import MiB, mlp_input, mlp_request_bytes, served_ok
from tests.gateway.procs import Gateway, Worker
from tests.serving.grpc.h2_peer import Peer, grpc_frame
from tests.waiting import wait_until
from tests.worker.raw_h2 import raw_grpc_call

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"

Server = Worker | Gateway
During = Callable[[], Coroutine[Any, Any, None]]
"""A coroutine function run while an attack holds the server (a well-behaved client)."""


def inflight_bytes(server: Server) -> float:
    """The process's ``worker_edge_inflight_bytes`` / ``gateway_edge_inflight_bytes`` gauge."""
    name = ("gateway" if isinstance(server, Gateway) else "worker") + "_edge_inflight_bytes "
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                return float(line.split()[1])
    raise AssertionError(f"no {name.strip()} in /metrics")


def settle(server: Server) -> None:
    """What earlier connections held is given back (the gauge is at 0 again)."""
    wait_until(lambda: inflight_bytes(server) == 0, 20, "the bytes in flight back at 0")


async def serve_well(server: Server) -> None:
    """A well-behaved tritonclient is served by ``server`` (in a thread: tritonclient blocks)."""
    assert await anyio.to_thread.run_sync(served_ok, server.client())


async def opened(peer: Peer) -> None:
    """Read the server's SETTINGS and WINDOW_UPDATE: its large windows are open to us."""
    with anyio.fail_after(10):
        await peer.until(lambda: peer.conn.outbound_flow_control_window > 1 << 20)


async def window_zero_round(port: int, during: During, calls: int = 100) -> list[int | None]:
    """Two connections announcing INITIAL_WINDOW_SIZE 0, each with ``calls`` ModelInfer calls
    whose replies can never be sent; ``during()`` runs while they are parked. The reset codes
    of every call."""
    body = grpc_frame(mlp_request_bytes(64))
    codes: list[int | None] = []
    settings = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    async with Peer.connect(port, settings) as a, Peer.connect(port, settings) as b:
        sids: dict[Peer, list[int]] = {}
        for peer in (a, b):
            await opened(peer)
            sids[peer] = []
            for _ in range(calls):
                sid = peer.open(INFER)
                peer.conn.send_data(sid, body, end_stream=True)
                sids[peer].append(sid)
            await peer.flush()
        await during()
        with anyio.fail_after(30):
            for peer in (a, b):
                await peer.until(lambda p=peer: all(p.replies[s].done for s in sids[p]))
                codes += [peer.replies[s].reset for s in sids[peer]]
    return codes


TAKEN_IN_BOUND = 40 * MiB
"""What a never-reading stream may get into a server, at most: the connection buffer, what the
server served before the stall reset it (at most its outstanding requests a turn, more on a
busy machine, where the reset comes later), and the kernel's socket buffers on both sides;
well below the 64 MiB its stream window lets in (63 MiB, 691,712 requests, before the bound)."""


async def never_reading_stream(
    port: int, limit: int = 64 * MiB, during: During | None = None
) -> tuple[int, int | None]:
    """A ModelStreamInfer stream that writes mlp requests as fast as the server takes them and
    never gives back the window of its replies, up to ``limit`` bytes or until the server
    stops reading for a second; ``during()`` runs beside the writes once the first batch is
    out. The bytes the server took in, and the stream's reset code."""
    message = grpc_frame(mlp_request_bytes(1))
    async with Peer.connect(port, manual_window=True) as peer, anyio.create_task_group() as tg:
        await opened(peer)
        sid = peer.open(STREAM)
        await peer.flush()
        sent = 0
        batch = message * 256
        while sent < limit and not peer.replies[sid].done:
            room = min(peer.conn.local_flow_control_window(sid), limit - sent)
            if room < len(batch):
                break
            peer.conn.send_data(sid, batch)
            with anyio.move_on_after(1) as write:  # the socket takes no more for a second
                await peer.flush()
            if write.cancelled_caught:
                break
            if not sent and during is not None:
                tg.start_soon(during)
            sent += len(batch)
        with anyio.fail_after(30):
            await peer.until(lambda: peer.replies[sid].done)
        reset = peer.replies[sid].reset
    return sent, reset


async def partial_messages_round(
    port: int,
    receive_seconds: float,
    *,
    calls: int = 40,
    announced: int = 4 * MiB,
    sent: int = 3 * MiB,
    during: During | None = None,
) -> list[int | None]:
    """``calls`` unary calls on one connection, each announcing an ``announced``-byte message
    and sending ``sent`` bytes of it, then silent; ``during()`` runs once every body is
    written. Their grpc-statuses."""
    head = grpc_frame(b"\0" * announced)[: 5 + sent]
    async with Peer.connect(port) as peer:
        sids = [peer.open(INFER) for _ in range(calls)]
        await peer.flush()
        for sid in sids:
            await peer.send_body(sid, head, end=False)
        if during is not None:
            await during()
        with anyio.fail_after(receive_seconds + 30):
            await peer.until(lambda: all(peer.replies[s].done for s in sids))
        return [peer.replies[s].status for s in sids]


BombReply = tuple[float, float, int | None, str]
"""A bomb's (sent at, answered at, grpc-status, grpc-message)."""


def bombs_beside_traffic(
    url: str, bomb: bytes, client: grpcclient.InferenceServerClient, count: int
) -> tuple[list[BombReply], list[float]]:
    """``count`` gzip bombs (``bomb``: a compressed gRPC message) sent one after the other to
    ``url`` from a thread while ``client`` sends mlp inferences back to back, each checked
    answered; the bombs' replies and when each inference was answered."""
    bombs: list[BombReply] = []

    def send_bombs() -> None:
        for _ in range(count):
            started = time.monotonic()
            reply = raw_grpc_call(
                url, INFER, bomb, headers=(("grpc-encoding", "gzip"),), timeout=60
            )
            bombs.append((started, time.monotonic(), reply.status, reply.message))

    sender = threading.Thread(target=send_bombs)
    sender.start()
    served: list[float] = []
    try:
        while sender.is_alive():
            result = client.infer("mlp", [mlp_input()], client_timeout=30)
            output = result.as_numpy("output") if result is not None else None
            assert output is not None and output.shape == (1, 8)
            served.append(time.monotonic())
    finally:
        sender.join()
    return bombs, served


def served_during(bombs: list[BombReply], served: list[float]) -> list[float]:
    """The inferences answered while some bomb was in flight."""
    return [t for t in served if any(start < t < end for start, end, *_ in bombs)]


__all__ = [
    "INFER",
    "STREAM",
    "BombReply",
    "During",
    "Server",
    "bombs_beside_traffic",
    "inflight_bytes",
    "never_reading_stream",
    "opened",
    "partial_messages_round",
    "serve_well",
    "served_during",
    "settle",
    "window_zero_round",
]
