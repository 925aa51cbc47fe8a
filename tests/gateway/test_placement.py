"""lpt_packing placement: every reference example, memory caps, hysteresis, replicas, share cap."""

from __future__ import annotations

import pytest

from kserve_trio.gateway.placement.assignment import (
    ALL_REPLICAS,
    Assignment,
    changed_workers,
    compute_assignment,
    moved_models,
    replica_count,
)

W2 = ["w0", "w1"]
GB = 1 << 30


def homes(a: Assignment) -> dict[str, tuple[str, ...]]:
    return {m: p.workers for m, p in a.placements.items()}


def test_longest_first_on_two_workers():
    a = compute_assignment({"a": 0.5, "b": 0.4, "c": 0.1}, W2)
    assert homes(a) == {"a": ("w0",), "b": ("w1",), "c": ("w1",)}
    assert a.load == pytest.approx({"w0": 0.5, "w1": 0.5})
    assert a.warnings == ()


def test_memory_caps_steer_placement():
    # b's 9 GB nearly fills w1, so c's 9 GB goes to w0 although w1 has less compute.
    a = compute_assignment(
        {"a": 0.5, "b": 0.3, "c": 0.1},
        W2,
        mem={"a": 1 * GB, "b": 9 * GB, "c": 9 * GB},
        mem_cap={"w0": 16 * GB, "w1": 16 * GB},
    )
    assert homes(a) == {"a": ("w0",), "b": ("w1",), "c": ("w0",)}
    assert a.memory == {"w0": 10 * GB, "w1": 9 * GB}


def test_zero_caps_are_unconstrained_and_abundant_caps_give_the_compute_only_result():
    u = {"a": 0.5, "b": 0.4, "c": 0.1}
    mem = {"a": 9 * GB, "b": 9 * GB, "c": 9 * GB}
    plain = homes(compute_assignment(u, W2))
    assert homes(compute_assignment(u, W2, mem=mem, mem_cap={"w0": 0, "w1": 0})) == plain
    abundant = {"w0": 1000 * GB, "w1": 1000 * GB}
    assert homes(compute_assignment(u, W2, mem=mem, mem_cap=abundant)) == plain


def test_hysteresis_keeps_a_model_on_its_previous_worker():
    u = {"a": 0.5, "b": 0.4, "c": 0.1}
    assert compute_assignment(u, W2).workers_of("a") == ("w0",)
    kept = compute_assignment(u, W2, prev={"a": ("w1",)}, hysteresis=0.1)
    assert kept.workers_of("a") == ("w1",)
    # y's previous home w0 already holds x: staying scores 0.95 against 0.45 on w1.
    u2 = {"x": 0.5, "y": 0.45}
    assert compute_assignment(u2, W2, prev={"y": ("w0",)}, hysteresis=0.1).workers_of("y") == (
        "w1",
    )
    assert compute_assignment(u2, W2, prev={"y": ("w0",)}, hysteresis=1.2).workers_of("y") == (
        "w0",
    )


def test_forbid_vacates_an_over_budget_previous_home():
    u = {"big": 0.5, "small": 0.1}
    mem = {"big": 12 * GB, "small": 6 * GB}
    caps = {"w0": 16 * GB, "w1": 8 * GB}
    a = compute_assignment(u, W2, prev={"small": ("w0",)}, mem=mem, mem_cap=caps, hysteresis=0.5)
    assert a.workers_of("big") == ("w0",)
    # small's old home w0 no longer fits it (12 + 6 > 16): it moves to w1 despite hysteresis.
    assert a.workers_of("small") == ("w1",)
    allowed = compute_assignment(
        u,
        W2,
        prev={"small": ("w0",)},
        mem=mem,
        mem_cap=caps,
        hysteresis=10.0,
        forbid_memory_oversubscription=False,
    )
    assert allowed.workers_of("small") == ("w0",)
    assert any("over its device budget" in w for w in allowed.warnings)


