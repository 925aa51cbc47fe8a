"""Memory per connection and per process against the CLI GATEWAY (in front of a CLI worker):
the attacks of ``test_memory_connections`` and ``test_memory_process`` (``memory_attacks``)
aimed at the gateway's gRPC port, and the gateway process measured (its ``/proc/<pid>``
status and descriptors, its ``gateway_edge_inflight_bytes`` gauge).

Each test checks that the gateway is alive, that it keeps forwarding a stock tritonclient
request to the worker while it is attacked and after, that its resident set stays within a
stated bound and does not grow from round to round (and, for the bombs and the window-0 clients,
comes back near where it started once the gateway is idle: its idle trim), that its descriptors
return to where they were, and that the attacker gets the documented error.

One worker and one gateway serve the module. The gateway has small bounds so each defence
shows in seconds: ``send_stall_seconds`` 1, ``message_receive_seconds`` 3, a 1 MiB connection
buffer, a 16 MiB message cap and 49 MiB of request bytes in flight (twelve 4 MiB partial
messages fill 48 MiB of it; the rest is room for the well-behaved client's small requests).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from h2.errors import ErrorCodes

from tests.edge.edge_procs import worker_and_gateway
from tests.edge.memory_attacks import (
    TAKEN_IN_BOUND,
    bombs_beside_traffic,
    inflight_bytes,
    never_reading_stream,
    partial_messages_round,
    serve_well,
    served_during,
    settle,
    window_zero_round,
)
from tests.edge.memory_probe import (
    MiB,
    fds,
    mlp_input,
    peak_rss,
    reset_peak,
    rss,
    rss_comes_back,
    trimmed_rss,
)
from tests.gateway.procs import Gateway, Worker
from tests.serving.bomb import zero_bomb
from tests.serving.grpc.h2_peer import grpc_frame
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

G = "KSERVE_TRIO_GATEWAY_"
STALL_SECONDS = 1.0
RECEIVE_SECONDS = 3.0
CONNECTION_BUFFER = 1 * MiB
MESSAGE_CAP = 16 * MiB
ANNOUNCED, PARTIAL = 4 * MiB, 3 * MiB
INFLIGHT = 12 * ANNOUNCED + 1 * MiB
CONCURRENCY = 256


@pytest.fixture(scope="module")
def servers(demo_repo: pathlib.Path) -> Iterator[tuple[Worker, Gateway]]:
    """A worker with room for every forwarded call, and the gateway under attack."""
    with worker_and_gateway(
        demo_repo,
        worker_env={"INFERENCE_SERVER_ENDPOINTS_MAX_CONCURRENT_REQUESTS": str(CONCURRENCY)},
        gateway_env={
            G + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": str(CONCURRENCY),
            G + "GRPC_MAX_RECV_MSG_BYTES": str(MESSAGE_CAP),
            G + "LIMITS_SEND_STALL_SECONDS": str(STALL_SECONDS),
            G + "LIMITS_MESSAGE_RECEIVE_SECONDS": str(RECEIVE_SECONDS),
            G + "LIMITS_MAX_CONNECTION_BUFFER_BYTES": str(CONNECTION_BUFFER),
            G + "LIMITS_MAX_INFLIGHT_BYTES": str(INFLIGHT),
            # Its idle trims, with the resident size each left, in its log.
            G + "LOGGING_LEVEL": "debug",
        },
    ) as pair:
        yield pair.worker, pair.gateway


def quiet(gateway: Gateway) -> tuple[int, int]:
    """The gateway at rest (nothing in flight): its pid and open descriptors."""
    settle(gateway)
    return gateway.proc.pid, fds(gateway.proc.pid)


def still_standing(worker: Worker, gateway: Gateway, pid: int, base_fds: int) -> None:
    """Both processes alive, the gateway's descriptors back to ``base_fds``."""
    assert gateway.alive(), gateway.logs()[-3000:]
    assert worker.alive(), worker.logs()[-3000:]
    wait_until(lambda: fds(pid) <= base_fds, 20, "the gateway's descriptors back to baseline")


# ------------------------------------------------------------------ a gzip bomb

