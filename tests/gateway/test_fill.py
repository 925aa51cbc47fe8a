"""lpt_packing fill plans: runs of Q items, spill, rotation, closed loops, the three modes."""

from __future__ import annotations

from collections import Counter, deque

import pytest

from kserve_trio.gateway.config import FillMode, FillPolicy
from kserve_trio.gateway.placement.fill import FillState, fill_quantum

W2 = ("w0", "w1")


def test_the_quantum():
    assert fill_quantum(8, 1.0) == 8
    assert fill_quantum(8, 2.0) == 16
    assert fill_quantum(8, 0.01) == 1
    assert fill_quantum(0, 4.0) == 1


def test_eight_held_requests_land_on_one_replica_and_the_ninth_spills():
    s = FillState(W2, quantum=8)
    picks = [W2[s.choose(1, [0.0, 0.0])] for _ in range(9)]
    assert picks == ["w0"] * 8 + ["w1"]


@pytest.mark.parametrize(
    "requests", [[32], [1] * 32, [16, 8, 8]], ids=["one-32", "32-ones", "16+8+8"]
)
def test_a_run_of_32_items_closes_after_32_items(requests):
    s = FillState(W2, quantum=32)
    picks = [s.choose(units) for units in requests]
    assert set(picks) == {0}
    assert s.choose(1) == 1  # the run is full: the next request opens a run elsewhere


def test_a_run_stays_open_until_it_holds_the_quantum():
    s = FillState(W2, quantum=32)
    assert [s.choose(u) for u in (16, 8)] == [0, 0]
    assert s.choose(1) == 0


def test_fill_rr_alternates_idle_runs_while_fill_least_follows_the_load():
    rr = FillState(W2, quantum=8, policy=FillPolicy.FILL_RR)
    least = FillState(W2, quantum=8, policy=FillPolicy.FILL_LEAST)
    loads = [0.0, 5.0]  # w1's worker is busier
    rr_picks, least_picks = [], []
    for _ in range(4):
        i = rr.choose(8, loads)
        rr_picks.append(W2[i])
        rr.release(i, 8)  # each run completes before the next request: the runs are idle
        j = least.choose(8, loads)
        least_picks.append(W2[j])
        least.release(j, 8)
    assert rr_picks == ["w0", "w1", "w0", "w1"]
    assert least_picks == ["w0"] * 4


def test_a_replica_a_whole_quantum_ahead_loses_its_turn():
    s = FillState(W2, quantum=4, outs=[4, 0], cursor=1, run_target=0, run_units=4)
    # rotation alone would pick w0 (right after the cursor), but w0 holds a whole quantum
    assert s.choose(1) == 1


def test_unknown_batch_size_rotates_one_request_at_a_time():
    s = FillState(("w0", "w1", "w2"), quantum=fill_quantum(0, 1.0))
    assert [s.choose(1) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def closed_loop(mode: FillMode, clients: int, quantum: int, steps: int = 400) -> Counter:
    """``clients`` one-item requests always in flight; the oldest completes, a new one is
    routed. Returns how many requests each replica took."""
    s = FillState(W2, quantum=quantum, mode=mode)
    inflight: deque[int] = deque()
    taken: Counter = Counter()
    for _ in range(clients):
        i = s.choose(1)
        inflight.append(i)
        taken[W2[i]] += 1
    for _ in range(steps):
        s.release(inflight.popleft(), 1)
        i = s.choose(1)
        inflight.append(i)
        taken[W2[i]] += 1
    return taken


@pytest.mark.parametrize("clients", [2, 4, 8])
def test_closed_loops_share_evenly_under_run_and_park_under_inflight(clients):
    q = 8
    run = closed_loop(FillMode.RUN, clients, q)
    total = sum(run.values())
    assert abs(run["w0"] - run["w1"]) <= q, run
    assert run["w0"] / total == pytest.approx(0.5, abs=0.05)
    inflight = closed_loop(FillMode.INFLIGHT, clients, q)
    assert inflight["w1"] == 0, inflight  # every request parked on w0


def test_spread_is_least_outstanding_with_rotation_on_ties():
    s = FillState(W2, quantum=8, mode=FillMode.SPREAD)
    assert [s.choose(1) for _ in range(4)] == [0, 1, 0, 1]
    s.release(0, 1)
    assert s.choose(1) == 0


def test_failover_order_and_carried_state():
    s = FillState(("w0", "w1", "w2"), quantum=2, outs=[0, 5, 1])
    assert s.order(0) == ["w0", "w2", "w1"]
    s.choose(1)
    moved = s.carried(("w1", "w3"), quantum=4)
    assert moved.outs == [5, 0]
    assert moved.run_target is None and moved.quantum == 4
