"""Memory per connection and per process against the CLI worker, from raw HTTP/2 clients that
break the rules a gRPC client keeps: a window-0 client, a streaming client that never reads
its replies, streams whose messages stop half-way, and messages that hold the process's bytes
in flight while others arrive.

One worker serves the module with small bounds so each defence shows in seconds:
``send_stall_seconds`` 1, ``message_receive_seconds`` 2, a 1 MiB connection buffer, 48 MiB of
request bytes in flight and a 32 MiB message cap.
"""

from __future__ import annotations

import contextlib
import queue
import time

import anyio
import pytest
import tritonclient.grpc as grpcclient
from h2.errors import ErrorCodes

from tests.edge.memory_attacks import (
    TAKEN_IN_BOUND,
    inflight_bytes,
    never_reading_stream,
    opened,
    partial_messages_round,
    serve_well,
    settle,
    window_zero_round,
)
from tests.edge.memory_probe import MiB, fds, mlp_input, peak_rss, rss, rss_comes_back
from tests.gateway.procs import Worker
from tests.ports import free_port
from tests.serving.grpc.h2_peer import Peer, grpc_frame
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

INFER = "/inference.GRPCInferenceService/ModelInfer"
L = "INFERENCE_SERVER_LIMITS_"
STALL_SECONDS = 1.0
RECEIVE_SECONDS = 4.0  # long enough to send a holder its 48 MiB before it expires
CONNECTION_BUFFER = 1 * MiB
INFLIGHT = 48 * MiB
MESSAGE_CAP = 32 * MiB


@pytest.fixture(scope="module")
def worker(demo_repo):
    w = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        metrics_port=free_port(),
        env={
            L + "SEND_STALL_SECONDS": str(STALL_SECONDS),
            L + "MESSAGE_RECEIVE_SECONDS": str(RECEIVE_SECONDS),
            L + "MAX_CONNECTION_BUFFER_BYTES": str(CONNECTION_BUFFER),
            L + "MAX_INFLIGHT_BYTES": str(INFLIGHT),
            "INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES": str(MESSAGE_CAP),
            "INFERENCE_SERVER_ENDPOINTS_MAX_CONCURRENT_REQUESTS": "256",
        },
    )
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()


# ------------------------------------------------------------------ announcements


@pytest.mark.timeout(120)
async def test_silent_announcers_hold_nothing_and_every_other_client_is_served(worker):
    """Streams announcing messages at the cap (a 5-byte prefix, then nothing) on several
    connections: none of it is charged, so tritonclient's unary calls and a stream are served
    with no error meanwhile; the announcers meet their receive deadline."""
    settle(worker)
    async with contextlib.AsyncExitStack() as stack:
        silent = [await stack.enter_async_context(Peer.connect(worker.port)) for _ in range(4)]
        sids = []
        for peer in silent:
            await opened(peer)
            for _ in range(4):
                sid = peer.open(INFER)
                peer.conn.send_data(sid, grpc_frame(b"")[:1] + MESSAGE_CAP.to_bytes(4, "big"))
                sids.append((peer, sid))
            await peer.flush()

        def served() -> list[str]:
            client = worker.client()
            outcomes = []
            for _ in range(5):
                try:
                    client.infer("mlp", [mlp_input()], client_timeout=30)
                    outcomes.append("OK")
                except grpcclient.InferenceServerException as exc:
                    outcomes.append(f"{exc.status()} {exc.message()}")
            return outcomes

        assert await anyio.to_thread.run_sync(served) == ["OK"] * 5
        assert inflight_bytes(worker) < MiB
        with anyio.fail_after(RECEIVE_SECONDS + 30):
            for peer, sid in sids:
                await peer.until(lambda peer=peer, sid=sid: peer.replies[sid].done)
        assert {peer.replies[sid].status for peer, sid in sids} == {4}  # the receive deadline
    settle(worker)


# ------------------------------------------------------------------ window-0 clients


