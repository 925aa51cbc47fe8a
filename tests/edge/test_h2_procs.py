"""The HTTP/2 frame-level defences of the real processes: the CLI worker (demo repository, mlp)
and the CLI gateway in front of it, each attacked on its gRPC port by raw clients
(``h2_attacker.Attacker``) with small limits set through the environment
(``INFERENCE_SERVER_LIMITS_*`` / ``KSERVE_TRIO_GATEWAY_LIMITS_*``).

Each attack checks what the attacker gets (the GOAWAY code and debug data, REFUSED_STREAM, the
close), that the process is alive and serves a stock ``tritonclient.grpc`` request after it,
and where memory is the point, the process's resident set (``/proc/<pid>/status``): bounded
while the attack runs, and not growing from round to round.

The two processes start once for the module; every test attacks both."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from h2.errors import ErrorCodes

from kserve_trio.proto import inference as pb
from tests.edge.h2_attacker import (
    Attacker,
    continuation,
    data,
    grpc_message,
    ping,
    priority,
    raw_frame,
    rst,
    settings,
    window_update,
)
from tests.gateway.procs import Gateway, Proc, Worker
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

CALM = int(ErrorCodes.ENHANCE_YOUR_CALM)
MiB = 1 << 20
LIMITS = {
    "HANDSHAKE_SECONDS": "1",
    "IDLE_SECONDS": "2",
    "PREMATURE_RESET_MIN_STREAMS": "50",
    "MAX_CONTROL_FRAMES_PER_SECOND": "500",
    "MIN_PING_INTERVAL_SECONDS": "1",
    "MAX_PING_STRIKES": "2",
    # Every attacker here and the well-behaved client share 127.0.0.1, and each test judges
    # one connection's defence: probation of the address (tests/edge/test_h2_server.py) off.
    "PEER_PROBATION_SECONDS": "0",
}
WORKER_STREAMS, GATEWAY_STREAMS = 32, 16


@dataclass
class Target:
    """One process under attack: its name, gRPC port, process and metrics text."""

    name: str
    port: int
    proc: Proc
    metrics_url: str
    streams: int

    @property
    def pid(self) -> int:
        return self.proc.proc.pid

    def memory(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in bytes."""
        status = pathlib.Path(f"/proc/{self.pid}/status").read_text()
        values = {
            k: int(v.split()[0]) << 10 for k, v in re.findall(r"(VmRSS|VmHWM):\s+(.*)", status)
        }
        return values["VmRSS"], values["VmHWM"]

    def fds(self) -> int:
        return len(list(pathlib.Path(f"/proc/{self.pid}/fd").iterdir()))

    def fds_back_to(self, baseline: int, timeout: float = 15.0) -> None:
        """Wait until the open descriptors are down to ``baseline``; past ``timeout``, the
        failure names those still open."""
        try:
            wait_until(lambda: self.fds() <= baseline, timeout, f"descriptors back to {baseline}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {sorted(self.fd_targets())}") from None

    def fd_targets(self) -> list[str]:
        """What each open descriptor is (a socket, a pipe, a file)."""
        found = []
        for fd in pathlib.Path(f"/proc/{self.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                found.append(os.readlink(fd))
        return found

    def counter_sum(self, name: str) -> float:
        """Every labelled series of one ``<prefix>_edge_<name>`` counter, summed."""
        prefix = "worker" if self.name == "worker" else "gateway"
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        found = re.findall(rf"^{prefix}_edge_{name}_total{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        return sum(float(v) for v in found)

    def counter(self, name: str, label: str = "") -> float:
        """One ``<prefix>_edge_<name>`` counter (with ``label``: that labelled series)."""
        prefix = "worker" if self.name == "worker" else "gateway"
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        pattern = (
            rf'^{prefix}_edge_{name}_total{{[^}}]*"{label}"}} (\S+)$'
            if label
            else (rf"^{prefix}_edge_{name}_total (\S+)$")
        )
        found = re.search(pattern, text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def served(self) -> None:
        """A stock tritonclient request is answered, and the process is alive."""
        assert self.proc.alive(), self.proc.logs()[-3000:]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        try:
            x = np.ones((2, 16), dtype=np.float32)
            inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer("mlp", [inp], client_timeout=30)
            assert result is not None
            output = result.as_numpy("output")
            assert output is not None and len(output) == 2, output
        finally:
            client.close()


@pytest.fixture(scope="module")
def targets(
    demo_repo: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Target]]:
    work = tmp_path_factory.mktemp("edge_h2")
    port, mport = free_port(), free_port()
    w = "INFERENCE_SERVER_LIMITS_"
    worker_env = {w + k: v for k, v in LIMITS.items()}
    worker_env[w + "MAX_CONCURRENT_STREAMS"] = str(WORKER_STREAMS)
    worker = Worker(demo_repo, "127.0.0.1", port, metrics_port=mport, env=worker_env)
    gateway = None
    try:
        worker.wait_ready()
        g = "KSERVE_TRIO_GATEWAY_"
        gateway_env = {g + "LIMITS_" + k: v for k, v in LIMITS.items()}
        gateway_env[g + "LIMITS_MAX_CONCURRENT_STREAMS"] = str(GATEWAY_STREAMS)
        gateway_env[g + "WORKERS"] = worker.url
        gateway = Gateway(work, gateway_env)
        gateway.wait_ready()
        yield {
            "worker": Target(
                "worker", port, worker, f"http://127.0.0.1:{mport}/metrics", WORKER_STREAMS
            ),
            "gateway": Target(
                "gateway",
                gateway.port,
                gateway,
                f"http://127.0.0.1:{gateway.metrics_port}/metrics",
                GATEWAY_STREAMS,
            ),
        }
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def infer_body(rows: int = 1) -> bytes:
    """A whole ModelInfer request for mlp, as a gRPC message."""
    x = np.ones((rows, 16), dtype=np.float32)
    tensor = pb.ModelInferRequestInferInputTensor(name="input_0", datatype="FP32", shape=[rows, 16])
    request = pb.ModelInferRequest(
        model_name="mlp", inputs=[tensor], raw_input_contents=[x.tobytes()]
    )
    return grpc_message(request.SerializeToString())


NAMES = ["worker", "gateway"]


async def in_thread(fn: Callable[[], None]) -> None:
    await anyio.to_thread.run_sync(fn)


# ------------------------------------------------------------------------------ rapid reset


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
async def test_rapid_reset_gets_goaway_and_the_resident_set_does_not_grow(targets, name):
    """Rounds of 2000 x (HEADERS, a whole ModelInfer DATA, RST_STREAM) on one connection, a
    tritonclient request alongside: GOAWAY(ENHANCE_YOUR_CALM) each round; RSS after round 2
    and after round 4 within 16 MiB; the descriptors back to where they were."""
    t = targets[name]
    body = infer_body()
    fds = t.fds()
    after: list[int] = []
    for _ in range(4):
        async with anyio.create_task_group() as tg, Attacker.connect(t.port) as a:
            tg.start_soon(in_thread, t.served)  # a well-behaved client during the attack
            burst = []
            for i in range(2000):
                sid = 1 + 2 * i
                burst += [a.request(sid), data(sid, body, end_stream=True), rst(sid)]
            await a.send(*burst)
            assert await a.until(lambda: bool(a.goaways), 30)
            assert await a.until_eof(30)
        frame = a.goaways[-1]
        assert (frame.error_code, frame.additional_data) == (CALM, b"too_many_premature_resets")
        await in_thread(t.served)
        after.append(t.memory()[0])
    assert after[-1] - after[1] < 16 * MiB, [a // MiB for a in after]
    await in_thread(lambda: t.fds_back_to(fds))
    assert t.counter("premature_resets") >= 4 * 26
    assert t.counter("goaways", "ENHANCE_YOUR_CALM") >= 4


@pytest.mark.timeout(120)
async def test_clients_cancelling_a_share_of_calls_through_the_gateway_do_not_trip_the_worker(
    targets,
):
    """300 ModelInfer calls through the gateway, a third reset by their client 0-3 ms after
    being sent: the pooled connection carries those that arrive while the worker still serves
    the call, and the worker's reset rule (more than half of 50) must not end the gateway's
    connection for them; every call not cancelled is answered OK."""
    gw, worker = targets["gateway"], targets["worker"]
    calm_before = worker.counter("goaways", "ENHANCE_YOUR_CALM")
    body = infer_body()
    async with Attacker.connect(gw.port) as a:
        await a.send(window_update(0, 1 << 30))
        answered = []
        for i in range(300):
            sid = 1 + 2 * i
            await a.send(a.request(sid), data(sid, body, end_stream=True))
            if i % 3 == 0:
                await anyio.sleep(0.001 * (i % 4))  # resets at 0-3 ms: calls at every stage
                await a.send(rst(sid))
            else:
                answered.append(sid)
                assert await a.until(lambda sid=sid: a.status(sid) is not None, 30), sid
        assert {a.status(sid) for sid in answered} == {0}
        assert a.goaways == []
    assert worker.counter("goaways", "ENHANCE_YOUR_CALM") == calm_before
    # How many resets reach the worker while it still serves the call is a race the machine's
    # speed decides (on a fast VM the worker answers mlp before the gateway relays the reset:
    # 0 of 100 seen, in 2 of 3 runs): whatever reached it must not have tripped it (above).
    await in_thread(gw.served)


# ------------------------------------------------------------------------------ header blocks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
async def test_a_continuation_hold_gets_goaway_and_memory_stays_bounded(targets, name):
    """6 connections, each a HEADERS without END_HEADERS and then CONTINUATION frames of 1 MiB
    (h2 alone would hold 63 MiB per connection): each gets a GOAWAY that ends it, and the peak
    resident set grows by less than 48 MiB. On h2 the frame guard's header_block_too_large
    (ENHANCE_YOUR_CALM) comes at the first fragment. libnghttp2 (the default engine) discards
    the block as it arrives and holds none of it: ENHANCE_YOUR_CALM at its ninth CONTINUATION,
    or, when a loaded machine takes longer than the idle deadline (2 s here) to send that much,
    the idle rule's GOAWAY(NO_ERROR) first (no call is open on such a connection)."""
    t = targets[name]
    _, peak_before = t.memory()
    fds = t.fds()
    codes: list[tuple[int, bytes]] = []

    async def hold() -> None:
        async with Attacker.connect(t.port) as a:
            await a.send(raw_frame(0x1, 0, 1, a.header_block()))
            fragment = continuation(1, b"\x00" * MiB)
            for _ in range(63):
                if a.goaways or not await a.send(fragment):
                    break
                with anyio.move_on_after(0.01):
                    await a.receive()
            await a.until(lambda: bool(a.goaways), 30)
            assert await a.until_eof(30)
            if a.goaways:
                codes.append((a.goaways[-1].error_code, a.goaways[-1].additional_data))

    def ended_by_the_server() -> float:
        """GOAWAYs of every code, and connections closed by a rule that sends none."""
        return t.counter_sum("goaways") + t.counter_sum("refused_connections")

    ended_before = ended_by_the_server()
    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(hold)
    # Each connection was ended by the server (``hold`` saw it close); a client still writing
    # when the server closes may get a reset that discards the GOAWAY it had not read yet, so
    # the server's own counters say how each ended.
    await in_thread(
        lambda: wait_until(
            lambda: ended_by_the_server() - ended_before >= 6, 30, "six connections ended"
        )
    )
    assert {code for code, _ in codes} <= {CALM, 0}, codes
    _, peak_after = t.memory()
    assert peak_after - peak_before < 48 * MiB, (peak_before // MiB, peak_after // MiB)
    await in_thread(t.served)
    await in_thread(lambda: t.fds_back_to(fds))


# ------------------------------------------------------------------------------ streams


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
async def test_a_stream_burst_past_the_limit_is_refused_and_the_first_streams_are_served(
    targets, name
):
    t = targets[name]
    body = infer_body()
    async with Attacker.connect(t.port) as a:
        await a.send(window_update(0, 1 << 30))
        first = [1 + 2 * i for i in range(t.streams)]
        extra = [1 + 2 * i for i in range(t.streams, t.streams + 8)]
        await a.send(*(a.request(sid) for sid in first + extra))
        assert await a.until(lambda: len(a.resets(ErrorCodes.REFUSED_STREAM)) == 8, 30)
        assert a.resets(ErrorCodes.REFUSED_STREAM) == extra
        await a.send(*(data(sid, body, end_stream=True) for sid in first))
        assert await a.until(lambda: all(a.status(sid) is not None for sid in first), 30)
        assert {a.status(sid) for sid in first} == {0}
        assert a.goaways == [] and not a.eof  # the connection survives
    await in_thread(t.served)


# ------------------------------------------------------------------------------ floods


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
async def test_a_ping_flood_gets_too_many_pings(targets, name):
    t = targets[name]
    async with Attacker.connect(t.port) as a:
        await a.send(*(ping(b"%08d" % n) for n in range(20)))
        assert await a.until(lambda: bool(a.goaways), 30)
        assert await a.until_eof(30)
    assert (a.goaways[-1].error_code, a.goaways[-1].additional_data) == (CALM, b"too_many_pings")
    await in_thread(t.served)


@pytest.mark.timeout(120)
async def test_a_keepalive_within_the_ping_rule_is_never_struck(targets):
    """A ping every 1.3 s (the rule: 1 s) on a connection with a call open, on both processes
    at once: every ping is answered, no GOAWAY."""

    async def keepalive(t: Target) -> None:
        async with Attacker.connect(t.port) as a:
            await a.send(a.request(1))  # a call open: the idle rule stays out of it
            for n in range(3):
                started = time.monotonic()
                await a.send(ping(b"keep%04d" % n))
                assert await a.until(lambda n=n: a.ping_acks() == n + 1, 30)
                # the spacing is the subject: 1.3 s must pass on the server's clock too
                await anyio.sleep(max(0.0, 1.3 - (time.monotonic() - started)))
            assert a.goaways == [] and not a.eof

    async with anyio.create_task_group() as tg:
        for t in targets.values():
            tg.start_soon(keepalive, t)


FLOODS = {
    "settings": lambda: settings(),
    "priority": lambda: priority(3),
    "empty_data": lambda: data(1, b""),
    "unknown_type": lambda: raw_frame(0xFA, 0, 0, b"abcd"),
}
"""The floods both engines refuse (on the default engine libnghttp2 answers nothing to a
WINDOW_UPDATE flood and leaves it alone: tests/edge/test_h2_server.py)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
async def test_control_frame_floods_get_goaway(targets, name):
    t = targets[name]
    for kind, make in FLOODS.items():
        async with anyio.create_task_group() as tg, Attacker.connect(t.port) as a:
            tg.start_soon(in_thread, t.served)
            await a.send(a.request(1), make() * 20000)
            assert await a.until(lambda: bool(a.goaways), 30), kind
            assert await a.until_eof(30), kind
        assert a.goaways[-1].error_code == CALM, kind
    await in_thread(t.served)


# ------------------------------------------------------------------------------ idle, handshake


@pytest.mark.timeout(120)
async def test_an_idle_connection_gets_goaway_no_error_and_a_silent_one_is_closed(targets):
    """On both processes at once: a connection that has sent its preface and SETTINGS and
    nothing more gets GOAWAY(NO_ERROR) after the idle time (2 s) and is closed; one that sends
    nothing at all is closed at the handshake deadline (1 s), before the idle time."""

    async def idle(t: Target) -> None:
        idle_before = t.counter("refused_connections", "idle")
        async with Attacker.connect(t.port) as a:
            assert await a.until(lambda: bool(a.goaways), 30)
            assert await a.until_eof(30)
        assert (a.goaways[-1].error_code, a.goaways[-1].last_stream_id) == (0, 0)
        assert t.counter("refused_connections", "idle") > idle_before

    async def silent(t: Target) -> None:
        before = t.counter("refused_connections", "handshake_timeout")
        async with Attacker.connect(t.port, preface=False) as a:
            started = time.monotonic()
            assert await a.until_eof(30)
            waited = time.monotonic() - started
        assert a.goaways == [] and waited < 2.0 + 5.0  # the handshake deadline, with slack
        assert t.counter("refused_connections", "handshake_timeout") == before + 1

    async with anyio.create_task_group() as tg:
        for t in targets.values():
            tg.start_soon(idle, t)
            tg.start_soon(silent, t)
    for t in targets.values():
        await in_thread(t.served)
