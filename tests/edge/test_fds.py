"""Idle-connection floods against every public port of the CLI worker and the CLI gateway,
each running under an open-file limit of 256 (``limited_procs``).

Per port, 300 connections that never send a byte (more than the process has descriptors
for): the process stays up, at the port's cap (its share of the descriptor budget,
``serving.fd_budget``) each new connection closes the longest-idle one, so all but a cap's
worth of the attackers are closed by the server, the process holds no more descriptors than
its baseline plus that cap and the evictions still closing, well-behaved clients are served on
new connections during the flood (on every port, the flooded one included) and after it,
every descriptor comes back once the attackers leave, and
``*_edge_refused_connections_total`` counts the attackers closed (``reason="evicted_idle"``,
or ``"max_connections"`` when too many evictions were still closing).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import tritonclient.grpc as grpcclient

from kserve_trio.serving.accept import EVICTING_MAX
from tests.edge.idle_flood import Flood
from tests.edge.limited_procs import (
    NOFILE,
    LimitedGateway,
    LimitedWorker,
    counter,
    fresh_get,
    gateway_cap,
    worker_cap,
)
from tests.edge.memory_probe import fds as descriptors
from tests.gateway.procs import Proc
from tests.waiting import succeeds_within, wait_until

ATTACKERS = 300
assert ATTACKERS > NOFILE
SLACK_FDS = 4
"""Descriptors the process may hold above its baseline for its own reasons (a scrape's
connection, a log rotation): far below any cap."""


@dataclass
class Served:
    """One process under test, its ports and its well-behaved clients."""

    proc: Proc
    pid: int
    ports: dict[str, int]
    cap: int
    prefix: str
    ready_path: str = "/v2/health/ready"

    def metrics(self) -> str:
        status, body = fresh_get(self.ports["metrics"], "/metrics")
        assert status == 200, body
        return body

    def closed_at_the_cap(self) -> float:
        """Connections the ports' caps closed: evicted, or refused."""
        name, exposition = f"{self.prefix}_edge_refused_connections_total", self.metrics()
        reasons = ("evicted_idle", "max_connections")
        return sum(counter(exposition, name, reason=reason) for reason in reasons)

    def fresh_grpc(self) -> grpcclient.InferenceServerClient:
        """A gRPC client on a connection of its own, opened now. A client kept from before a
        flood is not the server's to judge: when the cap closed its connection, gRPC's channel
        reconnects on a back-off of its own (1 s and growing) and fails calls fast meanwhile,
        so whether it is served at once after a flood depends on when its last attempt fell."""
        return grpcclient.InferenceServerClient(
            f"127.0.0.1:{self.ports['grpc']}", channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )

    def well_served(self) -> None:
        """A gRPC readiness and model-readiness call, a REST readiness GET and a metrics scrape,
        each on a new connection, each served within SERVED_WITHIN. A port may refuse a new
        connection for a moment after a flood (accept's connection cap): a connection the
        server has closed stays counted under the cap until its task has finished, a few turns
        of the loop after its descriptor is gone, and during a flood while EVICTING_MAX
        evicted ones still close. A port that does not serve again fails with its last error."""
        succeeds_within(self._grpc_served, SERVED_WITHIN, "gRPC served on a new connection")
        for port, path in (("rest", self.ready_path), ("metrics", "/metrics")):
            succeeds_within(
                lambda port=port, path=path: self._http_served(port, path),
                SERVED_WITHIN,
                f"{port} served on a new connection",
            )

    def _grpc_served(self) -> None:
        client = self.fresh_grpc()
        try:
            assert client.is_server_ready()
            assert client.is_model_ready("mlp")
        finally:
            client.close()

    def _http_served(self, port: str, path: str) -> None:
        status, body = fresh_get(self.ports[port], path)
        assert status == 200, (port, body)


SERVED_WITHIN = 30.0
"""Seconds a well-behaved client's check may be retried on new connections (a bound for a
port that never serves again; a healthy one serves within a few turns of its loop)."""


def _baseline(served: Served) -> int:
    """The process's descriptors once quiet (a round of every client first, so lazily opened
    files are open), read until two readings agree."""
    served.well_served()
    readings = [descriptors(served.pid)]

    def steady() -> bool:
        readings.append(descriptors(served.pid))
        return readings[-1] == readings[-2]

    wait_until(steady, 10, "two descriptor counts that agree")
    return readings[-1]


@pytest.fixture(scope="module")
def worker(demo_repo) -> Iterator[Served]:
    w = LimitedWorker(demo_repo)
    try:
        w.wait_ready(60)
        yield Served(
            w,
            w.proc.pid,
            {"grpc": w.port, "rest": w.http_port, "metrics": w.metrics_port},
            worker_cap(),
            "worker",
        )
    finally:
        assert w.stop() == 0, w.logs()


@pytest.fixture(scope="module")
def gateway(worker: Served, tmp_path_factory) -> Iterator[Served]:
    assert isinstance(worker.proc, LimitedWorker)
    g = LimitedGateway(tmp_path_factory.mktemp("edge_fds"), worker.proc, {})
    try:
        g.wait_ready(60)
        yield Served(
            g,
            g.proc.pid,
            {"grpc": g.port, "rest": g.http_port, "metrics": g.metrics_port},
            gateway_cap(),
            "gateway",
        )
    finally:
        assert g.stop() == 0, g.logs()


def _flood_one_port(served: Served, port: str) -> None:
    baseline = _baseline(served)
    closed_before = served.closed_at_the_cap()
    excess = ATTACKERS - served.cap
    with Flood(served.ports[port], ATTACKERS) as flood:
        flood.wait_closed(excess, timeout=20)  # closed by the server, not left hanging
        assert served.proc.alive()
        held = descriptors(served.pid)
        most = baseline + served.cap + EVICTING_MAX + 1 + SLACK_FDS
        assert held <= most, (held, baseline, served.cap)
        served.well_served()  # during the flood, each new connection in an attacker's place
        assert served.closed_at_the_cap() - closed_before >= excess
    _settled(served.pid, baseline)  # every attacker's descriptor back
    assert served.proc.alive()
    served.well_served()  # after the flood: new connections on every port


PORTS = ["grpc", "rest", "metrics"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("port", PORTS)
def test_a_flood_of_idle_connections_to_a_worker_port(worker: Served, port: str):
    _flood_one_port(worker, port)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("port", PORTS)
def test_a_flood_of_idle_connections_to_a_gateway_port(gateway: Served, port: str):
    _flood_one_port(gateway, port)


@pytest.mark.timeout(120)
def test_floods_round_after_round_leave_the_descriptors_where_they_were(worker: Served):
    """Three rounds on every port at once: no round leaves a descriptor behind."""
    baseline = _baseline(worker)
    after: list[int] = []
    for _ in range(3):
        floods = [Flood(worker.ports[p], ATTACKERS // 3) for p in PORTS]
        try:
            for flood in floods:
                flood.wait_closed(ATTACKERS // 3 - worker.cap, timeout=20)
            assert worker.proc.alive()
        finally:
            for flood in floods:
                flood.close()
        after.append(_settled(worker.pid, baseline))
        worker.well_served()
    assert max(after) <= baseline + SLACK_FDS, (baseline, after)


def _settled(pid: int, baseline: int, timeout: float = 20) -> int:
    """The descriptors once back within SLACK_FDS of ``baseline``."""
    return wait_until(
        lambda: (now := descriptors(pid)) <= baseline + SLACK_FDS and now,
        timeout,
        f"descriptors back to {baseline} + {SLACK_FDS}",
    )
