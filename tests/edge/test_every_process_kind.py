"""The edge defences on every kind of server process and on both event loops: a CLI worker, a
worker with two front-end processes, and a CLI gateway in front of a worker, each on uvloop and
on trio (one process set per kind and loop, shared by the module's tests).

- *Silent announcers*, on gRPC and REST at once: gRPC streams announce a message at the cap (a
  5-byte prefix, nothing more) and REST POSTs a body at the cap (``Content-Length``, one byte
  of body), all held open, while tritonclient and a REST client keep being served with no
  error; the bytes-in-flight gauge shows the announcers hold what arrived (a byte per REST
  body), not what they announced; a ``Content-Length`` past the body cap is 413 at once.
- *A body past the bytes in flight*: a REST body that does not fit beside one held is 429 with
  the gRPC refusal's message and counted, small requests are served, the gauge comes back.
- *A connection's share*: gRPC and REST connections each send most of a message larger than
  their share (``limits.max_inflight_bytes_per_connection``); one per serving process (the
  lane) is charged all it sent, the others at most their share (plus one read on REST) and are
  read no further, with no error, while other clients are served; once the rest is sent every
  message is answered and the gauge is back to 0.
- *Answers beside deadlines*: valid calls in flight beside calls with a 1 ms deadline on one
  connection are each answered OK with their message (never OK with none).
- *REST framing*: an endless chunk extension is 400 at once and costs little CPU, a 100 KB one
  is 400, both counted; HTTP/1.1's Host, absolute-form and pipelining rules hold and an h2c
  upgrade (``curl --http2``) is answered in HTTP/1.1 (``rest_peer.http11_rules_hold``).
- *A reset flood that reconnects*: a peer address that floods rapid resets and reconnects
  after each GOAWAY meets a stricter judge (probation), while a client from another address is
  served between the rounds; a peer opening connections past its rate has them closed at once.
- *Idle connections at the cap*: bare connections past every serving process's cap, on the gRPC
  and the REST port in turn, have the longest-idle ones closed and a new client is served.

Each server has 8 MiB of bytes in flight with a 256 KiB share per connection, a 32 MiB message
cap (the announcers together announce 32 times the budget), a 30 s receive deadline (so the
announcers stay for the whole test), a premature-reset window of 128 streams, 50 new
connections a second per peer address and 256 connections per port (60 s to finish a
handshake). Every client that is not an
attacker comes from 127.0.0.1; the attackers from 127.0.0.2 (reset floods), 127.0.0.3
(connection bursts) and 127.0.1.x (idle connections, fewer from each than its rate), so what the
ledger holds against them never touches the other tests.

A front end has its own budget, lane and peer ledger, and the kernel picks which front end
(SO_REUSEPORT) a connection lands on: the bounds here hold for any spread of the connections
over the serving processes.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import pathlib
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from tests.edge.h2_attacker import PREFACE, Attacker, data, grpc_message, rst
from tests.edge.limited_procs import get
from tests.edge.memory_probe import MiB, mlp_input, mlp_request_bytes
from tests.edge.rest_peer import (
    chunk_extensions_are_bounded,
    good_infer_body,
    http11_rules_hold,
    read_reply,
    request,
)
from tests.gateway.procs import Gateway, Proc, Worker
from tests.ports import free_port
from tests.serving.grpc.h2_peer import Peer, grpc_frame
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

INFER = "/inference.GRPCInferenceService/ModelInfer"
READY = "/inference.GRPCInferenceService/ServerReady"
REST_INFER = "/v2/models/mlp/infer"
INFLIGHT = 8 * MiB
SHARE = 256 << 10
MESSAGE_CAP = 32 * MiB
RECEIVE_SECONDS = 30.0
RESET_WINDOW = 128
PEER_RATE = 50
MAX_CONNECTIONS = 256
ANNOUNCERS = 4
"""Connections of each kind; each gRPC one opens 4 streams."""
FLOODER, BURSTER = "127.0.0.2", "127.0.0.3"
"""The attackers' own peer addresses."""
READ = 256 << 10
"""The most one read of the REST server gives its parser (what may cross the share)."""
BOUND = 30.0
"""Seconds: the bound on every outcome."""


