"""gateway.yml under lpt_packing: every key with its default, ranges, replica counts and
per-model blocks, the environment overrides, the example file and the warnings."""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest
from ruamel.yaml import YAML

from kserve_trio.core.errors import ConfigError
from kserve_trio.gateway.config import (
    INFLIGHT_WARNING,
    LPT_SCHEDULING_KEYS,
    CompactionMode,
    FillMode,
    FillPolicy,
    ModelPlacementConfig,
    SchedulingMode,
    WorkBasis,
    build_gateway_config,
    gateway_config_to_raw,
    load_gateway_config,
    schema_paths,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "gateway.lpt_packing.yaml"
W = "KSERVE_TRIO_GATEWAY_"


def load(scheduling: dict | None = None, env: dict | None = None):
    raw = {"endpoints": ["a:1", "b:2"], "scheduling": {"mode": "lpt_packing", **(scheduling or {})}}
    return (
        load_gateway_config(None, env={}, overrides=raw).config
        if env is None
        else (load_gateway_config(None, env={W + "WORKERS": "a:1", **env}).config)
    )


@contextlib.contextmanager
def raises(path: str, message: str):
    """A ConfigError at YAML path ``path`` whose message matches the regex ``message``."""
    with pytest.raises(ConfigError) as info:
        yield
    assert info.value.path == path, str(info.value)
    assert re.search(message, info.value.message), info.value.message


def test_the_lpt_defaults():
    s = load().scheduling
    assert s.mode is SchedulingMode.LPT_PACKING and s.basis is WorkBasis.COMPUTE
    assert (s.rebalance_compute_seconds, s.first_rebalance_compute_seconds) == (300.0, 60.0)
    assert (s.max_worker_share, s.hysteresis, s.ema_halflife_compute_seconds) == (0.8, 0.0, 0.0)
    assert s.halflife == 300.0  # 0 tracks the rebalance budget
    assert (s.default_replicas, s.routing_fill_factor) == (1, 1.0)
    assert s.routing_policy is FillPolicy.FILL_LEAST and s.routing_fill_mode is FillMode.RUN
    assert s.compaction_mode is CompactionMode.EAGER and s.compaction_interval == 1
    assert s.forbid_memory_oversubscription is True and dict(s.models) == {}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("rebalance_compute_seconds", 0, r"must be > 0 \(got 0"),
        ("first_rebalance_compute_seconds", -1, "must be >= 0"),
        ("max_worker_share", 0, r"must be in \(0, 1\]"),
        ("max_worker_share", 1.5, r"must be in \(0, 1\]"),
        ("hysteresis", 1.0, r"must be in \[0, 1\)"),
        ("ema_halflife_compute_seconds", -5, "must be >= 0"),
        ("default_replicas", 0, "must be a positive integer or 'all'"),
        ("default_replicas", "most", "must be a positive integer or 'all'"),
        ("routing_fill_factor", 0, "must be > 0"),
        ("compaction_interval", -1, "must be >= 0"),
        ("routing_policy", "least_outstanding", "is a scheduling mode, not an lpt_packing"),
        ("routing_policy", "random", "must be one of 'fill_least', 'fill_rr'"),
        ("routing_fill_mode", "bulk", "must be one of 'run', 'spread', 'inflight'"),
        ("compaction_mode", "lazy", "must be one of 'off', 'eager', 'scheduled'"),
    ],
)
def test_ranges_and_enums(key, value, message):
    with raises(f"scheduling.{key}", message):
        load({key: value})