BOMBS = 10
ROUNDS = 3
HELD_GROWTH = MESSAGE_CAP
"""How much more the gateway may hold after its last round than after its first, each read
right after its idle trim. What a trim leaves moves in steps of about 3 MiB from round to
round without growing: ten rounds beside a CPU burner left 57-67 MiB, in no order. A bomb's
compressed megabyte kept for good would add 20 MiB over the two rounds compared."""


@pytest.mark.timeout(120)
def test_a_gzip_bomb_to_the_gateway_costs_about_its_cap_and_others_are_forwarded(servers):
    """``ROUNDS`` rounds of ``BOMBS`` gzip bombs (1 GiB of zeros in 1 MiB) through the gateway, a
    tritonclient client forwarding mlp calls back to back beside them: each bomb is refused
    RESOURCE_EXHAUSTED by the gateway itself once its output passes the gateway's 16 MiB
    message cap (never inflated whole, never forwarded); the gateway's peak RSS rises
    by at most about twice the cap, calls are forwarded while bombs inflate, and what the
    gateway holds once its idle trim has run after a round does not grow from round to round
    and is within two messages' worth of where it started."""
    worker, gateway = servers
    bomb = grpc_frame(zero_bomb(1 << 30, "gzip"), flag=1)
    assert len(bomb) < 2 * MiB
    client = gateway.client()  # connected before the baseline: its connection stays open
    assert client.infer("mlp", [mlp_input()]).as_numpy("output").shape == (1, 8)
    pid, base_fds = quiet(gateway)
    start = rss(pid)
    grown: list[int] = []
    during: list[int] = []
    held: list[int] = []
    for _ in range(ROUNDS):
        round_began = len(gateway.logs())
        before = reset_peak(pid)
        bombs, served = bombs_beside_traffic(gateway.url, bomb, client, BOMBS)
        grown.append(peak_rss(pid) - before)
        during.append(len(served_during(bombs, served)))
        assert [(s, "received message larger than max" in m) for *_, s, m in bombs] == [
            (8, True)
        ] * BOMBS, bombs
        settle(gateway)
        still_standing(worker, gateway, pid, base_fds)
        held.append(trimmed_rss(gateway, round_began, "the gateway after gzip bombs"))
    client.close()
    print(
        "gateway gzip bomb: peak RSS growth per round",
        [g / MiB for g in grown],
        f"RSS {start / MiB:.1f} MiB before, trimmed after each round",
        [h / MiB for h in held],
        "forwarded during bombs",
        during,
    )
    # The output pieces up to the cap and one step beyond it, the compressed message's copies
    # (socket reads, its DATA frame, the message joined) and the allocator's own slack: under
    # twice the cap (a bomb inflated whole is 1 GiB). The first round's pieces are reused.
    for g in grown:
        assert g < 2 * MESSAGE_CAP + 8 * MiB, f"{g // MiB} MiB for a {MESSAGE_CAP // MiB} MiB cap"
    assert held[-1] - held[0] < HELD_GROWTH, [h / MiB for h in held]
    assert held[-1] - start < 2 * MESSAGE_CAP, f"{(held[-1] - start) / MiB:.1f} MiB kept"
    assert min(during) >= BOMBS // 2, during  # the bombs do not hold the event loop
    assert gateway.client().infer("mlp", [mlp_input()]).as_numpy("output").shape == (1, 8)


# ------------------------------------------------------------------ window-0 clients


