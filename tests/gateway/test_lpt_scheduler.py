"""lpt_packing's scheduler as plain logic: tick and repack rules, rates and costs, drift, the
compaction cadence, the start-up preconditions, and the control RPCs' pure parts (update masks,
placement overrides). Polls are built from the control plane's own messages."""

from __future__ import annotations

import pytest

from kserve_trio.core.errors import ConfigError, InvalidArgument
from kserve_trio.gateway.config import (
    CompactionMode,
    FillMode,
    FillPolicy,
    ModelPlacementConfig,
    SchedulingConfig,
    SchedulingMode,
)
from kserve_trio.gateway.fleet.routing import build_routing_table
from kserve_trio.gateway.fleet.routing_metadata import aggregate_poll, fold_poll
from kserve_trio.gateway.placement.assignment import Assignment, Placement
from kserve_trio.gateway.placement.compaction import compaction_jobs
from kserve_trio.gateway.placement.control import (
    apply_policy_update,
    placement_override,
    policy_message,
    scheduling_status,
)
from kserve_trio.gateway.placement.policy import LptPacking
from kserve_trio.gateway.placement.scheduler import (
    NO_REPACK_YET,
    LptScheduler,
    LptStartupError,
    check_preconditions,
)
from kserve_trio.proto import reactant_control as rc

LPT = SchedulingMode.LPT_PACKING


def reply(models: dict[str, tuple[float, int, int]], budget: int = 0, discipline: str = "fifo"):
    """A ModelControlStatus reply: model -> (compute seconds, requests, weight bytes)."""
    return rc.ModelControlStatusResponse(
        discipline=discipline,
        weight_cache_max_bytes=budget,
        models=[
            rc.ModelStatus(
                name=name,
                total_compute_seconds=c,
                requests_served=q,
                rows_served=q,
                weight_nbytes=nb,
                max_batch_size=8,
                batch_input_name="x",
                batch_axis=1,
            )
            for name, (c, q, nb) in models.items()
        ],
    )


def scheduler(**knobs) -> LptScheduler:
    cfg = SchedulingConfig(mode=LPT, **knobs)
    return LptScheduler(cfg, LptPacking(cfg.basis), clients=dict)


def started(s: LptScheduler, replies) -> None:
    """What ``start`` does once its poll has every reply."""
    s.begin(replies)


def feed(s: LptScheduler, replies):
    """One prober round: the metadata fold, then the tick (through the policy's hook)."""
    meta = fold_poll(s.policy.metadata, aggregate_poll(replies))
    s.policy.update_metadata(meta)
    return s.last_report


TWO = {"w0": {"a": (0.0, 0, 10), "b": (0.0, 0, 10)}, "w1": {"a": (0.0, 0, 10), "b": (0.0, 0, 10)}}


def replies_at(compute: float, requests: int = 0):
    return {w: reply({m: (compute, requests, 10) for m in ("a", "b")}) for w in ("w0", "w1")}


def test_the_first_budget_holds_until_the_first_compute_repack_then_the_rebalance_budget():
    s = scheduler(first_rebalance_compute_seconds=10, rebalance_compute_seconds=100)
    started(s, replies_at(0.0))
    assert s.book.count == 1 and s.book.by_trigger == {"startup": 1}
    assert s.threshold == 10
    feed(s, replies_at(0.0))  # the first observation is the baseline
    feed(s, replies_at(2.0))  # 2 workers x 2 models x 2 s = 8 s of fleet compute
    assert s.book.count == 1 and s.accum == pytest.approx(8.0)
    feed(s, replies_at(3.0))  # +8 s: 16 >= 10
    assert s.book.by_trigger.get("compute") == 1 and s.accum == 0.0
    assert s.book.first_compute_done and s.threshold == 100


def test_an_operator_repack_does_not_consume_the_first_budget():
    s = scheduler(first_rebalance_compute_seconds=10)
    started(s, replies_at(0.0))
    feed(s, replies_at(0.0))
    sequence = s.request_repack()
    report = feed(s, replies_at(1.0))
    assert report.trigger == "operator" and s.book.completed == sequence
    assert not s.book.first_compute_done and s.threshold == 10


def test_a_fall_in_fleet_compute_rebaselines_without_counting():
    s = scheduler(first_rebalance_compute_seconds=1000)
    started(s, replies_at(0.0))
    feed(s, replies_at(5.0))  # first observation: baseline 20
    feed(s, replies_at(6.0))  # +4
    feed(s, replies_at(1.0))  # a restart: back to 4, nothing added
    feed(s, replies_at(2.0))  # +4
    assert s.accum == pytest.approx(8.0)


