"""The scheduler's pure rules: fair priority, EMAs, learned costs, batch plans, disciplines, waits."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest

from kserve_trio.core.errors import InvalidArgument, NotFound, Unavailable
from kserve_trio.core.process.config import SchedulerConfig, SchedulingDiscipline
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.worker.disciplines import (
    DEFAULT_COST_SECONDS,
    Candidate,
    Edf,
    Fair,
    Fifo,
    deadline_expired,
    decay_ema,
    discipline_for,
    effective_cost,
    fair_priority,
    laxity_margin_ns,
    select_edf,
    select_fair,
    select_fifo,
    update_cost,
)
from kserve_trio.worker.layout import ModelLayout
from kserve_trio.worker.mock_backend import mock_manifest, scale_model, tensor
from kserve_trio.worker.model_state import (
    ModelState,
    QueuedRequest,
    nearest_rank,
    wait_percentiles,
)
from kserve_trio.worker.model_table import ModelTable
from kserve_trio.worker.planner import BatchPlan, coalesce_inputs, plan_batch, slice_outputs

# ----------------------------------------------------------------------------- fair priority


def test_priority_clamps_the_deficit_to_the_recency_cap():
    assert fair_priority(1 / 3, 0.7, 0.25, 1.0) == -0.25
    assert fair_priority(1 / 3, 0.0, 0.25, 1.0) == 0.25
    assert fair_priority(0.5, 0.4, 0.25, 2.0) == pytest.approx(0.05)


def _worked_example(coalesced_requests: int) -> tuple[list[Candidate], list[float]]:
    """The fair discipline's reference example: equal weights, EMAs 0.7/0.2/0.1, cap 0.25, discount 0.1, costs 10/30/100."""
    emas = {"A": 0.7, "B": 0.2, "C": 0.1}
    costs = {"A": 10.0, "B": 30.0, "C": 100.0}
    cands = [
        Candidate(
            name,
            front_enqueued_ns=i,
            weight=1.0,
            ema=emas[name],
            cost=effective_cost(
                costs[name], coalescing_discount=0.1, coalesced_requests=coalesced_requests
            ),
        )
        for i, name in enumerate("ABC")
    ]
    prios = [fair_priority(1 / 3, c.ema / 1.0, 0.25, c.cost) for c in cands]
    return cands, prios


def test_fair_worked_example_without_coalescing_gets_no_discount():
    # The discount applies only to a plan coalescing > 1 request, so with
    # single-request plans the costs stay 10/30/100 and the priorities are the undiscounted ones
    # (upstream's -0.0278 / 0.00493 / 0.00259 divide every cost by 0.9).
    cands, prios = _worked_example(coalesced_requests=1)
    assert prios == pytest.approx([-0.025, 0.13333333 / 30, 0.23333333 / 100], rel=1e-6)
    assert prios[0] == pytest.approx(-0.025)
    assert prios[1] == pytest.approx(0.0044444, rel=1e-4)
    assert prios[2] == pytest.approx(0.0023333, rel=1e-4)
    assert select_fair(cands, total_weight=3.0, total_ema=1.0, cap=0.25).name == "B"


def test_fair_worked_example_with_coalesced_plans_matches_the_discounted_numbers():
    # When every plan coalesces (here 2 requests each) all costs are discounted by 10%, which
    # reproduces the spec's numbers exactly.
    cands, prios = _worked_example(coalesced_requests=2)
    assert prios == pytest.approx([-0.0277778, 0.0049383, 0.0025926], rel=1e-4)
    assert select_fair(cands, total_weight=3.0, total_ema=1.0, cap=0.25).name == "B"


def test_discount_only_for_plans_that_coalesce_more_than_one_request():
    assert effective_cost(10.0, coalescing_discount=0.1, coalesced_requests=1) == 10.0
    assert effective_cost(10.0, coalescing_discount=0.1, coalesced_requests=2) == pytest.approx(9.0)
    assert effective_cost(None, coalescing_discount=0.1, coalesced_requests=1) == 0.01
    # The discount can flip a decision: C coalescing 3 requests beats an equal-deficit B alone.
    b = Candidate("B", 1, cost=effective_cost(1.0, coalescing_discount=0.5, coalesced_requests=1))
    c = Candidate("C", 2, cost=effective_cost(1.0, coalescing_discount=0.5, coalesced_requests=3))
    assert select_fair([b, c], total_weight=2.0, total_ema=0.0, cap=0.25).name == "C"