class Target:
    """One server process kind on one event loop: its ports, its processes, its metrics."""

    def __init__(
        self, kind: str, proc: Proc, grpc_port: int, http_port: int, metrics_port: int
    ) -> None:
        self.kind, self.proc = kind, proc
        self.grpc_port, self.http_port, self.metrics_port = grpc_port, http_port, metrics_port
        self._metrics: http.client.HTTPConnection | None = None
        self.prefix = "gateway" if kind == "gateway" else "worker"
        self.serving = 2 if kind == "frontends" else 1
        """Processes that serve the public ports, each with its own budget, lane and ledger."""

    def pids(self) -> list[int]:
        """The process and its children (a worker's front ends)."""
        pid = self.proc.proc.pid
        tasks = pathlib.Path(f"/proc/{pid}/task").iterdir()
        return [pid, *(int(c) for t in tasks for c in (t / "children").read_text().split())]

    def exposition(self) -> str:
        """The metrics page, on one kept-alive connection: the tests poll it, and a new
        connection per poll would meet the peer rate of the metrics port."""
        for _ in range(2):
            if self._metrics is None:
                self._metrics = http.client.HTTPConnection("127.0.0.1", self.metrics_port, 10)
            try:
                status, text = get(self._metrics, "/metrics")
            except (http.client.HTTPException, OSError):  # closed by the server meanwhile
                self._metrics.close()
                self._metrics = None
                continue
            assert status == 200, text
            return text
        raise AssertionError(f"no metrics from {self.kind}")

    def metric(self, name: str, **labels: str) -> float:
        """Every sample of ``<prefix>_edge_<name>`` carrying ``labels``, summed (over the
        front ends too: each pushes its own series)."""
        wanted = f"{self.prefix}_edge_{name}"
        return sum(
            sample.value
            for family in text_string_to_metric_families(self.exposition())
            for sample in family.samples
            if sample.name == wanted and labels.items() <= sample.labels.items()
        )

    def inflight(self) -> float:
        return self.metric("inflight_bytes")

    def served(self) -> list[str]:
        """A tritonclient inference and a REST one: their outcomes ("OK" when served)."""
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        outcomes = []
        try:
            client.infer("mlp", [mlp_input()], client_timeout=BOUND)
            outcomes.append("OK")
        except grpcclient.InferenceServerException as exc:
            outcomes.append(f"{exc.status()} {exc.message()}")
        finally:
            client.close()
        status, body = request(self.http_port, "POST", REST_INFER, good_infer_body())
        outcomes.append("OK" if status == 200 else f"{status} {body!r:.200}")
        return outcomes


def limits(prefix: str) -> dict[str, str]:
    return {
        f"{prefix}LIMITS_MAX_INFLIGHT_BYTES": str(INFLIGHT),
        f"{prefix}LIMITS_MAX_INFLIGHT_BYTES_PER_CONNECTION": str(SHARE),
        f"{prefix}LIMITS_MESSAGE_RECEIVE_SECONDS": str(RECEIVE_SECONDS),
        f"{prefix}LIMITS_PREMATURE_RESET_MIN_STREAMS": str(RESET_WINDOW),
        f"{prefix}LIMITS_MAX_CONNECTIONS_PER_PEER_PER_SECOND": str(PEER_RATE),
        f"{prefix}LIMITS_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        f"{prefix}LIMITS_HANDSHAKE_SECONDS": "60",
        f"{prefix}GRPC_MAX_RECV_MSG_BYTES": str(MESSAGE_CAP),
    }


def worker(demo_repo, http_port: int, env: dict[str, str]) -> Worker:
    return Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        metrics_port=free_port(),
        env={"INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": str(http_port), **env},
    )


def said_loop(proc: Proc, event: str) -> set[str]:
    """The event loops the process's ``event`` log lines say it serves on."""
    return {
        json.loads(line)["event_loop"] for line in proc.logs().splitlines() if f'"{event}"' in line
    }


@pytest.fixture(scope="module")
def backing(demo_repo) -> Iterator[Worker]:
    """The worker behind the gateways under test (its own ports are not attacked)."""
    behind = worker(demo_repo, free_port(), {})
    try:
        behind.wait_ready()
        yield behind
    finally:
        assert behind.stop() == 0, behind.logs()


KINDS = [(kind, loop) for kind in ("worker", "frontends", "gateway") for loop in ("uvloop", "trio")]