def test_utilization_is_rate_times_cost_and_places_the_busier_model_first():
    s = scheduler(first_rebalance_compute_seconds=1000)
    started(s, replies_at(0.0))
    s._last_repack -= 10.0  # ten seconds of wall time since the start-up repack
    for _ in range(40):
        s.policy.select("a", 1, build_routing_table({"w0": ["a"]}))
    for _ in range(10):
        s.policy.select("b", 1, build_routing_table({"w0": ["b"]}))
    s.request_repack()
    busy = {
        w: reply({"a": (2.0, 20, 10), "b": (0.5, 5, 10)}) for w in ("w0", "w1")
    }  # a: 4 s / 40 requests, b: 1 s / 10 requests
    feed(s, busy)
    assert s.rate["a"] == pytest.approx(4.0, rel=0.01)  # first samples are adopted as is
    assert s.cost["a"] == pytest.approx(0.1) and s.cost["b"] == pytest.approx(0.1)
    assert s.util["a"] == pytest.approx(0.4, rel=0.01)
    assert s.util["a"] > s.util["b"] > 0
    placed = {m: p.workers for m, p in s.policy.assignment.placements.items()}
    assert placed == {"a": ("w0",), "b": ("w1",)}


def test_a_model_only_some_workers_report_is_drifted_and_spread_over_them():
    s = scheduler()
    replies = {
        "w0": reply({"a": (0, 0, 1), "c": (0, 0, 1)}),
        "w1": reply({"a": (0, 0, 1), "c": (0, 0, 1)}),
        "w2": reply({"a": (0, 0, 1), "c": (0, 0, 1)}),
    }
    started(s, replies)
    replies["w2"] = reply({"a": (0, 0, 1), "c": (0, 0, 1), "d": (0, 0, 1)})
    replies["w1"] = reply({"a": (0, 0, 1), "c": (0, 0, 1), "d": (0, 0, 1)})
    s.request_repack()
    report = feed(s, replies)
    assert report.drifted == ("d",)
    assert s.policy.assignment.placements["d"] == Placement(("w1", "w2"), (0.5, 0.5))
    assert any("'d' is reported by ['w1', 'w2'] only" in w for w in report.warnings)
    status = scheduling_status(s)
    (d,) = [m for m in status.models if m.name == "d"]
    assert d.drifted and d.placed


@pytest.mark.parametrize(
    ("mode", "interval", "fires"),
    [
        (CompactionMode.EAGER, 1, [True, True, True]),
        (CompactionMode.EAGER, 2, [True, False, True]),  # the start-up repack counted one
        (CompactionMode.OFF, 1, [False, False, False]),
        (CompactionMode.EAGER, 0, [False, False, False]),
    ],
)
def test_the_compaction_cadence(mode, interval, fires):
    s = scheduler(compaction_mode=mode, compaction_interval=interval)
    started(s, replies_at(0.0))
    fired = []
    for k in range(3):  # each repack moves b to the other worker (replicas flip 1 <-> 2)
        s.set_override("b", ModelPlacementConfig(replicas=2 if k % 2 == 0 else 1))
        s.request_repack()
        report = feed(s, replies_at(0.0))
        assert report.changed_workers
        fired.append(bool(report.compacted))
    assert fired == fires


def test_a_repack_without_a_change_compacts_nothing():
    s = scheduler()
    started(s, replies_at(0.0))
    s.request_repack()
    report = feed(s, replies_at(0.0))
    assert report.changed_workers == () and report.compacted == ()


def test_compaction_jobs_reload_the_newly_assigned_models_when_scheduled():
    old = Assignment({"a": Placement(("w0",), (1.0,)), "b": Placement(("w1",), (1.0,))})
    new = Assignment({"a": Placement(("w1",), (1.0,)), "b": Placement(("w1",), (1.0,))})
    changed = ["w0", "w1"]
    assert compaction_jobs(old, new, changed, CompactionMode.EAGER) == {"w0": [], "w1": []}
    assert compaction_jobs(old, new, changed, CompactionMode.SCHEDULED) == {
        "w0": [],
        "w1": ["a"],
    }