def test_fair_weights_shift_the_share():
    heavy = Candidate("heavy", 5, weight=3.0, ema=0.5)
    light = Candidate("light", 1, weight=1.0, ema=0.5)
    # shares 0.75 / 0.25 against equal recent use 0.5 / 0.5: heavy is owed compute.
    assert select_fair([heavy, light], total_weight=4.0, total_ema=1.0, cap=0.25).name == "heavy"


def test_fair_ties_go_to_the_older_front_then_the_name():
    a = Candidate("a", front_enqueued_ns=20)
    b = Candidate("b", front_enqueued_ns=10)
    assert select_fair([a, b], total_weight=2.0, total_ema=0.0, cap=0.25).name == "b"
    a2 = Candidate("a", front_enqueued_ns=10)
    assert select_fair([b, a2], total_weight=2.0, total_ema=0.0, cap=0.25).name == "a"


def test_fair_zero_totals_mean_zero_share_and_zero_recent_use():
    # total weight 0 -> share 0; total ema 0 -> nema 0: every priority is 0, ties by age.
    a = Candidate("a", front_enqueued_ns=2, weight=0.0)
    b = Candidate("b", front_enqueued_ns=1, weight=0.0)
    assert select_fair([a, b], total_weight=0.0, total_ema=0.0, cap=0.25).name == "b"


# ----------------------------------------------------------------------------- EMAs and costs


def test_ema_halves_per_half_life():
    assert decay_ema(1.0, 30.0, 30.0) == pytest.approx(0.5)
    assert decay_ema(1.0, 60.0, 30.0) == pytest.approx(0.25)
    assert decay_ema(8.0, 10.0, 10.0) == pytest.approx(4.0)
    assert decay_ema(1.0, 0.0, 30.0) == 1.0
    assert decay_ema(1.0, -5.0, 30.0) == 1.0  # clock skew never grows the EMA


def test_cost_ema_seeds_exactly_then_converges():
    cost = update_cost(None, 0.5, 0.2)
    assert cost == 0.5
    cost = update_cost(cost, 0.1, 0.2)
    assert cost == pytest.approx(0.2 * 0.1 + 0.8 * 0.5)
    for _ in range(100):
        cost = update_cost(cost, 0.1, 0.2)
    assert cost == pytest.approx(0.1, rel=1e-6)
    assert update_cost(None, 0.0, 0.2) > 0.0  # floored, never a zero divisor


# ----------------------------------------------------------------------------- plan_batch


@dataclass
class Q:
    rows: int
    variant: int | None = None


def keys_of(*sizes: int):
    return lambda variant: sizes


def test_plan_rows_2_2_2_with_sizes_1_4_8_takes_two_at_b4():
    plan = plan_batch([Q(2), Q(2), Q(2)], keys_of(1, 4, 8), batched=True)
    assert (plan.batch_key, plan.take, plan.rows) == (4, 2, 4)
    assert plan.coalesced and plan.padding == 0


def test_plan_one_row_with_sizes_4_8_pads_to_4():
    plan = plan_batch([Q(1)], keys_of(4, 8), batched=True)
    assert (plan.batch_key, plan.take, plan.rows, plan.padding) == (4, 1, 1, 3)
    assert plan.coalesced


def test_plan_rows_6_1_with_sizes_1_4_8_takes_both_at_b8():
    plan = plan_batch([Q(6), Q(1)], keys_of(1, 4, 8), batched=True)
    assert (plan.batch_key, plan.take, plan.rows, plan.padding) == (8, 2, 7, 1)


def test_plan_cap_4_with_four_2_row_requests_takes_two_at_b4():
    plan = plan_batch([Q(2)] * 4, keys_of(1, 4, 8), batched=True, max_batch_size=4)
    assert (plan.batch_key, plan.take, plan.rows) == (4, 2, 4)


def test_plan_cap_2_with_sizes_4_8_takes_two_single_rows_padded_to_4():
    plan = plan_batch([Q(1)] * 3, keys_of(4, 8), batched=True, max_batch_size=2)
    assert (plan.batch_key, plan.take, plan.rows, plan.padding) == (4, 2, 2, 2)


def test_plan_cap_2_with_rows_6_1_takes_only_the_6_at_b8():
    plan = plan_batch([Q(6), Q(1)], keys_of(1, 4, 8), batched=True, max_batch_size=2)
    assert (plan.batch_key, plan.take, plan.rows) == (8, 1, 6)