@pytest.fixture(scope="module", params=KINDS, ids=[f"{kind}-{loop}" for kind, loop in KINDS])
def target(request, demo_repo, tmp_path_factory) -> Iterator[Target]:
    kind, loop = request.param
    http_port = free_port()
    proc: Worker | Gateway
    if kind == "gateway":
        behind: Worker = request.getfixturevalue("backing")
        g = "KSERVE_TRIO_GATEWAY_"
        env = {
            g + "WORKERS": behind.url,
            g + "LISTEN_HTTP": f"127.0.0.1:{http_port}",
            g + "EVENT_LOOP": loop,
            **limits(g),
        }
        proc = Gateway(tmp_path_factory.mktemp(f"gateway-{loop}"), env)
    else:
        env = {"INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP": loop, **limits("INFERENCE_SERVER_")}
        if kind == "frontends":
            env["INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES"] = "2"
        proc = worker(demo_repo, http_port, env)
    try:
        proc.wait_ready()
        event = "gateway_up" if kind == "gateway" else "server_up"
        assert wait_until(lambda: said_loop(proc, event), 30, event) == {loop}
        yield Target(kind, proc, proc.port, http_port, proc.metrics_port)
        assert proc.alive(), proc.logs()
    finally:
        assert proc.stop() == 0, proc.logs()