def test_replica_counts_and_per_model_blocks():
    s = load(
        {
            "default_replicas": "ALL",
            "models": {
                "a": {"replicas": 2, "fill_mode": "Spread", "fill_factor": 0.5},
                "b": {"fill_mode": "inherit"},  # no replicas: inherits default_replicas
                "c": {},
            },
        }
    ).scheduling
    assert s.default_replicas == -1
    assert s.models["a"] == ModelPlacementConfig(2, FillMode.SPREAD, 0.5)
    assert s.models["b"] == ModelPlacementConfig() and s.models["b"].empty
    assert s.models["c"].replicas is None
    with raises("scheduling.models.a.replicas", "positive integer or 'all'"):
        load({"models": {"a": {"replicas": 0}}})
    with raises("scheduling.models.a.fill_factor", "must be > 0"):
        load({"models": {"a": {"fill_factor": 0}}})
    with raises("scheduling.models.a.fill_mode", "must be one of"):
        load({"models": {"a": {"fill_mode": "bulk"}}})
    with raises("scheduling.models.a.weight", "unknown key"):
        load({"models": {"a": {"weight": 1}}})


def test_work_basis_applies_to_lpt_packing_too():
    assert load({"work_basis": "requests"}).scheduling.basis is WorkBasis.REQUESTS


@pytest.mark.parametrize("key", LPT_SCHEDULING_KEYS[:-1])
def test_every_lpt_knob_has_an_environment_override(key):
    var = W + "SCHEDULING_" + key.upper()
    samples = {
        "default_replicas": ("3", 3),
        "routing_policy": ("fill_rr", FillPolicy.FILL_RR),
        "routing_fill_mode": ("inflight", FillMode.INFLIGHT),
        "compaction_mode": ("off", CompactionMode.OFF),
        "compaction_interval": ("4", 4),
        "forbid_memory_oversubscription": ("0", False),
        "max_worker_share": ("0.5", 0.5),
        "hysteresis": ("0.25", 0.25),
    }
    text, expected = samples.get(key, ("42", 42.0))
    cfg = load(env={W + "SCHEDULING_MODE": "lpt_packing", var: text})
    assert getattr(cfg.scheduling, key) == expected
    with raises(f"scheduling.{key}", "configures scheduling mode lpt_packing"):
        load(env={var: text})  # the mode is round_robin by default


def test_the_environment_says_all_replicas_and_rejects_zero():
    cfg = load(env={W + "SCHEDULING_MODE": "lpt_packing", W + "SCHEDULING_DEFAULT_REPLICAS": "all"})
    assert cfg.scheduling.default_replicas == -1
    with raises("scheduling.default_replicas", "positive integer or 'all'"):
        load(env={W + "SCHEDULING_MODE": "lpt_packing", W + "SCHEDULING_DEFAULT_REPLICAS": "0"})


def test_an_inflight_fill_mode_warns():
    loaded = load_gateway_config(
        None,
        env={W + "WORKERS": "a:1"},
        overrides={
            "scheduling": {"mode": "lpt_packing", "models": {"m": {"fill_mode": "inflight"}}}
        },
    )
    assert INFLIGHT_WARNING in loaded.warnings


def test_to_raw_inverts_an_lpt_config():
    cfg = load({"default_replicas": "all", "models": {"a": {"replicas": "all", "fill_factor": 2}}})
    raw = gateway_config_to_raw(cfg)
    assert raw["scheduling"]["default_replicas"] == "all"
    assert raw["scheduling"]["models"] == {"a": {"replicas": "all", "fill_factor": 2.0}}
    assert build_gateway_config(raw) == cfg


def test_the_lpt_example_lists_every_lpt_key_and_loads():
    raw = YAML(typ="safe").load(EXAMPLE.read_text())
    keys = set(raw["scheduling"])
    assert keys == {*LPT_SCHEDULING_KEYS, "mode", "work_basis"}
    per_model = {p.rsplit(".", 1)[1] for p in schema_paths() if p.startswith("scheduling.models.")}
    assert set(raw["scheduling"]["models"]["big_model"]) == per_model
    loaded = load_gateway_config(EXAMPLE, env={}, check_files=False)
    s = loaded.config.scheduling
    assert s.models["big_model"] == ModelPlacementConfig(-1, FillMode.SPREAD, 2.0)
    defaults = load().scheduling
    for key in LPT_SCHEDULING_KEYS[:-1]:  # the example shows the defaults
        assert getattr(s, key) == getattr(defaults, key), key