@pytest.mark.timeout(120)
async def test_window_zero_clients_of_the_gateway_are_reset_and_leave_nothing_behind(servers):
    """Three rounds of two window-0 connections with 100 forwarded ModelInfer calls each: the
    worker answers, the gateway parks the replies it cannot send and resets every call
    RST_STREAM(CANCEL) after ``send_stall_seconds``; a tritonclient request through the gateway
    is served while they are parked; nothing is kept from round to round, and the RSS comes back
    within 64 MiB of the start once the gateway is idle."""
    worker, gateway = servers
    pid, base_fds = quiet(gateway)
    before = rss(pid)
    after: list[int] = []
    for _ in range(3):
        codes = await window_zero_round(gateway.port, lambda: serve_well(gateway))
        assert set(codes) == {ErrorCodes.CANCEL}, codes
        still_standing(worker, gateway, pid, base_fds)
        after.append(rss(pid))
    await serve_well(gateway)
    back = rss_comes_back(pid, before, "the gateway after window-0 rounds")
    print(
        f"gateway window-0: RSS {before / MiB:.1f} MiB, after rounds",
        [a / MiB for a in after],
        f"once idle {back / MiB:.1f} MiB",
    )
    assert after[2] - after[0] < 24 * MiB, [a // MiB for a in after]
    assert max(after) - before < 64 * MiB  # 200 parked replies of 2 KiB and their calls


# ------------------------------------------------------------------ a client that never reads


@pytest.mark.timeout(90)
async def test_a_streaming_client_of_the_gateway_that_never_reads_is_stopped_being_read(servers):
    """A ModelStreamInfer stream through the gateway whose replies are never read: the stream's
    outstanding requests, then the connection's buffer, stop the gateway reading it, so the
    client gets far less than its 64 MiB window in; the stalled stream is reset CANCEL. A
    tritonclient request through the gateway is served while the attacker writes. Two
    rounds: the resident set after the second is where the first left it."""
    worker, gateway = servers
    pid, base_fds = quiet(gateway)
    before = reset_peak(pid)
    after: list[int] = []
    peaks: list[int] = []
    for _ in range(2):
        sent, reset = await never_reading_stream(gateway.port, during=lambda: serve_well(gateway))
        assert sent < TAKEN_IN_BOUND, f"{sent // MiB} MiB taken in"
        assert reset == ErrorCodes.CANCEL
        settle(gateway)
        still_standing(worker, gateway, pid, base_fds)
        peaks.append(peak_rss(pid))
        after.append(rss(pid))
    await serve_well(gateway)
    print(
        f"gateway never-reading: RSS {before / MiB:.1f} MiB, peaks",
        [p / MiB for p in peaks],
        "after",
        [a / MiB for a in after],
    )
    # The 1 MiB buffer, the stream's 128 outstanding requests and their replies, the kernel's
    # socket buffers are not the gateway's.
    assert peaks[0] - before < 48 * MiB, f"{(peaks[0] - before) // MiB} MiB"
    assert after[1] - after[0] < 16 * MiB, [a // MiB for a in after]


# ------------------------------------------------------------------ partial messages


@pytest.mark.timeout(120)
async def test_partial_messages_to_the_gateway_hold_no_more_than_its_bytes_in_flight(servers):
    """Two rounds of 40 unary calls announcing 4 MiB and sending 3 MiB, then silent: at most
    ``INFLIGHT`` of them are charged (DEADLINE_EXCEEDED at ``message_receive_seconds``), the
    rest refused RESOURCE_EXHAUSTED; while the admitted ones hold the gateway's bytes in
    flight, a tritonclient request through the gateway (a few hundred bytes, in the room left)
    is forwarded and served."""
    worker, gateway = servers
    pid, base_fds = quiet(gateway)
    start = reset_peak(pid)
    held_during: list[float] = []

    async def during() -> None:
        held_during.append(inflight_bytes(gateway))
        await serve_well(gateway)
        held_during.append(inflight_bytes(gateway))

    peaks = []
    for _ in range(2):
        statuses = await partial_messages_round(
            gateway.port, RECEIVE_SECONDS, announced=ANNOUNCED, sent=PARTIAL, during=during
        )
        admitted = statuses.count(4)  # DEADLINE_EXCEEDED at message_receive_seconds
        refused = statuses.count(8)  # RESOURCE_EXHAUSTED: past the bytes in flight
        assert admitted + refused == 40 and admitted >= 1 and refused >= 1, statuses
        peaks.append(peak_rss(pid))
        settle(gateway)
        still_standing(worker, gateway, pid, base_fds)
    print(
        f"gateway partial messages: RSS {start / MiB:.1f} MiB, peaks",
        [p / MiB for p in peaks],
        "held during",
        [h / MiB for h in held_during],
    )
    # The good client was served while attackers' bytes were held, before and after its call.
    assert all(h >= ANNOUNCED for h in held_during), held_during
    held = peaks[0] - start
    # 3 MiB buffered for each admitted call and copies in passing; 40 x 3 MiB without a bound.
    assert held < INFLIGHT + 32 * MiB, f"{held // MiB} MiB"
    assert peaks[1] - peaks[0] < 16 * MiB, [p // MiB for p in peaks]
    await serve_well(gateway)
