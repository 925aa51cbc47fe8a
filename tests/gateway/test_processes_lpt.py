"""lpt_packing through a gateway in two processes: ``test_lpt_e2e`` again with ``--processes
2`` (its control calls open a new connection each, so they reach either process), then what
only several processes have: every process answers GetSchedulingStatus alike, and the traffic a
follower routed counts in the placer's arrival rates."""

from __future__ import annotations

# ruff: noqa: F811  (the tests take the imported fixture ``fleet`` by name)
import json
import pathlib
import re
import time

import pytest
import tritonclient.grpc as grpcclient

from kserve_trio.gateway.placement.multiprocess import _arrivals_path
from kserve_trio.proto import reactant_control as rc
from tests.gateway import test_lpt_e2e as lpt_e2e
from tests.gateway.test_lpt_e2e import (  # noqa: F401  (the fixture and the tests, run again)
    control,
    fleet,
    inputs,
    placement,
    test_model_load_through_the_gateway_names_set_model_placement,
    test_placement_follows_traffic_and_an_all_replicas_override,
    tick_after,
)
from tests.gateway.test_processes import OWN_CONNECTION, TwoProcesses
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def compact_calls(gw: TwoProcesses) -> dict[str, int]:
    """``test_lpt_e2e.compact_calls`` over the merged /metrics: each process's series carries
    its ``gateway_process`` label (only the placer compacts); summed per worker."""
    _, text = gw.admin("/metrics")
    pattern = (
        r'gateway_worker_latency_seconds_count\{rpc="CompactMemory",worker="([^"]+)",'
        r'gateway_process="\d+"\} (\S+)'
    )
    out: dict[str, int] = {}
    for worker, n in re.findall(pattern, text):
        out[worker] = out.get(worker, 0) + int(float(n))
    return out


@pytest.fixture(scope="module", autouse=True)
def _gateways_in_two_processes():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lpt_e2e, "Gateway", TwoProcesses)
        patch.setattr(lpt_e2e, "compact_calls", compact_calls)
        yield


def _summary(status: rc.GetSchedulingStatusResponse) -> str:
    """What every process must answer alike (the placement, the policy, the repacks, the
    rates), as one comparable text."""
    return json.dumps(
        [
            placement(status),
            status.policy.generation,
            status.repack.repack_count,
            sorted((m.name, round(m.arrival_rate, 9)) for m in status.models),
        ],
        sort_keys=True,
    )


def reported_arrivals(gw: TwoProcesses, model: str) -> int:
    """The requests for ``model`` that the follower (process 1) has told the placer it routed
    (its arrivals file in the gateway's runtime directory, always replaced whole; 0 before its
    first report)."""
    (starting,) = gw.events("gateway_processes_starting")
    path = _arrivals_path(pathlib.Path(starting["runtime_dir"]), 1)
    try:
        return int(json.loads(path.read_bytes())["counts"].get(model, 0))
    except FileNotFoundError:
        return 0


def client_of_process(gw: TwoProcesses, wanted: str) -> grpcclient.InferenceServerClient:
    """A client whose connection reached process ``wanted`` (a cnn request shows which)."""
    for _ in range(40):
        c = grpcclient.InferenceServerClient(gw.url, channel_args=OWN_CONNECTION)
        before = gw.served()
        c.infer("cnn", inputs("cnn"))
        after = gw.served()
        (process,) = [p for p in after if after[p] != before.get(p, 0.0)]
        if process == wanted:
            return c
    raise AssertionError(f"40 connections, none reached process {wanted}")


@pytest.mark.timeout(120)
def test_every_process_answers_alike_and_a_followers_traffic_counts(fleet):
    gw = fleet.gw
    answers = {_summary(control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest()))}
    for _ in range(15):  # a new connection each: both processes answer (all alike)
        status = control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())
        answers.add(_summary(status))
    assert len(answers) == 1, answers
    follower = client_of_process(gw, "1")
    rate = {m.name: m.arrival_rate for m in status.models}
    reported = reported_arrivals(gw, "scale4")
    for _ in range(40):  # scale4 traffic through the follower only
        follower.infer("scale4", inputs("scale4"))
    wait_until(
        lambda: reported_arrivals(gw, "scale4") >= reported + 40, 30, "the follower's report"
    )
    # two prober rounds poll the workers' counters after the traffic: the placer's rate moves
    # by the fleet compute it has seen since its last repack
    traffic_end = time.time()
    first = wait_until(lambda: tick_after(gw, traffic_end), 60, "a prober round")
    wait_until(lambda: tick_after(gw, first), 60, "a second prober round")
    reply = control(gw.url, "Repack", rc.RepackRequest(wait_seconds=20))
    assert reply.completed
    after = control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())
    now = {m.name: m.arrival_rate for m in after.models}
    assert now["scale4"] > rate["scale4"], (rate, now)  # the placer counted them
    metrics = gw.admin("/metrics")[1]  # lpt_packing's collector, in every process's series
    for process in ("0", "1"):
        pattern = rf'gateway_placement_weight{{model="scale4",[^}}]*gateway_process="{process}"}}'
        assert re.search(pattern, metrics), metrics[-2000:]
    placed = placement(after)["scale4"]  # the follower routes by it as soon as Repack returns
    before = {w.url: lpt_e2e.successes(w, "scale4") for w in fleet.workers}
    for _ in range(6):
        follower.infer("scale4", inputs("scale4"))
    for w in fleet.workers:
        grew = lpt_e2e.successes(w, "scale4") - before[w.url]
        assert grew == (6 if placed == [w.url] else 0), (w.url, placed, grew)
