"""lpt_packing routing: placement-driven selection, fill plans across replicas, reservations."""

from __future__ import annotations

from kserve_trio.gateway.config import FillMode, WorkBasis
from kserve_trio.gateway.fleet.routing import RoutingTable
from kserve_trio.gateway.fleet.routing_metadata import ModelCost, RoutingMetadata
from kserve_trio.gateway.placement.assignment import compute_assignment
from kserve_trio.gateway.placement.policy import FillSettings, LptPacking

W = ("w0", "w1", "w2")


def table(*models: str, workers=W) -> RoutingTable:
    return RoutingTable({m: tuple(workers) for m in models}, tuple(workers))


def policy(**kw) -> LptPacking:
    meta = RoutingMetadata(
        models={
            "a": ModelCost(cost_per_request=0.01, cost_per_item=0.01, max_batch_size=4),
            "b": ModelCost(cost_per_request=0.02, cost_per_item=0.02, max_batch_size=4),
        }
    )
    return LptPacking(metadata=meta, **kw)


def test_unplaced_models_rotate_over_ready_replicas_without_reservations():
    p = policy()
    t = table("new")
    picks = [p.select("new", 1, t) for _ in range(4)]
    assert [s.order[0] for s in picks] == ["w0", "w1", "w2", "w0"]
    assert p.inflight_work() == {}


def test_a_single_placement_routes_there_and_reserves_its_load_once():
    p = policy()
    p.repack(compute_assignment({"a": 0.5, "b": 0.4}, W))
    t = table("a", "b")
    s = p.select("a", 2, t)
    assert s.order == ("w0", "w1", "w2")
    assert p.inflight_work() == {"w0": 0.02}  # 2 items x 0.01 s under the compute basis
    s.reservation.release()
    s.reservation.release()
    assert p.inflight_work() == {}
    assert p.select("b", 1, t).order[0] == "w1"
    assert p.routed("a", "w0") == 1


def test_a_placed_worker_that_is_not_ready_falls_back_to_the_others():
    p = policy()
    p.repack(compute_assignment({"a": 0.5}, W))
    s = p.select("a", 1, table("a", workers=("w1", "w2")))
    assert s.order[0] in ("w1", "w2")


def test_multi_replica_models_fill_runs_of_the_quantum():
    p = policy(fill=FillSettings(FillMode.RUN))
    p.repack(compute_assignment({"a": 0.9}, W, replicas={"a": 2}))
    t = table("a")
    held = [p.select("a", 1, t) for _ in range(5)]
    # Q = max_batch 4 x factor 1: four requests on the first replica, the fifth spills
    assert [s.order[0] for s in held] == ["w0"] * 4 + ["w1"]
    assert held[0].order[-1] == "w2"  # outside the placement: last-resort failover
    for s in held:
        s.reservation.release()
    assert p.inflight_work() == {}
    assert p.fills["a"].outs == [0, 0]


def test_the_request_basis_charges_the_per_request_cost():
    p = policy(basis=WorkBasis.REQUESTS)
    p.repack(compute_assignment({"a": 0.5}, W))
    p.select("a", 8, table("a"))
    assert p.inflight_work() == {"w0": 0.01}
    p2 = policy(basis=WorkBasis.ITEMS)
    p2.repack(compute_assignment({"a": 0.5}, W))
    p2.select("a", 8, table("a"))
    assert p2.inflight_work() == {"w0": 8.0}


def test_repack_carries_in_flight_counts_and_drops_departed_replicas():
    p = policy()
    p.repack(compute_assignment({"a": 0.9}, W, replicas={"a": 2}))
    s = p.select("a", 1, table("a"))
    assert p.fills["a"].replicas == ("w0", "w1")
    p.repack(compute_assignment({"a": 0.9}, W, replicas={"a": 3}))
    assert p.fills["a"].replicas == W
    assert p.fills["a"].outs == [1, 0, 0]
    s.reservation.release()
    assert p.fills["a"].outs == [0, 0, 0]
    p.repack(compute_assignment({"a": 0.9}, W))
    assert "a" not in p.fills