def test_plan_non_coalescable_takes_one_per_dispatch():
    queue = [Q(4), Q(4), Q(4)]
    plan = plan_batch(queue, keys_of(4, 8), batched=False)
    assert plan == BatchPlan(None, 4, 1, 4, coalesced=False)
    # the unbatched module (key 0) runs any size, one request at a time
    plan0 = plan_batch([Q(3), Q(5)], keys_of(0), batched=True)
    assert plan0 == BatchPlan(None, 0, 1, 3, coalesced=False)
    # non-coalescable without key 0: smallest size >= rows, else the largest
    assert plan_batch([Q(5)], keys_of(4, 8), batched=False).batch_key == 8
    assert plan_batch([Q(9)], keys_of(4, 8), batched=False).batch_key == 8


def test_plan_groups_by_variant_a_a_b_then_b_alone():
    queue = [Q(1, variant=0), Q(1, variant=0), Q(1, variant=1)]
    plan = plan_batch(queue, keys_of(2), batched=True)
    assert (plan.variant, plan.batch_key, plan.take) == (0, 2, 2)
    assert plan.coalesced and plan.padding == 0
    rest = plan_batch(queue[plan.take :], keys_of(2), batched=True)
    assert (rest.variant, rest.batch_key, rest.take, rest.padding) == (1, 2, 1, 1)


def test_plan_window_stops_at_the_first_other_variant():
    # [A, B, A]: the window is only the leading A; the trailing A is not pulled forward.
    queue = [Q(1, 0), Q(1, 1), Q(1, 0)]
    plan = plan_batch(queue, keys_of(1, 4), batched=True)
    assert (plan.variant, plan.take, plan.batch_key) == (0, 1, 1)


def test_plan_lone_exact_fit_passes_through_uncoalesced():
    plan = plan_batch([Q(4)], keys_of(1, 4, 8), batched=True)
    assert plan == BatchPlan(None, 4, 1, 4, coalesced=False)


def test_plan_front_larger_than_every_size_is_never_split():
    plan = plan_batch([Q(12), Q(1)], keys_of(1, 4, 8), batched=True)
    assert (plan.batch_key, plan.take, plan.rows) == (8, 1, 12)


def test_plan_takes_a_long_queue_only_up_to_the_largest_size():
    plan = plan_batch([Q(1)] * 1000, keys_of(1, 8, 32), batched=True)
    assert (plan.batch_key, plan.take, plan.rows) == (32, 32, 32)


def test_plan_rejects_an_empty_queue():
    with pytest.raises(ValueError, match="non-empty queue"):
        plan_batch([], keys_of(1), batched=True)


# ----------------------------------------------------------------------------- fifo / edf


def test_fifo_picks_the_oldest_front_ties_by_name():
    cands = [Candidate("b", 5), Candidate("a", 7), Candidate("c", 3)]
    assert select_fifo(cands).name == "c"
    assert select_fifo([Candidate("b", 5), Candidate("a", 5)]).name == "a"
    # weights are ignored
    assert select_fifo([Candidate("x", 2, weight=100.0), Candidate("y", 1)]).name == "y"


def test_edf_picks_the_soonest_deadline():
    cands = [
        Candidate("a", 1, earliest_deadline_ns=900),
        Candidate("b", 2, earliest_deadline_ns=500),
        Candidate("c", 3, earliest_deadline_ns=0),
    ]
    assert select_edf(cands).name == "b"


def test_edf_without_deadlines_is_least_urgent():
    cands = [
        Candidate("a", 1, earliest_deadline_ns=0),
        Candidate("b", 9, earliest_deadline_ns=10**18),
    ]
    assert select_edf(cands).name == "b"


def test_edf_equal_deadlines_degrade_to_fifo():
    cands = [
        Candidate("a", 7, earliest_deadline_ns=100),
        Candidate("b", 3, earliest_deadline_ns=100),
    ]
    assert select_edf(cands).name == "b"
    assert select_edf([Candidate("b", 3), Candidate("a", 3)]).name == "a"


