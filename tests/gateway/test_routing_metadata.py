"""Routing metadata from ModelControlStatus replies: aggregation, cost EWMAs, restarts, batch
axes (1-based into the wire shape) and request_items."""

from __future__ import annotations

import math

import pytest

from kserve_trio.gateway.fleet.routing_metadata import (
    EMPTY_METADATA,
    Counters,
    ModelCost,
    RoutingMetadata,
    aggregate_poll,
    ewma,
    fold_poll,
)
from kserve_trio.proto import reactant_control as rc


def status(name: str, compute: float, requests: int, rows: int, **kw) -> rc.ModelStatus:
    return rc.ModelStatus(
        name=name,
        total_compute_seconds=compute,
        requests_served=requests,
        rows_served=rows,
        **kw,
    )


def reply(*models: rc.ModelStatus, cache: int = 0) -> rc.ModelControlStatusResponse:
    return rc.ModelControlStatusResponse(
        residency_mode="self_managed",
        discipline="fifo",
        models=list(models),
        weight_cache_max_bytes=cache,
    )


def fold(meta: RoutingMetadata, replies: dict, **kw) -> RoutingMetadata:
    return fold_poll(meta, aggregate_poll(replies), **kw)


# --------------------------------------------------------------------------------------------
# ewma


def test_ewma_halves_after_one_halflife_and_ignores_zero_elapsed():
    assert ewma(0.0, 1.0, 300.0, 300.0) == pytest.approx(0.5)
    assert ewma(0.0, 1.0, 600.0, 300.0) == pytest.approx(0.75)
    assert ewma(4.0, 1.0, 0.0, 300.0) == 4.0  # no compute consumed: no move
    assert ewma(4.0, 1.0, -1.0, 300.0) == 4.0
    assert ewma(4.0, 1.0, 10.0, 0.0) == 1.0  # no half-life: the sample


# --------------------------------------------------------------------------------------------
# aggregate_poll


def test_aggregation_sums_counters_and_takes_maxima_and_the_first_batch_input():
    poll = aggregate_poll(
        {
            "w1": reply(
                status("m", 2.0, 3, 30, weight_nbytes=100, max_batch_size=8),
                status("solo", 1.0, 1, 1),
                cache=1 << 30,
            ),
            "w0": reply(
                status(
                    "m",
                    1.0,
                    1,
                    4,
                    weight_nbytes=50,
                    max_batch_size=16,
                    batch_input_name="x",
                    batch_axis=1,
                ),
                status("m", 99.0, 99, 99),  # a duplicate entry: the first counts
            ),
        }
    )
    m = poll.models["m"]
    assert (m.total_compute_seconds, m.requests_served, m.rows_served) == (3.0, 4, 34)
    assert (m.weight_nbytes, m.max_batch_size) == (100, 16)
    assert (m.batch_input_name, m.batch_axis) == ("x", 1)
    assert m.workers == ("w0", "w1")
    assert poll.models["solo"].workers == ("w1",)
    assert poll.polled == ("w0", "w1")
    assert poll.weight_cache_max_bytes == {"w0": 0, "w1": 1 << 30}
    assert poll.fleet_compute_seconds == pytest.approx(4.0)
    assert poll.counters[("w0", "m")] == Counters(1.0, 1, 4)


def test_the_batch_input_comes_from_the_first_worker_in_label_order_that_declares_one():
    poll = aggregate_poll(
        {
            "b": reply(status("m", 0, 0, 0, batch_input_name="late", batch_axis=2)),
            "a": reply(status("m", 0, 0, 0, batch_input_name="nameless", batch_axis=0)),
            "c": reply(status("m", 0, 0, 0, batch_input_name="later", batch_axis=1)),
        }
    )
    assert (poll.models["m"].batch_input_name, poll.models["m"].batch_axis) == ("late", 2)


# --------------------------------------------------------------------------------------------
# fold_poll


def test_cost_per_request_and_per_item_from_the_first_poll():
    meta = fold(EMPTY_METADATA, {"w0": reply(status("m", 10.0, 5, 40))})
    assert meta.models["m"].cost_per_request == pytest.approx(2.0)
    assert meta.models["m"].cost_per_item == pytest.approx(0.25)
    assert meta.item_cost("m") == pytest.approx(0.25)
    assert meta.mean_cost_per_item == pytest.approx(0.25)


def test_costs_come_from_deltas_summed_over_workers():
    meta = fold(
        EMPTY_METADATA,
        {"w0": reply(status("m", 0.2, 4, 16)), "w1": reply(status("m", 0.0, 0, 0))},
    )
    assert meta.models["m"].cost_per_item == pytest.approx(0.0125)
    assert meta.models["m"].cost_per_request == pytest.approx(0.05)


def test_later_samples_move_the_average_by_fleet_compute_elapsed():
    meta = fold(EMPTY_METADATA, {"w0": reply(status("m", 10.0, 5, 40))})
    # +30 s of compute over 30 more requests (1 s each) and 30 rows: dt = 30 = one half-life.
    meta = fold(meta, {"w0": reply(status("m", 40.0, 35, 70))}, halflife=30.0)
    assert meta.models["m"].cost_per_request == pytest.approx(0.5 * 2.0 + 0.5 * 1.0)
    assert meta.models["m"].cost_per_item == pytest.approx(0.5 * 0.25 + 0.5 * 1.0)