def test_start_up_preconditions_name_the_worker_and_the_fix():
    with pytest.raises(LptStartupError, match=r"worker w1 runs the 'fair' discipline.*fifo or edf"):
        check_preconditions({"w0": reply({"a": (0, 0, 1)}), "w1": reply({}, discipline="fair")})
    with pytest.raises(LptStartupError, match=r"different model sets.*w0: \['a'\]; w1: \['b'\]"):
        check_preconditions({"w0": reply({"a": (0, 0, 1)}), "w1": reply({"b": (0, 0, 1)})})
    check_preconditions({"w0": reply({"a": (0, 0, 1)}, discipline="edf")})


def test_status_before_any_repack_says_so_and_reports_the_knobs():
    s = scheduler(ema_halflife_compute_seconds=0, rebalance_compute_seconds=120)
    status = scheduling_status(s)
    assert NO_REPACK_YET in status.warnings
    assert status.policy.ema_halflife_compute_seconds == 120  # resolved, never 0
    assert status.policy.default_replicas == 1 and status.policy.max_worker_share == 0.8


# ---- SetSchedulingPolicy's mask, SetModelPlacement's override (pure) -------------------------


def test_update_masks_are_all_or_nothing():
    knobs = SchedulingConfig(mode=LPT)
    msg = policy_message(knobs, 0)
    msg.hysteresis, msg.routing_fill_factor = 0.2, -1.0
    with pytest.raises(ConfigError, match="routing_fill_factor"):
        apply_policy_update(knobs, ["hysteresis", "routing_fill_factor"], msg)
    msg.routing_fill_factor = 2.0
    msg.routing_policy, msg.routing_fill_mode, msg.default_replicas = "FILL_RR", "spread", -1
    new = apply_policy_update(
        knobs,
        [
            "hysteresis",
            "routing_fill_factor",
            "routing_policy",
            "routing_fill_mode",
            "default_replicas",
        ],
        msg,
    )
    assert (new.hysteresis, new.routing_fill_factor, new.default_replicas) == (0.2, 2.0, -1)
    assert new.routing_policy is FillPolicy.FILL_RR and new.routing_fill_mode is FillMode.SPREAD
    assert knobs.hysteresis == 0.0  # the old snapshot is untouched


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ([], "non-empty update_mask"),
        (["mode"], "'mode' cannot be changed at runtime"),
        (["max_worker_share"], "'max_worker_share' cannot be changed at runtime"),
        (["endpoints"], "cannot be changed at runtime"),
        (["hysterisis"], "unknown update_mask name 'hysterisis'; accepted: rebalance_compute"),
    ],
)
def test_update_mask_names_are_checked(mask, message):
    knobs = SchedulingConfig(mode=LPT)
    with pytest.raises(InvalidArgument, match=message):
        apply_policy_update(knobs, mask, policy_message(knobs, 0))


def test_a_zero_halflife_tracks_the_new_rebalance_budget_and_least_outstanding_is_refused():
    knobs = SchedulingConfig(mode=LPT, ema_halflife_compute_seconds=50)
    msg = policy_message(knobs, 0)
    msg.ema_halflife_compute_seconds, msg.rebalance_compute_seconds = 0.0, 90.0
    new = apply_policy_update(
        knobs, ["ema_halflife_compute_seconds", "rebalance_compute_seconds"], msg
    )
    assert new.halflife == 90.0
    msg.routing_policy = "least_outstanding"
    with pytest.raises(ConfigError, match="use fill_least or fill_rr"):
        apply_policy_update(knobs, ["routing_policy"], msg)


def test_placement_overrides_set_clear_and_keep_fields():
    def req(**kw):
        return rc.SetModelPlacementRequest(name="m", **{"fill_factor": -1.0, **kw})

    o = placement_override(None, req(replicas=3, fill_mode="Spread", fill_factor=2.0))
    assert o == ModelPlacementConfig(3, FillMode.SPREAD, 2.0)
    kept = placement_override(o, req(replicas=3))  # fill fields unchanged
    assert kept == o
    cleared = placement_override(o, req(replicas=0, fill_mode="inherit", fill_factor=0.0))
    assert cleared.empty
    assert placement_override(None, req(replicas=-1)).replicas == -1
    with pytest.raises(InvalidArgument, match="replicas must be"):
        placement_override(None, req(replicas=-2))
    with pytest.raises(InvalidArgument, match="fill_mode must be"):
        placement_override(None, req(fill_mode="sideways"))