def test_deadline_admission_and_edf_laxity():
    assert not deadline_expired(0, 10**12)  # no deadline
    assert deadline_expired(100, 100)  # now >= deadline
    assert not deadline_expired(101, 100)
    # laxity: a plan whose learned cost cannot finish before the deadline is shed
    margin = laxity_margin_ns(0.005)
    assert margin == 5_000_000
    assert deadline_expired(1_000_000_000, 996_000_000, margin)
    assert not deadline_expired(1_000_000_000, 994_000_000, margin)
    assert laxity_margin_ns(None) == int(DEFAULT_COST_SECONDS * 1e9)


# ----------------------------------------------------------------------------- discipline objects


def _state(
    name: str, *enqueued_and_deadline: tuple[int, int], batch_sizes: tuple[int, ...] = (1, 4, 8)
) -> ModelState:
    state = ModelState.build(
        scale_model(name, batch_sizes=batch_sizes),
        weight=1.0,
        max_batch_size=None,
        preprocess=None,
        postprocess=None,
        now_ns=0,
        cached=False,
    )
    for enqueued, deadline in enqueued_and_deadline:
        x = np.zeros((1, 4), np.float32)
        state.queue.append(QueuedRequest([x], None, 1, enqueued, deadline, ""))
    return state


def _table(*states: ModelState) -> ModelTable:
    table = ModelTable()
    for state in states:
        table.put(state)
    return table


def _plan_front(state: ModelState) -> BatchPlan:
    return BatchPlan(None, 1, 1, 1, coalesced=False)


@pytest.mark.parametrize(
    ("configured", "kind", "warms"),
    [
        (SchedulingDiscipline.FAIR, Fair, True),
        (SchedulingDiscipline.FIFO, Fifo, False),
        (SchedulingDiscipline.EDF, Edf, False),
    ],
)
def test_the_configured_discipline_is_one_object_and_only_fair_warms(configured, kind, warms):
    discipline = discipline_for(SchedulerConfig(discipline=configured), lambda: 0)
    assert type(discipline) is kind and discipline.name == configured.value
    assert discipline.warms_models is warms


def test_fifo_and_edf_objects_pick_among_the_ready_models_and_plan_only_the_chosen():
    a = _state("a", (5, 0))
    b = _state("b", (7, 100))
    table = _table(a, b)
    planned: list[str] = []

    def plan(state: ModelState) -> BatchPlan:
        planned.append(state.name)
        return _plan_front(state)

    picked = Fifo().select([a, b], table, plan)
    assert picked is not None and picked[0] is a and planned == ["a"]
    picked = Edf().select([a, b], table, plan)
    assert picked is not None and picked[0] is b and planned == ["a", "b"]


def test_the_fair_object_prices_every_ready_model_and_decays_every_loaded_one():
    busy, idle, loaded = _state("busy", (1, 0)), _state("idle", (2, 0)), _state("loaded")
    busy.ema, busy.ema_ns = 1.0, 0
    loaded.ema, loaded.ema_ns = 1.0, 0
    halflife = SchedulerConfig().ema_halflife_seconds
    now = int(halflife * 1e9)
    planned: list[str] = []

    def plan(state: ModelState) -> BatchPlan:
        planned.append(state.name)
        return _plan_front(state)

    fair = Fair(SchedulerConfig(), lambda: now)
    picked = fair.select([busy, idle], _table(busy, idle, loaded), plan)
    assert picked is not None and picked[0] is idle  # the one that used less than its share
    assert planned == ["busy", "idle"]
    assert (busy.ema, loaded.ema) == (pytest.approx(0.5), pytest.approx(0.5))
    assert busy.ema_ns == loaded.ema_ns == now


def test_only_edf_admits_a_batch_with_its_learned_cost_as_margin():
    state = _state("a")
    plan = _plan_front(state)
    state.cost[(plan.variant, plan.batch_key)] = 0.005
    assert Edf().admission_margin_ns(state, plan) == 5_000_000
    assert Fifo().admission_margin_ns(state, plan) == 0
    assert Fair(SchedulerConfig(), lambda: 0).admission_margin_ns(state, plan) == 0


def test_the_model_table_sends_a_request_to_the_version_that_replaced_its_own():
    old = _state("m")
    table = _table(old, _state("n", (1, 0)))
    assert [s.name for s in table.ready()] == ["n"] and table.names() == ["m", "n"]
    new = _state("m")
    old.replaced_by = new
    table.put(new)
    assert table.current("m", old) is new
    changed = _state("m", batch_sizes=(1, 2))
    new.replaced_by = changed
    table.put(changed)
    with pytest.raises(Unavailable, match="was reloaded; retry"):
        table.current("m", old)
    table.pop("m")
    with pytest.raises(NotFound, match="was unloaded"):
        table.current("m", old)
    with pytest.raises(NotFound, match="unknown model: m"):
        table.require("m")


