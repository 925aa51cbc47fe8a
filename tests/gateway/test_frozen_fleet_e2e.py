"""A fleet that stops answering, end to end: a CLI worker frozen with SIGSTOP behind the gateway
CLI (on uvloop and on trio), driven by the stock tritonclient and plain HTTP.

While every worker is frozen the gateway keeps running (it is not wedged: only its own event
loop stalling is), answers UNAVAILABLE / 503 for the model the fleet has and NOT_FOUND / 404 for
one it does not, holds a bounded number of connections to the silent worker however many probes
time out, and serves again once the worker resumes."""

from __future__ import annotations

import json
import signal
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.gateway.procs import Gateway, sleepy_worker
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
G = "KSERVE_TRIO_GATEWAY_"
MAX_CONNECTIONS = 2
"""The most sockets the gateway may hold to the frozen worker at once: the connection a
timed-out probe resets and the one the next probe opens."""
NEW_CONNECTIONS = 3
"""How many of its connections to the frozen worker the test waits to see come and go: each is
a probe that timed out (5 s), so the old wedge rule (one such round, here) would have exited."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("frozen_fleet")
    worker = sleepy_worker(work)
    try:
        worker.wait_ready()
        yield types.SimpleNamespace(worker=worker, work=work)
    finally:
        if worker.alive():
            worker.proc.send_signal(signal.SIGCONT)
        worker.stop()


def sleepy(seconds: float = 0.0) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("seconds", [1, 1], "FP32")
    inp.set_data_from_numpy(np.full((1, 1), seconds, np.float32))
    return [inp]


def grpc_status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message()


def rest_status(port: int, model: str) -> tuple[int, str]:
    body = json.dumps(
        {"inputs": [{"name": "seconds", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}]}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=body, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def routable(gw: Gateway) -> bool | None:
    """True when the worker is ready and routes ``sleepy``, False when it is unready and routes
    nothing, None in between (the routing table follows the worker's readiness a step later: a
    request routed in between still reaches the worker, or finds no replica yet)."""
    routing = json.loads(gw.admin("/routing")[1])
    ready = [w["ready"] for w in routing["workers"]]
    if all(ready) and routing["models"].get("sleepy"):
        return True
    if not any(ready) and not any(routing["models"].values()):
        return False
    return None


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
def test_a_frozen_fleet_is_unavailable_not_missing_and_the_gateway_serves_again(fleet, loop):
    worker = fleet.worker
    http_port = free_port()
    gw = Gateway(
        fleet.work,
        {
            G + "WORKERS": worker.url,
            G + "LISTEN_HTTP": f"127.0.0.1:{http_port}",
            G + "WEDGE_EXIT_ROUNDS": "1",  # the old rule: exit after one round of timeouts
        },
        "--event-loop",
        loop,
    )
    frozen = False
    try:
        gw.wait_ready()
        c = gw.client()
        assert c.infer("sleepy", sleepy()).as_numpy("slept").shape == (1, 1)
        worker.proc.send_signal(signal.SIGSTOP)
        frozen = True
        wait_until(lambda: routable(gw) is False, 60, "the worker taken out of routing")

        status, message = grpc_status(lambda: c.infer("sleepy", sleepy(), client_timeout=30))
        assert status == "StatusCode.UNAVAILABLE", message
        assert "model 'sleepy' has no ready replica now" in message
        status, message = grpc_status(lambda: c.get_model_metadata("sleepy"))
        assert status == "StatusCode.UNAVAILABLE" and "no ready replica" in message
        status, message = grpc_status(lambda: c.infer("nope", sleepy(), client_timeout=30))
        assert (
            status == "StatusCode.NOT_FOUND" and "model 'nope' not found on any worker" in message
        )
        code, text = rest_status(http_port, "sleepy")
        assert code == 503 and "no ready replica" in text
        code, text = rest_status(http_port, "nope")
        assert code == 404 and "not found on any worker" in text

        seen: set[int] = set()
        most = 0

        def reconnected_enough() -> bool:
            nonlocal most
            assert gw.alive(), gw.logs()  # a frozen fleet is not a wedged gateway
            open_now = gw.connections_to(worker.port)
            most = max(most, len(open_now))
            seen.update(open_now)
            return len(seen) >= NEW_CONNECTIONS

        wait_until(reconnected_enough, 120, "the prober reconnecting to the frozen worker")
        assert most <= MAX_CONNECTIONS, most  # the timed-out ones were closed, never piled up
        assert c.is_server_live() and not c.is_server_ready()

        worker.proc.send_signal(signal.SIGCONT)
        frozen = False
        wait_until(lambda: routable(gw) is True, 60, "the worker routable again")
        assert c.infer("sleepy", sleepy()).as_numpy("slept").shape == (1, 1)
        assert gw.alive() and "gateway_wedged" not in gw.logs()
    finally:
        if frozen:
            worker.proc.send_signal(signal.SIGCONT)
        assert gw.stop() == 0, gw.logs()
