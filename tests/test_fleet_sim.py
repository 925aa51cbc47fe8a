"""The fleet simulator runs the gateway's real policies, and lpt_packing loads weights less."""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_sim():
    spec = importlib.util.spec_from_file_location("fleet_sim", ROOT / "tools" / "sim" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fleet_sim"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_lpt_packing_loads_fewer_weights_than_round_robin_on_a_small_fleet():
    sim = load_sim()
    rows = {k: sim.simulate(k, 4, 40, 8000, seed=3) for k in sim.POLICIES}
    assert rows["lpt_packing"]["loads_per_1000"] < rows["round_robin"]["loads_per_1000"] / 3
    assert rows["lpt_packing"]["served_without_load"] > rows["round_robin"]["served_without_load"]
    for row in rows.values():
        assert row["requests"] > 7000
        assert 0 <= row["served_without_load"] <= 1


def test_the_simulator_uses_the_gateway_policies_not_copies():
    sim = load_sim()
    from kserve_trio.gateway.fleet.routing import LeastOutstanding, RoundRobin
    from kserve_trio.gateway.placement.policy import LptPacking

    models = {m.name: m for m in sim.make_models(5, random.Random(0))}
    assert isinstance(sim.make_policy("round_robin", models), RoundRobin)
    assert isinstance(sim.make_policy("least_outstanding", models), LeastOutstanding)
    assert isinstance(sim.make_policy("lpt_packing", models), LptPacking)