@pytest.mark.timeout(120)
async def test_window_zero_clients_are_reset_and_leave_nothing_behind(worker):
    pid = worker.proc.pid
    settle(worker)
    base_fds = fds(pid)
    before = rss(pid)
    after: list[int] = []
    for _ in range(3):
        codes = await window_zero_round(worker.port, lambda: serve_well(worker))
        assert set(codes) == {ErrorCodes.CANCEL}, codes  # reset after send_stall_seconds
        wait_until(lambda: fds(pid) <= base_fds, 20, "descriptors back to the baseline")
        after.append(rss(pid))
    await serve_well(worker)
    assert worker.alive()
    # Rounds two and three reuse what round one took; nothing is kept per round.
    assert after[2] - after[0] < 24 * MiB, [a // MiB for a in after]
    assert max(after) - before < 64 * MiB  # 200 parked replies of 2 KiB and their calls
    back = rss_comes_back(pid, before, "the worker after window-0 rounds")
    print(
        f"worker window-0: RSS {before / MiB:.1f} MiB, after rounds",
        [a / MiB for a in after],
        f"once idle {back / MiB:.1f} MiB",
    )


# ------------------------------------------------------------------ a client that never reads


@pytest.mark.timeout(60)
async def test_a_streaming_client_that_never_reads_is_stopped_being_read(worker):
    """Its replies fill its own window (it never gives it back), the stream's requests pile
    up, the connection's buffer fills and the server stops reading the socket: what the client
    gets in stays bounded by the buffer and the kernel's socket buffers, far below the 64 MiB
    stream window; the stalled stream is then reset and the process serves on."""
    settle(worker)
    sent, reset = await never_reading_stream(worker.port)
    assert sent < TAKEN_IN_BOUND, f"{sent // MiB} MiB taken in"
    assert reset == ErrorCodes.CANCEL
    settle(worker)
    await serve_well(worker)


# ------------------------------------------------------------------ partial messages


@pytest.mark.timeout(120)
async def test_partial_messages_hold_no_more_than_the_bytes_in_flight(worker):
    pid = worker.proc.pid
    settle(worker)
    start_rss = rss(pid)
    peaks = []
    for _ in range(2):
        statuses = await partial_messages_round(worker.port, RECEIVE_SECONDS)
        admitted = statuses.count(4)  # DEADLINE_EXCEEDED at message_receive_seconds
        refused = statuses.count(8)  # RESOURCE_EXHAUSTED: past the bytes in flight
        # At most INFLIGHT / 4 MiB are admitted at a time (more in all when the first ones'
        # deadlines pass while the last ones are still being sent).
        assert admitted + refused == 40 and admitted >= 1 and refused >= 1, statuses
        peaks.append(peak_rss(pid))
        settle(worker)
    held = peaks[0] - start_rss
    # 3 MiB buffered for each admitted call, and copies in passing; 40 x 3 MiB without a bound.
    assert held < INFLIGHT + 32 * MiB, f"{held // MiB} MiB"
    assert peaks[1] - peaks[0] < 16 * MiB, [p // MiB for p in peaks]
    await serve_well(worker)


# ------------------------------------------------------------------ bytes in flight


@pytest.mark.timeout(60)
async def test_over_the_bytes_in_flight_a_unary_call_is_refused_and_a_stream_waits(worker):
    settle(worker)
    async with Peer.connect(worker.port) as holder:
        await opened(holder)
        sids = []
        for size in (30 * MiB, INFLIGHT - 30 * MiB):  # together: the whole cap, once sent
            sid = holder.open(INFER)
            await holder.flush()
            # all of the message but its last 5 bytes: what has arrived is what is charged
            await holder.send_body(sid, grpc_frame(b"\0" * size)[:size], end=False)
            sids.append(sid)
        wait_until(lambda: inflight_bytes(worker) >= INFLIGHT - 10, 20, "the holders charged")

        def unary() -> str:
            try:
                worker.client().infer("mlp", [mlp_input()], client_timeout=30)
            except grpcclient.InferenceServerException as exc:
                return f"{exc.status()} {exc.message()}"
            return "OK"

        refused = await anyio.to_thread.run_sync(unary)
        assert refused.startswith("StatusCode.RESOURCE_EXHAUSTED"), refused
        assert "in-flight bytes cap" in refused

        answers: queue.Queue = queue.Queue()
        client = worker.client()
        client.start_stream(callback=lambda result, error: answers.put((time.monotonic(), error)))
        try:
            client.async_stream_infer("mlp", [mlp_input()], request_id="waits")
            with anyio.fail_after(RECEIVE_SECONDS + 30):
                await holder.until(lambda: all(holder.replies[s].done for s in sids))
            holders_done = time.monotonic()
            answered, error = await anyio.to_thread.run_sync(lambda: answers.get(timeout=30))
        finally:
            client.stop_stream()
        assert error is None, error
        assert [holder.replies[s].status for s in sids] == [4, 4]  # the receive deadline
        assert answered >= holders_done - 0.5  # it waited for the holders' bytes to go
    settle(worker)