def test_dt_is_the_whole_fleets_compute_not_the_models_own():
    meta = fold(
        EMPTY_METADATA,
        {"w0": reply(status("m", 10.0, 5, 40), status("busy", 1.0, 1, 1))},
    )
    meta = fold(
        meta,
        {"w0": reply(status("m", 11.0, 6, 41), status("busy", 60.0, 2, 2))},
        halflife=30.0,
    )
    dt = 1.0 + 59.0
    a = 1 - 2 ** (-dt / 30.0)
    assert meta.models["m"].cost_per_request == pytest.approx((1 - a) * 2.0 + a * 1.0)


def test_no_growth_keeps_the_costs():
    meta = fold(EMPTY_METADATA, {"w0": reply(status("m", 10.0, 5, 40))})
    again = fold(meta, {"w0": reply(status("m", 10.0, 5, 40))})
    assert again.models["m"] == meta.models["m"]


def test_a_restarted_worker_counts_from_zero_instead_of_going_negative():
    meta = fold(
        EMPTY_METADATA,
        {"w0": reply(status("m", 100.0, 50, 50)), "w1": reply(status("m", 100.0, 50, 50))},
    )
    assert meta.models["m"].cost_per_request == pytest.approx(2.0)
    # w1 restarted: its counters are what it did since (4 s over 4 requests, 1 s each).
    meta = fold(
        meta,
        {"w0": reply(status("m", 100.0, 50, 50)), "w1": reply(status("m", 4.0, 4, 4))},
        halflife=4.0,
    )
    assert meta.baseline[("w1", "m")] == Counters(4.0, 4, 4)
    assert meta.models["m"].cost_per_request == pytest.approx(0.5 * 2.0 + 0.5 * 1.0)


def test_a_worker_missing_a_round_resumes_from_its_baseline():
    first = {"w0": reply(status("m", 10.0, 10, 10)), "w1": reply(status("m", 10.0, 10, 10))}
    meta = fold(EMPTY_METADATA, first)
    meta = fold(meta, {"w0": reply(status("m", 10.0, 10, 10))})  # w1 not ready this round
    assert meta.baseline[("w1", "m")] == Counters(10.0, 10, 10)
    meta = fold(
        meta,
        {"w0": reply(status("m", 10.0, 10, 10)), "w1": reply(status("m", 12.0, 12, 12))},
        halflife=1e-9,  # adopt the sample: it must be the delta's 1.0, not 12/12 from zero
    )
    assert meta.models["m"].cost_per_request == pytest.approx(1.0)


def test_fleet_mean_item_cost_and_the_fallbacks():
    meta = fold(
        EMPTY_METADATA,
        {"w0": reply(status("a", 1.0, 1, 4), status("b", 3.0, 1, 4), status("idle", 0, 0, 0))},
    )
    assert meta.mean_cost_per_item == pytest.approx((0.25 + 0.75) / 2)
    assert meta.item_cost("idle") == pytest.approx(0.5)  # unmeasured: the fleet mean
    assert meta.item_cost("unknown") == pytest.approx(0.5)
    assert EMPTY_METADATA.item_cost("anything") == 1.0  # nothing measured: never 0


def test_a_model_missing_its_batch_axis_this_round_keeps_the_previous_one():
    meta = fold(
        EMPTY_METADATA,
        {"w0": reply(status("m", 0, 0, 0, batch_input_name="x", batch_axis=2, max_batch_size=8))},
    )
    assert meta.batch_input("m") == ("x", 2)
    meta = fold(meta, {"w0": reply(status("m", 0, 0, 0, max_batch_size=4))})
    assert meta.batch_input("m") == ("x", 2)
    assert meta.models["m"].max_batch_size == 4
    meta = fold(meta, {"w0": reply(status("m", 0, 0, 0, batch_input_name="y", batch_axis=1))})
    assert meta.batch_input("m") == ("y", 1)


def test_models_absent_from_a_poll_keep_their_metadata():
    meta = fold(EMPTY_METADATA, {"w0": reply(status("m", 10.0, 5, 40))})
    later = fold(meta, {"w0": reply(status("other", 1.0, 1, 1))})
    assert later.models["m"] == meta.models["m"]
    assert later.last_poll is not None and set(later.last_poll.models) == {"other"}


# --------------------------------------------------------------------------------------------
# request_items: 1-based axis into the wire shape


def meta_with(axis: int, name: str = "x") -> RoutingMetadata:
    return RoutingMetadata(models={"m": ModelCost(batch_input_name=name, batch_axis=axis)})


def test_request_items_reads_the_extent_at_the_wire_axis():
    # An image model whose wire shape is [n, c, h, w] reports axis 1 (the workers report the
    # wire-order index); a model batching along its last wire axis reports the rank.
    assert meta_with(1).request_items("m", (8, 3, 224, 224)) == 8
    assert meta_with(4).request_items("m", (3, 224, 224, 5)) == 5
    assert meta_with(2).request_items("m", (1, 32)) == 32


@pytest.mark.parametrize(
    ("meta", "model", "shape"),
    [
        (meta_with(1), "unknown", (8,)),
        (meta_with(0), "m", (8,)),
        (meta_with(1, name=""), "m", (8,)),
        (meta_with(1), "m", None),
        (meta_with(3), "m", (8, 2)),
        (meta_with(1), "m", (0, 2)),
        (meta_with(1), "m", (-1, 2)),
    ],
)
def test_request_items_is_one_when_it_cannot_count(meta, model, shape):
    assert meta.request_items(model, shape) == 1


def test_costs_are_finite_for_any_growth():
    meta = fold(EMPTY_METADATA, {"w0": reply(status("m", 0.0, 1, 1))})
    meta = fold(meta, {"w0": reply(status("m", 1e9, 2, 2))})
    assert math.isfinite(meta.models["m"].cost_per_request)