# ----------------------------------------------------------------------------- coalescing


def test_coalesce_concatenates_along_each_inputs_own_axis_and_zero_pads():
    x1 = np.ones((1, 3), np.float32)  # batch axis 0
    x2 = np.full((2, 3), 2, np.float32)
    z1 = np.ones((5, 1), np.int32)  # batch axis 1
    z2 = np.full((5, 2), 7, np.int32)
    x, z = coalesce_inputs([[x1, z1], [x2, z2]], [0, 1], 4)
    assert x.shape == (4, 3) and z.shape == (5, 4)
    np.testing.assert_array_equal(x[:, 0], [1, 2, 2, 0])
    np.testing.assert_array_equal(z[0], [1, 7, 7, 0])
    assert x.dtype == np.float32 and z.dtype == np.int32


def test_coalesce_refuses_more_rows_than_the_batch():
    with pytest.raises(ValueError, match="coalesced 3 rows into a batch of 2"):
        coalesce_inputs([[np.zeros((3, 1))]], [0], 2)


def test_slice_outputs_drops_padding_and_passes_unbatched_outputs_whole():
    y = np.arange(8).reshape(4, 2)  # batch axis 0, 3 real rows + 1 pad
    t = np.arange(12).reshape(3, 4)  # batch axis 1
    s = np.array(42)  # no batch axis
    extra = np.zeros(2)  # beyond the manifest: whole
    per = slice_outputs([y, t, s, extra], [0, 1, None], [1, 2])
    np.testing.assert_array_equal(per[0][0], [[0, 1]])
    np.testing.assert_array_equal(per[1][0], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(per[0][1], t[:, 0:1])
    np.testing.assert_array_equal(per[1][1], t[:, 1:3])
    assert per[0][2] is s and per[1][2] is s
    assert per[1][3] is extra


# ----------------------------------------------------------------------------- waits


def test_nearest_rank_percentiles():
    assert nearest_rank([], 0.5) == 0.0
    assert wait_percentiles([]) == (0.0, 0.0)
    assert wait_percentiles([3.0]) == (3.0, 3.0)
    samples = [float(i) for i in range(1, 101)]  # 1..100
    assert wait_percentiles(samples[::-1]) == (50.0, 99.0)
    assert nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0  # ceil(0.5*4) = 2
    assert nearest_rank([1.0, 2.0, 3.0], 0.5) == 2.0  # ceil(1.5) = 2
    assert nearest_rank([1.0, 2.0, 3.0], 0.99) == 3.0
    assert nearest_rank([5.0, 6.0], 0.0) == 5.0  # clamped to rank 1
    assert math.isclose(nearest_rank([0.1] * 10, 0.99), 0.1)


# ----------------------------------------------------------------------------- ModelLayout


def layout_of(manifest, keys) -> ModelLayout:
    return ModelLayout.build(manifest.name, manifest, keys)


def nt(name: str, shape: tuple[int, ...], dtype=np.float32) -> NamedTensor:
    return NamedTensor.from_array(name, np.zeros(shape, dtype))


PAIR = mock_manifest(
    "pair",
    [tensor("x", "f32", "cn", c=2), tensor("z", "i32", "nc", c=3)],  # wire (n,2) and (3,n)
    [tensor("y", "f32", "cn", c=2)],
    batch_sizes=(4, 8),
)


def test_layout_derives_axes_and_coalescability():
    lay = layout_of(PAIR, {None: (8, 4)})
    assert lay.keys == {None: (4, 8)}
    assert lay.input_axes == (0, 1) and lay.output_axes == (0,)
    assert lay.inputs_batched and lay.batched
    assert lay.output_name(0) == "y" and lay.output_name(2) == "output_2"
    assert lay.max_batch_size(None) == 8 and lay.max_batch_size(2) == 2
    reduction = mock_manifest(
        "sum", [tensor("x", "f32", "cn", c=2)], [tensor("s", "f32", "c", c=2)], batch_sizes=(4,)
    )
    red = layout_of(reduction, {None: (4,)})
    assert red.inputs_batched and not red.batched and red.max_batch_size(None) == 0
    plain = mock_manifest("plain", [tensor("x", "f32", "c", c=2)], [tensor("y", "f32", "c", c=2)])
    assert layout_of(plain, {None: (0,)}).max_batch_size(None) == 0


def test_layout_refuses_a_model_without_programs():
    with pytest.raises(InvalidArgument, match="model 'pair' has no compiled program"):
        layout_of(PAIR, {None: ()})
    with pytest.raises(InvalidArgument, match="model 'pair' has no compiled program"):
        layout_of(PAIR, {})


def test_check_rows_rules():
    lay = layout_of(PAIR, {None: (4, 8)})
    lay.check_rows(None, 8)
    lay.check_rows(None, 1)  # padded up to 4
    with pytest.raises(InvalidArgument) as err:
        lay.check_rows(None, 9)
    assert err.value.message == "model 'pair' accepts at most 8 rows per request (got 9)"
    unbatched_module = layout_of(PAIR, {None: (0,)})
    unbatched_module.check_rows(None, 1000)  # key 0 runs any size


def test_check_wire_uses_client_inputs_loosely_when_a_model_py_reshapes():
    raw_client = mock_manifest(
        "tok",
        [tensor("ids", "i32", "sn", s=8)],
        [tensor("y", "f32", "cn", c=2)],
        batch_sizes=(2, 4),
    )
    # A manifest whose client input is declared separately (as with a model.py).
    client = replace(raw_client, client_inputs=(raw_client.executable_inputs[0],))
    lay = layout_of(client, {None: (2, 4)})
    lay.check_wire([nt("ids", (4, 8), np.int32)])
    with pytest.raises(InvalidArgument, match=r"accepts at most 4 rows per request \(got 5\)"):
        lay.check_wire([nt("ids", (5, 8), np.int32)])


def test_prepare_orders_inputs_and_reads_rows_and_variant():
    lay = layout_of(PAIR, {None: (4, 8)})
    z = nt("z", (3, 2), np.int32)
    x = nt("x", (2, 2))
    arrays, variant, rows = lay.prepare([z, x])  # any request order
    assert arrays[0] is x.data and arrays[1] is z.data
    assert (variant, rows) == (None, 2)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([nt("x", (2, 2))], "model 'pair' is missing required input 'z'"),
        (
            [nt("x", (2, 2), np.float64), nt("z", (3, 2), np.int32)],
            "input 'x' of model 'pair' has dtype f64, expected f32",
        ),
        (
            [nt("x", (2, 5)), nt("z", (3, 2), np.int32)],
            "input 'x' of model 'pair' dim 1 has extent 5, expected 2",
        ),
        (
            [nt("x", (2, 2)), nt("z", (3, 1), np.int32)],
            "inputs of model 'pair' disagree on the batch extent ('x': 2, 'z': 1)",
        ),
        (
            [nt("x", (9, 2)), nt("z", (3, 9), np.int32)],
            "model 'pair' accepts at most 8 rows per request (got 9)",
        ),
    ],
)
def test_prepare_refuses_bad_inputs(inputs, message):
    lay = layout_of(PAIR, {None: (4, 8)})
    with pytest.raises(InvalidArgument) as err:
        lay.prepare(inputs)
    assert err.value.message == message


def test_zero_inputs_follow_the_key_and_the_variant():
    var = mock_manifest(
        "var",
        [tensor("x", "f32", "sn", s=-1), tensor("m", "i32", "n")],
        [tensor("y", "f32", "sn", s=-1)],
        batch_sizes=(2,),
        input_shapes=[{"s": 3}, {"s": 5}],
    )
    lay = layout_of(var, {0: (2,), 1: (2,)})
    x, m = lay.zero_inputs(1, 2)
    assert x.shape == (2, 5) and x.dtype == np.float32 and not x.any()
    assert m.shape == (2,) and m.dtype == np.int32
    assert lay.prepare([NamedTensor.from_array("x", x), NamedTensor.from_array("m", m)])[1:] == (
        1,
        2,
    )
    plain = mock_manifest("plain", [tensor("x", "f32", "c", c=4)], [tensor("y", "f32", "c", c=4)])
    (p,) = layout_of(plain, {None: (0,)}).zero_inputs(None, 0)
    assert p.shape == (4,)
    batched = layout_of(PAIR, {None: (4, 8)})
    assert [a.shape for a in batched.zero_inputs(None, 0)] == [(1, 2), (3, 1)]  # key 0 -> 1 row
