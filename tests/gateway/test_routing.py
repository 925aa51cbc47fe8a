"""The routing table, round_robin and least_outstanding (every work basis), reservations and
the failover rules."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.config import SchedulingConfig, SchedulingMode, WorkBasis
from kserve_trio.gateway.fleet.routing import (
    EMPTY_TABLE,
    Failover,
    LeastOutstanding,
    Reservation,
    RoundRobin,
    RoutingPolicy,
    RoutingState,
    RoutingTable,
    Selection,
    build_routing_table,
    diff_tables,
    failover_action,
    make_policy,
    quantize,
    ready_model_names,
)
from kserve_trio.gateway.fleet.routing_metadata import ModelCost, RoutingMetadata
from kserve_trio.proto import inference as pb

TABLE = build_routing_table({"w2": ["m", "only2"], "w0": ["m"], "w1": ["m", "m"]})


# --------------------------------------------------------------------------------------------
# the table


def test_the_table_maps_models_to_sorted_ready_replicas():
    assert TABLE.models == {"m": ("w0", "w1", "w2"), "only2": ("w2",)}
    assert TABLE.workers == ("w0", "w1", "w2")
    assert TABLE.replicas("unknown") == () and TABLE.size == 2
    assert EMPTY_TABLE.size == 0


def test_ready_model_names_keeps_ready_entries_only():
    reply = pb.RepositoryIndexResponse(
        models=[
            pb.RepositoryIndexResponseModelIndex(name="a", version="1", state="READY"),
            pb.RepositoryIndexResponseModelIndex(name="b", state="UNAVAILABLE"),
            pb.RepositoryIndexResponseModelIndex(name="c"),
            pb.RepositoryIndexResponseModelIndex(name="", state="READY"),
        ]
    )
    assert ready_model_names(reply) == ["a", "c"]


def test_swapping_the_table_reports_what_changed():
    state = RoutingState()
    first = state.swap(TABLE)
    assert first.added == ("m", "only2") and not first.removed
    new = build_routing_table({"w0": ["m", "fresh"], "w1": ["m"]})
    diff = state.swap(new)
    assert state.table is new
    assert (diff.added, diff.removed, diff.changed) == (("fresh",), ("only2",), ("m",))
    assert diff_tables(new, new).empty


def test_a_selection_uses_the_snapshot_it_was_given():
    state = RoutingState(TABLE)
    snapshot = state.table
    state.swap(EMPTY_TABLE)
    assert RoundRobin().select("m", 1, snapshot).order[0] == "w0"
    assert RoundRobin().select("m", 1, state.table).order == ()


def test_the_routing_document():
    doc = TABLE.to_json({"w1": True, "w0": False, "w2": True, "w3": False})
    assert doc == {
        "models": {"m": ["w0", "w1", "w2"], "only2": ["w2"]},
        "workers": [
            {"worker": "w0", "ready": False},
            {"worker": "w1", "ready": True},
            {"worker": "w2", "ready": True},
            {"worker": "w3", "ready": False},
        ],
    }


# --------------------------------------------------------------------------------------------
# reservations


def test_a_reservation_is_released_exactly_once():
    calls = []
    r = Reservation(lambda: calls.append(1))
    assert not r.released
    r.release()
    r.release()
    with r:
        pass
    assert calls == [1] and r.released
    assert Reservation().released  # nothing to release


# --------------------------------------------------------------------------------------------
# round_robin


def test_round_robin_rotates_and_lists_the_others_as_failover():
    rr = RoundRobin()
    orders = [rr.select("m", 1, TABLE).order for _ in range(4)]
    assert orders == [
        ("w0", "w1", "w2"),
        ("w1", "w2", "w0"),
        ("w2", "w0", "w1"),
        ("w0", "w1", "w2"),
    ]
    assert rr.select("only2", 1, TABLE).order == ("w2",)
    assert rr.select("unknown", 1, TABLE).order == ()


def test_round_robin_reserves_nothing_and_keeps_rotating_across_swaps():
    rr = RoundRobin()
    sel = rr.select("m", 1, TABLE)
    assert sel.reservation.released and rr.inflight_work() == {}
    smaller = build_routing_table({"w0": ["m"], "w1": ["m"]})
    picks = [rr.select("m", 1, smaller).order[0] for _ in range(4)]
    assert picks == ["w1", "w0", "w1", "w0"]  # cursor 1, 2, 3, 4 mod 2
    assert rr.batch_input("m") is None and rr.request_units("m", (8,)) == 1
    assert not rr.needs_metadata and rr.mode == "round_robin"


def test_round_robin_spreads_evenly():
    rr = RoundRobin()
    counts = collections.Counter(rr.select("m", 1, TABLE).order[0] for _ in range(300))
    assert counts == {"w0": 100, "w1": 100, "w2": 100}


# --------------------------------------------------------------------------------------------
# least_outstanding


META = RoutingMetadata(
    models={
        "m": ModelCost(cost_per_item=0.5, batch_input_name="x", batch_axis=1),
        "cheap": ModelCost(cost_per_item=0.001),
    },
    mean_cost_per_item=0.25,
)


def test_least_outstanding_picks_the_least_loaded_and_ties_go_to_the_smaller_label():
    lo = LeastOutstanding(WorkBasis.REQUESTS)
    a = lo.select("m", 1, TABLE)
    b = lo.select("m", 1, TABLE)
    c = lo.select("m", 1, TABLE)
    assert [s.order[0] for s in (a, b, c)] == ["w0", "w1", "w2"]
    b.reservation.release()
    d = lo.select("m", 1, TABLE)
    assert d.order == ("w1", "w0", "w2")  # w1 is idle again; then ties by label
    assert lo.inflight_work() == {"w0": 1.0, "w1": 1.0, "w2": 1.0}


@pytest.mark.parametrize(
    ("basis", "model", "units", "charge"),
    [
        (WorkBasis.REQUESTS, "m", 8, 1.0),
        (WorkBasis.ITEMS, "m", 8, 8.0),
        (WorkBasis.COMPUTE, "m", 8, 4.0),  # 8 items x 0.5 s
        (WorkBasis.COMPUTE, "unmeasured", 8, 2.0),  # the fleet mean item cost
    ],
)
def test_the_charge_follows_the_work_basis(basis, model, units, charge):
    lo = LeastOutstanding(basis, META)
    assert lo.charge(model, units) == charge
    table = build_routing_table({"w0": [model], "w1": [model]})
    sel = lo.select(model, units, table)
    assert lo.inflight_work() == {"w0": charge}
    sel.reservation.release()
    assert lo.inflight_work() == {}


def test_compute_charge_is_never_zero_without_metadata():
    lo = LeastOutstanding(WorkBasis.COMPUTE)
    assert lo.charge("m", 3) == 3.0


def test_items_and_compute_peek_the_batch_input_and_requests_does_not():
    assert LeastOutstanding(WorkBasis.REQUESTS, META).batch_input("m") is None
    for basis in (WorkBasis.ITEMS, WorkBasis.COMPUTE):
        lo = LeastOutstanding(basis, META)
        assert lo.needs_metadata
        assert lo.batch_input("m") == ("x", 1) and lo.batch_input("cheap") is None
        assert lo.request_units("m", (8, 16)) == 8 and lo.request_units("m", None) == 1
    assert LeastOutstanding(WorkBasis.REQUESTS, META).request_units("m", (8, 16)) == 1
    assert not LeastOutstanding(WorkBasis.REQUESTS).needs_metadata


def test_a_release_subtracts_the_charge_taken_even_after_the_costs_moved():
    lo = LeastOutstanding(WorkBasis.COMPUTE, META)
    table = build_routing_table({"w0": ["m"]})
    sel = lo.select("m", 2, table)  # charged 1.0
    lo.update_metadata(RoutingMetadata(models={"m": ModelCost(cost_per_item=9.0)}))
    sel.reservation.release()
    assert lo.inflight_work() == {}


def test_float_residue_is_snapped_to_exactly_zero():
    lo = LeastOutstanding(
        WorkBasis.COMPUTE, RoutingMetadata(models={"m": ModelCost(cost_per_item=0.1)})
    )
    table = build_routing_table({"w0": ["m"], "w1": ["m"]})
    held = [lo.select("m", 1, build_routing_table({"w0": ["m"]})) for _ in range(3)]
    for sel in (held[1], held[0], held[2]):  # 0.1 + 0.1 + 0.1 - 0.1 - 0.1 - 0.1 != 0.0 in floats
        sel.reservation.release()
    assert lo.inflight_work() == {}
    assert lo.select("m", 1, table).order[0] == "w0"  # an exact tie, not residue, decides


def test_loads_within_one_quantum_tie_and_the_label_decides():
    lo = LeastOutstanding(
        WorkBasis.COMPUTE, RoutingMetadata(models={"m": ModelCost(cost_per_item=1e-10)})
    )
    table = build_routing_table({"w0": ["m"], "w1": ["m"]})
    lo.select("m", 1, build_routing_table({"w0": ["m"]}))  # w0 carries 1e-10: under a quantum
    assert quantize(1e-10) == 0
    assert lo.select("m", 1, table).order == ("w0", "w1")  # a tie with idle w1: the label


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(1, 64), st.sampled_from(["a", "b"])), max_size=60
    ),
    basis=st.sampled_from(list(WorkBasis)),
)
def test_every_load_returns_to_zero_once_all_reservations_are_released(ops, basis):
    meta = RoutingMetadata(
        models={"a": ModelCost(cost_per_item=0.013), "b": ModelCost(cost_per_item=7.7)}
    )
    lo = LeastOutstanding(basis, meta)
    table = build_routing_table({"w0": ["a", "b"], "w1": ["a"], "w2": ["a", "b"]})
    held: list[Selection] = []
    for select, units, model in ops:
        if select or not held:
            sel = lo.select(model, units, table)
            chosen = sel.order[0]
            least = min(quantize(lo.inflight_work().get(w, 0.0)) for w in table.replicas(model))
            assert chosen in table.replicas(model)
            assert least <= quantize(lo.inflight_work()[chosen])
            held.append(sel)
        else:
            held.pop(units % len(held)).reservation.release()
    for sel in held:
        sel.reservation.release()
    assert lo.inflight_work() == {}


def test_make_policy_follows_the_mode():
    assert isinstance(make_policy(SchedulingConfig()), RoundRobin)
    lo = make_policy(SchedulingConfig(SchedulingMode.LEAST_OUTSTANDING, WorkBasis.ITEMS))
    assert isinstance(lo, LeastOutstanding) and lo.basis is WorkBasis.ITEMS
    default = make_policy(SchedulingConfig(SchedulingMode.LEAST_OUTSTANDING))
    assert default.basis is WorkBasis.COMPUTE and default.mode == "least_outstanding"


def test_both_policies_implement_the_interface():
    for policy in (RoundRobin(), LeastOutstanding(WorkBasis.ITEMS)):
        p: RoutingPolicy = policy
        for name in ("mode", "basis", "needs_metadata"):
            assert hasattr(p, name)
        p.update_metadata(META)
        assert isinstance(p.select("m", 1, TABLE), Selection)


# --------------------------------------------------------------------------------------------
# failover


def test_failover_rules():
    assert failover_action(StatusCode.NOT_FOUND) is Failover.NEXT_AND_REFRESH
    assert failover_action(StatusCode.UNAVAILABLE) is Failover.NEXT
    for status in StatusCode:
        if status not in (StatusCode.NOT_FOUND, StatusCode.UNAVAILABLE):
            assert failover_action(status) is Failover.RETURN, status


def test_a_table_is_frozen():
    with pytest.raises(AttributeError):
        TABLE.models = {}  # type: ignore[misc]
    assert isinstance(TABLE, RoutingTable)