def test_replicas_clamp_to_the_worker_count():
    assert replica_count("m", {"m": 5}, 1, 2) == 2
    assert replica_count("m", {}, ALL_REPLICAS, 3) == 3
    assert replica_count("m", {}, 1, 3) == 1
    a = compute_assignment({"m": 0.6, "n": 0.2}, ["w0", "w1", "w2"], replicas={"m": 9})
    assert a.workers_of("m") == ("w0", "w1", "w2")
    assert a.placements["m"].weights == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert a.load["w0"] == pytest.approx(0.2 + 0.2) or a.load["w1"] == pytest.approx(0.4)


def test_multi_replica_ranking_prefers_previous_members_on_ties():
    a = compute_assignment(
        {"m": 0.4}, ["w0", "w1", "w2"], prev={"m": ("w1", "w2")}, replicas={"m": 2}
    )
    assert a.workers_of("m") == ("w1", "w2")
    fresh = compute_assignment({"m": 0.4}, ["w0", "w1", "w2"], replicas={"m": 2})
    assert fresh.workers_of("m") == ("w0", "w1")
    # every replica carries the full memory footprint
    mem = compute_assignment(
        {"m": 0.4}, W2, replicas={"m": 2}, mem={"m": 3 * GB}, mem_cap={"w0": 8 * GB}
    )
    assert mem.memory == {"w0": 3 * GB, "w1": 3 * GB}


def test_models_without_utilization_are_not_placed():
    a = compute_assignment({}, W2)
    assert a.placements == {}
    assert compute_assignment({"a": 0.1}, []).placements == {}


def test_the_share_cap_sends_a_model_to_its_next_best_worker():
    # Memory makes w1 look fuller than w0: c goes to w0, which then holds 70% of the fleet's
    # utilization. A 0.65 share cap sends c to w1 (40%) instead.
    u = {"a": 0.6, "b": 0.3, "c": 0.1}
    mem = {"a": 1 * GB, "b": 8 * GB, "c": 1 * GB}
    caps = {"w0": 10 * GB, "w1": 10 * GB}
    plain = compute_assignment(u, W2, mem=mem, mem_cap=caps)
    assert homes(plain) == {"a": ("w0",), "b": ("w1",), "c": ("w0",)}
    assert plain.load["w0"] == pytest.approx(0.7)
    capped = compute_assignment(u, W2, mem=mem, mem_cap=caps, max_worker_share=0.65)
    assert homes(capped) == {"a": ("w0",), "b": ("w1",), "c": ("w1",)}
    assert capped.load == pytest.approx({"w0": 0.6, "w1": 0.4})
    assert capped.warnings == ()


def test_the_share_cap_also_bounds_hysteresis():
    u = {"x": 0.5, "y": 0.45}
    stay = compute_assignment(u, W2, prev={"y": ("w0",)}, hysteresis=1.2)
    assert stay.workers_of("y") == ("w0",)
    capped = compute_assignment(u, W2, prev={"y": ("w0",)}, hysteresis=1.2, max_worker_share=0.8)
    assert capped.workers_of("y") == ("w1",)


def test_when_every_worker_is_over_the_cap_placement_falls_back_with_a_warning():
    a = compute_assignment({"a": 0.9, "b": 0.1}, W2, max_worker_share=0.5)
    assert a.workers_of("a") == ("w0",)
    assert any("max_worker_share 0.5" in w and "'a'" in w for w in a.warnings)


def test_moved_models_and_changed_workers():
    old = compute_assignment({"a": 0.5, "b": 0.4, "c": 0.1}, W2)
    new = compute_assignment({"a": 0.1, "b": 0.5, "d": 0.2}, W2)
    assert homes(new) == {"b": ("w0",), "d": ("w1",), "a": ("w1",)}
    assert moved_models(old, new) == ["a", "b"]
    # a moved w0 -> w1, b moved w1 -> w0, c was dropped from w1, d is new on w1
    assert changed_workers(old, new) == ["w0", "w1"]
    assert changed_workers(old, old) == []