def rest_head(length: int) -> bytes:
    return (
        f"POST {REST_INFER} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def settles(target: Target, most: float, what: str) -> None:
    """Until the gauge is at most ``most`` (what earlier requests held is given back)."""
    wait_until(lambda: target.inflight() <= most, 20, what)


# ------------------------------------------------------------------ the bytes in flight


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
            return [outcome for _ in range(5) for outcome in target.served()]

        assert await anyio.to_thread.run_sync(served) == ["OK"] * 10
        # what the announcers hold: the byte each REST body sent, nothing of what they announced
        # (waited for: a front end's counters arrive once a second, so a read may still count
        # a served call's bytes; what was announced, 64 MiB each, would never go)
        await anyio.to_thread.run_sync(settles, target, ANNOUNCERS, "the announcers' bytes only")

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


HOLD = INFLIGHT - (64 << 10)
"""What a holder sends of a body it announces larger: all the bytes in flight but room for a
small request."""
REFUSED = re.compile(
    rf"server is at its in-flight bytes cap \(\d+ of {INFLIGHT} bytes of requests in flight; "
    r"this message needs \d+\)"
)
"""The gRPC refusal's message, its figures those of the piece that did not fit."""


def held_or_refused(target: Target, sock: socket.socket, held: int) -> Callable[[], str]:
    """ "refused" once the server answers on ``sock``, "held" once the gauge is at ``held``."""

    def verdict() -> str:
        if select.select([sock], [], [], 0)[0]:
            return "refused"
        return "held" if target.inflight() >= held else ""

    return verdict


@pytest.mark.timeout(120)
def test_a_body_past_the_bytes_in_flight_is_429_and_its_bytes_come_back(target: Target):
    """Connections each announce a body larger than the bytes in flight and send HOLD of it,
    one after the other: the first on each serving process is charged what it sent (it takes
    the lane), and the first to land on a process already held is refused 429 with the gRPC
    refusal's message and counted, while small requests are served; once the holders leave
    mid-body the gauge is back to 0."""

    def refused() -> float:
        return target.metric("refused_requests_total", reason="inflight_bytes")

    settles(target, 0, "the gauge at 0 before")
    counted = refused()
    with contextlib.ExitStack() as stack:
        holders = 0
        while True:
            assert holders <= target.serving, "a body past the bytes in flight was taken"
            sock = socket.create_connection(("127.0.0.1", target.http_port), timeout=BOUND)
            stack.enter_context(sock)
            with contextlib.suppress(OSError):  # a refused one is not read to its end
                sock.sendall(rest_head(INFLIGHT + MiB) + b" " * HOLD)
            verdict = held_or_refused(target, sock, (holders + 1) * HOLD)
            if wait_until(verdict, BOUND, "charged or refused") == "refused":
                break
            holders += 1
        status, body = read_reply(sock, time.monotonic() + BOUND)
        assert status == 429 and REFUSED.fullmatch(json.loads(body)["error"]), body
        assert holders >= 1
        assert target.served() == ["OK", "OK"]  # beside the held bytes
    settles(target, 0, "the holders left mid-body")
    wait_until(lambda: refused() == counted + 1, BOUND, "the refusal counted")
    assert target.served() == ["OK", "OK"]


WHOLE = 7 * MiB // 4
"""The message each connection of the share test sends (the four of them fit the budget
whole)..."""
PART = 3 * MiB // 2
"""...and how much of it before the others are served."""


def padded_rest_body() -> bytes:
    """A valid mlp inference of WHOLE bytes (JSON allows the leading blanks)."""
    body = good_infer_body()
    return b" " * (WHOLE - len(body)) + body


def padded_grpc_message() -> bytes:
    """A valid mlp ModelInfer message of WHOLE bytes (a long request id)."""
    id_bytes = WHOLE - len(grpc_frame(mlp_request_bytes(1)))
    near = len(grpc_frame(mlp_request_bytes(1, "i" * id_bytes)))  # the id's tag and length
    return grpc_frame(mlp_request_bytes(1, "i" * (id_bytes - (near - WHOLE))))


@pytest.mark.timeout(180)
async def test_connections_past_their_share_are_read_no_further_and_all_get_through(
    target: Target,
):
    """Two gRPC and two REST connections each send PART of a WHOLE-byte message: each serving
    process charges one of them (its lane) all of it and the others at most their share (plus
    the REST read that crossed it), while a tritonclient and a REST client are served; then
    every message is sent whole and answered, and the gauge is back to 0."""
    await anyio.to_thread.run_sync(settles, target, 0, "the gauge at 0 before")
    rest_body, grpc_message_ = padded_rest_body(), padded_grpc_message()
    assert len(rest_body) == len(grpc_message_) == WHOLE
    release = threading.Event()
    outcomes: list[str] = []

    def rest_client() -> None:
        with socket.create_connection(("127.0.0.1", target.http_port), timeout=BOUND) as sock:
            sock.sendall(rest_head(WHOLE) + rest_body[:PART])  # may wait: the share
            assert release.wait(BOUND)
            sock.sendall(rest_body[PART:])
            status, body = read_reply(sock, time.monotonic() + BOUND)
        shape = json.loads(body)["outputs"][0]["shape"] if status == 200 else body[:200]
        outcomes.append(f"REST {status} {shape}")

    async def grpc_client(peer: Peer) -> None:
        await peer.until(lambda: peer.conn.outbound_flow_control_window > WHOLE)
        sid = peer.open(INFER)
        await peer.flush()
        await peer.send_body(sid, grpc_message_[:PART], end=False)
        await anyio.to_thread.run_sync(release.wait, BOUND)
        await peer.send_body(sid, grpc_message_[PART:])
        reply = await peer.wait(sid)
        outcomes.append(f"gRPC {reply.status} {reply.message or len(reply.messages)}")

    def held() -> float:
        """Once a lane's message and another connection's share are charged, and the other
        clients served: the gauge (whichever connections hold the lanes, a REST connection
        that does not is read at least to its share)."""
        wait_until(lambda: target.inflight() >= PART + SHARE, BOUND, "a lane and a share")
        assert target.served() == ["OK", "OK"]
        return target.inflight()

    async with (
        Peer.connect(target.grpc_port) as first,
        Peer.connect(target.grpc_port) as second,
        anyio.create_task_group() as tg,
    ):
        for _ in range(2):
            tg.start_soon(anyio.to_thread.run_sync, rest_client)
        for peer in (first, second):
            tg.start_soon(grpc_client, peer)
        try:
            seen = await anyio.to_thread.run_sync(held)
        finally:
            release.set()
    lanes = target.serving
    assert seen <= lanes * PART + (4 - lanes) * (SHARE + READ), (seen, target.serving)
    assert sorted(outcomes) == ["REST 200 [1, 8]"] * 2 + ["gRPC 0 1"] * 2
    await anyio.to_thread.run_sync(settles, target, 0, "every message answered")


# ------------------------------------------------------------------ answers and deadlines

VALID_CALLS = 400
"""Calls with no deadline the deadline test sees answered."""
IN_FLIGHT, EXPIRING = 16, 4


@pytest.mark.timeout(120)
async def test_valid_calls_beside_expiring_ones_are_each_answered_with_their_message(
    target: Target,
):
    """One connection keeps IN_FLIGHT mlp calls with no deadline in flight beside EXPIRING
    ones with a 1 ms ``grpc-timeout``, each replaced as it ends: every call without a deadline
    is answered OK with its one reply message, every expiring one DEADLINE_EXCEEDED or OK with
    its message; never OK with no message (a deadline or reset landing on a reused call task
    once did that)."""
    body = grpc_frame(mlp_request_bytes(1))
    async with Peer.connect(target.grpc_port) as peer:
        await peer.until(lambda: peer.conn.outbound_flow_control_window > MiB)
        kinds: dict[int, str] = {}

        def call(kind: str) -> None:
            deadline = (("grpc-timeout", "1m"),) if kind == "expiring" else ()
            sid = peer.open(INFER, deadline)
            peer.conn.send_data(sid, body, end_stream=True)
            kinds[sid] = kind

        for kind in ["valid"] * IN_FLIGHT + ["expiring"] * EXPIRING:
            call(kind)
        await peer.flush()
        wrong: list[tuple[str, int | None, str, int]] = []
        answered = 0
        with anyio.fail_after(BOUND * 2):
            while answered < VALID_CALLS:
                assert await peer.receive(), "the server closed the connection"
                for sid in [sid for sid in kinds if peer.replies[sid].done]:
                    kind, reply = kinds.pop(sid), peer.replies.pop(sid)
                    outcome = (kind, reply.status, reply.message, len(reply.messages))
                    served = outcome[1:] == (0, "", 1)
                    late = kind == "expiring" and (reply.status, len(reply.messages)) == (4, 0)
                    answered += kind == "valid"
                    if not (served or late):
                        wrong.append(outcome)
                    call(kind)
                await peer.flush()
    assert wrong == []


# ------------------------------------------------------------------------ REST framing


@pytest.mark.timeout(120)
def test_chunk_extensions_are_bounded_and_http11_is_read_strictly(target: Target):
    def refused() -> float:
        return target.metric("refused_requests_total", reason="chunk_extensions")

    before = refused()
    chunk_extensions_are_bounded(target.http_port, target.pids())
    http11_rules_hold(target.http_port)
    # the endless extension and the 100 KB one (a front end pushes its counters every second)
    wait_until(lambda: refused() == before + 2, BOUND, "both refusals counted")
    assert target.served() == ["OK", "OK"]


# ----------------------------------------------------------------- reset floods, peers

FLOOD_BATCH = 8
"""Premature resets sent between two round trips of the flooder."""
FLOOD_ROUNDS = 4


def answered_or_ended(attacker: Attacker, sid: int) -> Callable[[], bool]:
    """Whether stream ``sid`` has its answer, or the connection a GOAWAY."""
    return lambda: bool(attacker.goaways) or attacker.status(sid) is not None


async def resets_until_goaway(port: int) -> int:
    """One connection from FLOODER: batches of FLOOD_BATCH rapid resets (HEADERS, part of a
    message, RST_STREAM), each followed by a ServerReady call whose answer shows the server
    has judged the batch, until the server sends GOAWAY: how many resets it took."""
    short = grpc_message(b"x" * 64)[:-1]
    async with Attacker.connect(port, local_host=FLOODER) as a:
        sid, resets = 1, 0
        while not a.goaways:
            assert resets < 4 * RESET_WINDOW, "never judged"
            burst = []
            for _ in range(FLOOD_BATCH):
                burst += [a.request(sid), data(sid, short), rst(sid)]
                sid += 2
            ready = sid
            sid += 2
            burst += [a.request(ready, READY), data(ready, grpc_message(b""), end_stream=True)]
            resets += FLOOD_BATCH
            sent = await a.send(*burst)
            assert await a.until(answered_or_ended(a, ready), BOUND)
            assert sent or a.goaways
        assert await a.until_eof(BOUND)
    frame = a.goaways[-1]
    assert (frame.error_code, frame.additional_data) == (11, b"too_many_premature_resets")
    return resets


@pytest.mark.timeout(120)
async def test_a_reset_flood_that_reconnects_meets_a_stricter_judge(target: Target):
    """The first connection is judged over the whole window; each later one on a serving
    process that ended one before is judged over half as many streams (or fewer), so with
    FLOOD_ROUNDS connections over at most two serving processes one of the later ones ends
    after at most half the first's resets (on one process each ends after about half the one
    before). A client from 127.0.0.1 is served between the rounds."""
    ended_after = []
    for _ in range(FLOOD_ROUNDS):
        ended_after.append(await resets_until_goaway(target.grpc_port))
        assert await anyio.to_thread.run_sync(target.served) == ["OK", "OK"]
    first = ended_after[0]
    assert RESET_WINDOW // 2 <= first <= RESET_WINDOW + FLOOD_BATCH, ended_after
    assert min(ended_after[1:]) <= first // 2 + FLOOD_BATCH, ended_after
    if target.serving == 1:
        pairs = itertools.pairwise(ended_after)
        assert all(later <= earlier // 2 + FLOOD_BATCH for earlier, later in pairs), ended_after


BURST = 400
"""Connections BURSTER opens at once."""


def admitted(sock: socket.socket) -> bool:
    """Whether the server kept a connection it had accepted: it answers the preface with its
    SETTINGS (a refused one is closed at once)."""
    try:
        sock.sendall(PREFACE)
        return bool(sock.recv(9))
    except (ConnectionResetError, BrokenPipeError):
        return False


@pytest.mark.timeout(120)
def test_a_peer_opening_connections_past_its_rate_has_them_closed_at_once(target: Target):
    """BURST connections from BURSTER at once: each serving process admits at most PEER_RATE
    at once and PEER_RATE a second after, the others are closed at once and counted
    (``reason="peer_rate"``); 127.0.0.1 is served meanwhile."""

    def refused() -> float:
        return target.metric("refused_connections_total", reason="peer_rate")

    counted = refused()
    with contextlib.ExitStack() as stack:
        started = time.monotonic()
        socks = []
        for _ in range(BURST):
            sock = stack.enter_context(socket.socket())
            sock.settimeout(BOUND)
            sock.bind((BURSTER, 0))
            sock.connect(("127.0.0.1", target.grpc_port))
            socks.append(sock)
        kept = sum(admitted(sock) for sock in socks)
        took = time.monotonic() - started
        assert target.served() == ["OK", "OK"]
    assert kept <= target.serving * PEER_RATE * (1 + took), (kept, took)
    assert kept < BURST, took
    wait_until(lambda: refused() == counted + BURST - kept, BOUND, "the refusals counted")


IDLE_PER_PEER = 40
"""Idle connections opened from each 127.0.1.x address (within its rate)."""
PAST_THE_CAP = 32


@pytest.mark.timeout(120)
def test_idle_connections_past_the_cap_make_room_for_a_new_client(target: Target):
    """On the gRPC port and then the REST one: bare TCP connections, PAST_THE_CAP more than
    every serving process's cap holds, opened from many addresses: at least PAST_THE_CAP of
    them are closed by the server (the longest idle evicted for a newer one, or one refused at
    once while EVICTING_MAX evicted ones still close), and a client from 127.0.0.1, gRPC and
    REST, is served beside the rest."""

    def closed(reason: str) -> float:
        return target.metric("refused_connections_total", reason=reason)

    def served_soon() -> bool:
        """Served (a port whose last evicted connections are still closing may refuse one)."""
        try:
            return target.served() == ["OK", "OK"]
        except (AssertionError, OSError):
            return False

    for port in (target.grpc_port, target.http_port):
        evicted, refused = closed("evicted_idle"), closed("max_connections")
        with contextlib.ExitStack() as stack:
            for n in range(target.serving * MAX_CONNECTIONS + PAST_THE_CAP):
                sock = stack.enter_context(socket.socket())
                sock.bind((f"127.0.1.{1 + n // IDLE_PER_PEER}", 0))
                sock.connect(("127.0.0.1", port))
            wait_until(
                lambda e=evicted, r=refused: (
                    closed("evicted_idle") > e
                    and closed("evicted_idle") + closed("max_connections") >= e + r + PAST_THE_CAP
                ),
                BOUND,
                "room made at the cap",
            )
            # before any of them meets its handshake deadline (60 s): only eviction makes room
            wait_until(served_soon, BOUND, "a new client served at the cap")
