"""Node files: validation, per-worker resolution, gpus parsing and supervisor materialization."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config import ResidencyState, validate_config
from kserve_trio.core.process.node import (
    load_node,
    load_node_raw,
    materialize_node,
    node_gpus,
    node_server_config,
    validate_node,
    worker_names,
    worker_raw_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "node.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def node_of(**extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"model_repo": "/repo", "base_port": 8080}
    node.update(extra)
    return node


def config_error(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


# --- files ------------------------------------------------------------------------------------


def test_load_node_raw_errors(tmp_path):
    missing = tmp_path / "absent.yaml"
    assert config_error(load_node_raw, missing).message == f"node config file not found: {missing}"
    bad = write(tmp_path, "model_repo: [unclosed\n", "bad.yaml")
    assert config_error(load_node_raw, bad).message.startswith(
        f"node config {bad} is not valid YAML: "
    )
    listy = write(tmp_path, "- a\n- b\n", "list.yaml")
    assert (
        config_error(load_node_raw, listy).message
        == f"node config root must be a mapping (file {listy})"
    )
    dup = write(tmp_path, "model_repo: /a\nmodel_repo: /b\n", "dup.yaml")
    assert config_error(load_node_raw, dup).message.startswith(
        f"node config {dup} is not valid YAML: "
    )
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"model_repo: /caf\xe9\n")
    assert config_error(load_node_raw, latin).message.startswith(
        f"node config {latin} is not valid YAML: "
    )
    empty = write(tmp_path, "", "empty.yaml")
    assert (
        config_error(load_node_raw, empty).message
        == f"node config root must be a mapping (file {empty})"
    )


def test_load_node_raw_does_not_validate_but_load_node_does(tmp_path):
    path = write(tmp_path, "model_repo: /r\nbase_port: 8080\ngpus: 2\n")
    assert load_node_raw(path) == {"model_repo": "/r", "base_port": 8080, "gpus": 2}
    assert config_error(load_node, path).message == "node config 'workers' must be a list"


def test_example_node_file_loads_and_every_worker_validates():
    node = load_node(REPO_ROOT / "config" / "node.example.yaml")
    assert worker_names(node) == ["worker0", "worker1"]
    assert node_gpus(node) == "auto"
    for index, name in enumerate(worker_names(node)):
        cfg, applied, resolved = node_server_config(node, name, env={})
        validate_config(cfg, check_dirs=False)
        assert (resolved, applied, cfg.worker_name) == (name, [], name)
        assert cfg.endpoints.port == 8080 + index
        assert cfg.endpoints.metrics_port == 9100 + index
        assert cfg.endpoints.http_port == 8100 + index
        assert cfg.model_dirs == ("/var/lib/kserve_trio/models",)
        assert cfg.model_sched("example_model").max_batch_size == 32
    w0, _, _ = node_server_config(node, "worker0", env={})
    w1, _, _ = node_server_config(node, "worker1", env={})
    assert w0.model_sched("example_model").residency is ResidencyState.PINNED_DEVICE
    assert w1.model_sched("example_model").residency is None
    assert (w0.runtime.mem_fraction, w1.runtime.mem_fraction) == (0.9, 0.8)


def test_example_node_file_shows_every_config_key():
    from kserve_trio.core.process.config import SCHEMA

    text = (REPO_ROOT / "config" / "node.example.yaml").read_text()
    derived = (
        "model_dirs",
        "endpoints.port",
        "endpoints.metrics_port",
        "endpoints.http_port",
        "runtime.device_ordinal",
    )
    for key in derived:  # not allowed in a node file, but the example says where they come from
        assert key in text, key
    for key, sub in SCHEMA.items():
        if key not in derived:
            assert f"{key}:" in text, key
        for leaf in sub or {}:
            if leaf != "*" and f"{key}.{leaf}" not in derived:
                assert f"{leaf}:" in text, f"{key}.{leaf}"
    for leaf in ("weight", "residency", "max_batch_size", "pin_to_gpu"):
        assert f"{leaf}:" in text
    for key in (
        "model_repo",
        "base_port",
        "metrics_base_port",
        "http_base_port",
        "gpus",
        "role",
        "shared_host_weights",
        "gateway",
    ):
        assert f"{key}:" in text


# --- ports ------------------------------------------------------------------------------------


def test_ports_come_from_base_port_or_an_explicit_port():
    node = validate_node(
        node_of(workers=[{"name": "a"}, {"name": "b", "port": 9000}, {"name": "c"}])
    )
    ports = [worker_raw_config(node, n)["endpoints"]["port"] for n in ("a", "b", "c")]
    assert ports == [8080, 9000, 8082]
    assert "metrics_port" not in worker_raw_config(node, "a")["endpoints"]


def test_base_port_is_required_only_for_workers_without_a_port():
    node = validate_node({"model_repo": "/r", "workers": [{"name": "a", "port": 0}]})
    cfg, _, _ = node_server_config(node, env={})
    assert cfg.endpoints.port == 0
    err = config_error(validate_node, {"model_repo": "/r", "workers": [{"name": "a"}]})
    assert (err.path, err.message) == ("base_port", "node config 'base_port' must be an integer")
    err = config_error(validate_node, node_of(base_port="8080", workers=[{"name": "a"}]))
    assert err.message == "node config 'base_port' must be an integer"


def test_metrics_ports_follow_metrics_base_port():
    node = validate_node(node_of(metrics_base_port=9100, workers=[{"name": "a"}, {"name": "b"}]))
    assert [worker_raw_config(node, n)["endpoints"]["metrics_port"] for n in ("a", "b")] == [
        9100,
        9101,
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"workers": [{"name": "a", "port": 8080}, {"name": "b", "port": 8080}]},
            "node workers 'a' and 'b' both bind port 8080",
        ),
        (
            {"workers": [{"name": "a"}, {"name": "b", "port": 8080}]},
            "node workers 'a' and 'b' both bind port 8080",
        ),
        (
            {"metrics_base_port": 8081, "workers": [{"name": "a"}, {"name": "b"}]},
            "node worker 'b' port 8081 collides with 'a (metrics)'",
        ),
        (
            {"metrics_base_port": 8079, "workers": [{"name": "a"}, {"name": "b"}]},
            "node worker 'b' metrics port 8080 collides with 'a'",
        ),
        (
            {"metrics_base_port": 9000, "workers": [{"name": "a", "port": 9001}, {"name": "b"}]},
            "node worker 'b' metrics port 9001 collides with 'a'",
        ),
        (
            {"workers": [{"name": "a", "port": 70000}]},
            "node worker 'a' port 70000 is out of range 0..65535",
        ),
        (
            {"metrics_base_port": 0, "workers": [{"name": "a"}]},
            "node worker 'a' metrics port 0 is out of range 1..65535",
        ),
        (
            {"metrics_base_port": "9100", "workers": [{"name": "a"}]},
            "node config 'metrics_base_port' must be an integer",
        ),
        ({"workers": [{"name": "a", "port": "80"}]}, "node worker 'a' port must be an integer"),
    ],
)
def test_port_errors(extra, message):
    assert config_error(validate_node, node_of(**extra)).message == message


def test_ephemeral_ports_never_collide():
    validate_node(
        {"model_repo": "/r", "workers": [{"name": "a", "port": 0}, {"name": "b", "port": 0}]}
    )


# --- structure --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "path", "message"),
    [
        (
            {"base_port": 1, "workers": [{"name": "a"}]},
            "model_repo",
            "node config 'model_repo' must be a non-empty string",
        ),
        (
            node_of(model_repo="", workers=[{"name": "a"}]),
            "model_repo",
            "node config 'model_repo' must be a non-empty string",
        ),
        (node_of(workers={"name": "a"}), "workers", "node config 'workers' must be a list"),
        (node_of(workers=[]), "workers", "node config 'workers' must list at least one worker"),
        (node_of(workers=["a"]), "workers[0]", "each node 'workers' entry must be a mapping"),
        (
            node_of(workers=[{"gpu": 0}]),
            "workers[0]",
            "each node worker must have a non-empty string 'name'",
        ),
        (
            node_of(workers=[{"name": 3}]),
            "workers[0]",
            "each node worker must have a non-empty string 'name'",
        ),
        (
            node_of(workers=[{"name": "a"}, {"name": "a"}]),
            "workers[1].name",
            "duplicate node worker name 'a'",
        ),
        (
            node_of(workers=[{"name": "a", "gpu": "0"}]),
            "workers[0].gpu",
            "node worker 'a' gpu must be a non-negative integer",
        ),
        (
            node_of(workers=[{"name": "a", "gpu": -1}]),
            "workers[0].gpu",
            "node worker 'a' gpu must be a non-negative integer",
        ),
        (
            node_of(workers=[{"name": "a", "host": 1}]),
            "workers[0].host",
            "node worker 'a' host must be a string",
        ),
        (
            node_of(workers=[{"name": "a", "host": "h", "endpoints": {"host": "g"}}]),
            "workers[0].host",
            "node worker 'a' sets both 'host' and 'endpoints.host'; keep one",
        ),
        (
            node_of(role="everything", workers=[{"name": "a"}]),
            "role",
            "node config 'role' must be one of all, workers, gateway (got 'everything')",
        ),
        (
            node_of(shared_host_weights="yes", workers=[{"name": "a"}]),
            "shared_host_weights",
            "node config 'shared_host_weights' must be a boolean",
        ),
        (
            node_of(gateway=[1], workers=[{"name": "a"}]),
            "gateway",
            "node config 'gateway' must be a mapping",
        ),
        (
            node_of(gpus=-1, workers=[{"name": "a"}]),
            "gpus",
            "node config 'gpus' count must be >= 0",
        ),
        (
            node_of(**{"global": ["x"]}, workers=[{"name": "a"}]),
            "global",
            "node config 'global' must be a mapping",
        ),
    ],
)
def test_structural_errors(node, path, message):
    err = config_error(validate_node, node)
    assert (err.path, err.message) == (path, message)


def test_unknown_top_level_key_is_rejected():
    err = config_error(validate_node, node_of(workerz=[], workers=[{"name": "a"}]))
    assert err.path == "workerz"
    assert err.message.startswith("unknown node config key (known: model_repo, base_port, ")


def test_role_is_case_insensitive_and_gateway_block_is_left_to_the_gateway():
    validate_node(
        node_of(role="Workers", gateway={"anything": {"goes": 1}}, workers=[{"name": "a"}])
    )


@pytest.mark.parametrize(
    ("node", "path", "message"),
    [
        (
            node_of(**{"global": {"scheduler": {"modles": {}}}}, workers=[{"name": "a"}]),
            "global.scheduler.modles",
            "unknown key; did you mean 'models'?",
        ),
        (
            node_of(workers=[{"name": "a"}, {"name": "b", "runtime": {"mem_fractoin": 0.5}}]),
            "workers[1].runtime.mem_fractoin",
            "unknown key; did you mean 'mem_fraction'?",
        ),
        (node_of(workers=[{"name": "a", "gpus": 1}]), "workers[0].gpus", "unknown key"),
        (
            node_of(
                **{"global": {"scheduler": {"models": {"m": {"wieght": 1}}}}},
                workers=[{"name": "a"}],
            ),
            "global.scheduler.models.m.wieght",
            "unknown key; did you mean 'weight'?",
        ),
    ],
)
def test_unknown_keys_in_config_blocks_name_where_they_were_written(node, path, message):
    err = config_error(validate_node, node)
    assert err.path == path
    assert err.message.startswith(message)


def test_removed_keys_in_node_blocks_fail_with_migration_messages():
    err = config_error(
        validate_node, node_of(**{"global": {"batch_policy": {}}}, workers=[{"name": "a"}])
    )
    assert err.path == "global.batch_policy"
    assert err.message.startswith("the 'batch_policy' config has been removed")
    err = config_error(
        validate_node, node_of(workers=[{"name": "a", "runtime": {"residency_mode": "x"}}])
    )
    assert err.path == "workers[0].runtime.residency_mode"
    assert err.message.startswith("runtime.residency_mode has been removed")


@pytest.mark.parametrize(
    ("block", "rel", "why"),
    [
        ({"model_dirs": ["/x"]}, "model_dirs", "it is the node's model_repo"),
        (
            {"endpoints": {"port": 1}},
            "endpoints.port",
            "set the node's base_port or the worker's port",
        ),
        (
            {"endpoints": {"metrics_port": 1}},
            "endpoints.metrics_port",
            "set the node's metrics_base_port",
        ),
        ({"runtime": {"device_ordinal": 1}}, "runtime.device_ordinal", "set the worker's gpu"),
    ],
)
def test_node_derived_keys_are_rejected_in_global_and_worker_blocks(block, rel, why):
    err = config_error(validate_node, node_of(**{"global": block}, workers=[{"name": "a"}]))
    assert (err.path, err.message) == (f"global.{rel}", f"is derived by the node; {why}")
    err = config_error(validate_node, node_of(workers=[{"name": "a", **block}]))
    assert (err.path, err.message) == (f"workers[0].{rel}", f"is derived by the node; {why}")


def test_type_errors_in_worker_blocks_surface_at_validation_with_the_worker_name():
    err = config_error(
        validate_node, node_of(workers=[{"name": "a", "scheduler": {"max_queue_depth": "lots"}}])
    )
    assert err.path == "scheduler.max_queue_depth"
    assert err.message == (
        "node worker 'a': config 'scheduler.max_queue_depth' must be an integer (got 'lots')"
    )


# --- per-worker resolution --------------------------------------------------------------------


def test_global_deep_merges_under_worker_blocks():
    node = validate_node(
        node_of(
            **{
                "global": {
                    "runtime": {"backend": "cpu", "mem_fraction": 0.9},
                    "endpoints": {"host": "0.0.0.0"},
                    "scheduler": {"models": {"m": {"weight": 2.0}}},
                }
            },
            workers=[
                {
                    "name": "a",
                    "gpu": 0,
                    "runtime": {"mem_fraction": 0.5},
                    "scheduler": {"models": {"m": {"max_batch_size": 4}}},
                },
                {"name": "b", "gpu": 1},
            ],
        )
    )
    a, _, _ = node_server_config(node, "a", env={})
    b, _, _ = node_server_config(node, "b", env={})
    assert (a.runtime.backend, a.runtime.mem_fraction, a.runtime.device_ordinal) == ("cpu", 0.5, 0)
    assert (b.runtime.backend, b.runtime.mem_fraction, b.runtime.device_ordinal) == ("cpu", 0.9, 1)
    assert a.model_sched("m").weight == 2.0 and a.model_sched("m").max_batch_size == 4
    assert b.model_sched("m").weight == 2.0 and b.model_sched("m").max_batch_size is None
    assert a.endpoints.host == b.endpoints.host == "0.0.0.0"
    assert a.model_dirs == b.model_dirs == ("/repo",)
    assert (a.endpoints.port, b.endpoints.port) == (8080, 8081)


def test_worker_raw_config_does_not_mutate_the_node():
    node = validate_node(
        node_of(
            **{"global": {"runtime": {"backend": "cpu"}}},
            models={"m": ["a"]},
            workers=[{"name": "a"}],
        )
    )
    before = copy.deepcopy(node)
    raw = worker_raw_config(node, "a")
    raw["runtime"]["backend"] = "cuda"
    assert node == before


def test_worker_host_sets_its_bind_address():
    node = validate_node(
        node_of(
            **{"global": {"endpoints": {"host": "0.0.0.0"}}},
            workers=[{"name": "a", "host": "10.0.0.5"}, {"name": "b"}],
        )
    )
    assert node_server_config(node, "a", env={})[0].endpoints.host == "10.0.0.5"
    assert node_server_config(node, "b", env={})[0].endpoints.host == "0.0.0.0"


def test_models_map_pins_device_residency_only_on_listed_workers():
    node = validate_node(
        node_of(
            **{
                "global": {
                    "scheduler": {
                        "models": {"resnet": {"weight": 2.0}, "spine": {"residency": "system"}}
                    }
                }
            },
            workers=[{"name": "w0"}, {"name": "w1"}],
            models={"resnet": ["w0", "w1"], "coral": ["w0"], "spine": ["w1"]},
        )
    )
    w0, _, _ = node_server_config(node, "w0", env={})
    w1, _, _ = node_server_config(node, "w1", env={})
    assert w0.model_sched("resnet").residency is ResidencyState.PINNED_DEVICE
    assert w0.model_sched("resnet").weight == 2.0  # other fields of the block survive
    assert w0.model_sched("coral").residency is ResidencyState.PINNED_DEVICE
    assert (
        w0.model_sched("spine").residency is ResidencyState.PINNED_SYSTEM
    )  # global, not pinned here
    assert w1.model_sched("resnet").residency is ResidencyState.PINNED_DEVICE
    assert "coral" not in w1.scheduler.models
    assert (
        w1.model_sched("spine").residency is ResidencyState.PINNED_SYSTEM
    )  # explicit residency wins
    assert w0.models_include == w1.models_include == ()  # the map never restricts loading


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (["m"], "node config 'models' must be a mapping of model name to worker list"),
        ({"m": "w0"}, "node config 'models.m' must be a list of worker names"),
        ({"m": []}, "node config 'models.m' assigns the model to no workers"),
        ({"m": [1]}, "node config 'models.m' entries must be worker names (strings)"),
        (
            {"m": ["w0", "ghost"]},
            "node config 'models.m' targets undefined worker 'ghost' (have: w0, w1)",
        ),
    ],
)
def test_models_map_errors(models, message):
    err = config_error(
        validate_node, node_of(workers=[{"name": "w0"}, {"name": "w1"}], models=models)
    )
    assert err.message == message


def test_node_level_shared_host_weights_fills_unset_runtime_values():
    node = validate_node(
        node_of(
            shared_host_weights=True,
            workers=[{"name": "a"}, {"name": "b", "runtime": {"shared_host_weights": False}}],
        )
    )
    assert node_server_config(node, "a", env={})[0].runtime.shared_host_weights is True
    assert node_server_config(node, "b", env={})[0].runtime.shared_host_weights is False


def test_sole_worker_default_and_worker_choice():
    solo = validate_node(node_of(workers=[{"name": "solo"}]))
    cfg, applied, name = node_server_config(solo, env={})
    assert (name, cfg.worker_name, applied) == ("solo", "solo", [])
    two = validate_node(node_of(workers=[{"name": "a"}, {"name": "b"}]))
    err = config_error(node_server_config, two, env={})
    assert (
        err.message
        == "node has 2 workers; specify which to serve (name it, or set KSERVE_TRIO_WORKER_NAME; have: a, b)"
    )
    err = config_error(node_server_config, two, "ghost", env={})
    assert err.message == "worker 'ghost' not defined in node (have: a, b)"
    err = config_error(worker_raw_config, two, "ghost")
    assert err.message == "worker 'ghost' not defined in node (have: a, b)"
    cfg, applied, name = node_server_config(two, env={"KSERVE_TRIO_WORKER_NAME": "b"})
    assert (name, cfg.endpoints.port) == ("b", 8081)
    assert applied == [("KSERVE_TRIO_WORKER_NAME", "b")]


def test_env_overrides_win_over_the_node_and_are_reported():
    node = validate_node(
        node_of(**{"global": {"runtime": {"backend": "cpu"}}}, workers=[{"name": "a"}])
    )
    env = {"INFERENCE_SERVER_ENDPOINTS_PORT": "12345", "INFERENCE_SERVER_RUNTIME_NUMERICS": "f32"}
    cfg, applied, _ = node_server_config(node, env=env)
    assert cfg.endpoints.port == 12345 and cfg.runtime.numerics.value == "f32"
    assert sorted(applied) == sorted(env.items())


def test_node_server_config_does_not_validate():
    node = validate_node(node_of(workers=[{"name": "a", "port": 65535}]))
    cfg, _, _ = node_server_config(node, env={"INFERENCE_SERVER_ENDPOINTS_PORT": "99999"})
    assert cfg.endpoints.port == 99999
    with pytest.raises(ConfigError):
        validate_config(cfg, check_dirs=False)


def test_load_server_config_reads_a_node_file(tmp_path):
    from kserve_trio.core.process.node import load_server_config

    path = write(
        tmp_path,
        f"""
        model_repo: {tmp_path}
        base_port: 8080
        metrics_base_port: 9100
        global:
          model_control_mode: explicit
        workers:
          - {{name: a, gpu: 1}}
          - {{name: b}}
        models:
          m: [b]
        """,
    )
    cfg, applied = load_server_config(path, "b", env={})
    assert (cfg.worker_name, cfg.endpoints.port, cfg.endpoints.metrics_port) == ("b", 8081, 9101)
    assert cfg.model_dirs == (str(tmp_path),) and cfg.runtime.device_ordinal == 0
    assert cfg.model_sched("m").residency is ResidencyState.PINNED_DEVICE
    assert cfg.residency_mode.value == "externally_managed" and applied == []
    cfg, _ = load_server_config(path, "a", env={})
    assert cfg.runtime.device_ordinal == 1


# --- gpus -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("AUTO", "auto"),
        (" Auto ", "auto"),
        (3, 3),
        (0, 0),
        ([0, 2], ["0", "2"]),
        (["GPU-aaaa", " GPU-bbbb "], ["GPU-aaaa", "GPU-bbbb"]),
        ([1, "GPU-c"], ["1", "GPU-c"]),
    ],
)
def test_node_gpus_accepts(value, expected):
    node = {} if value is None else {"gpus": value}
    assert node_gpus(node) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "node config 'gpus' count must be >= 0"),
        ([], "node config 'gpus' list must not be empty"),
        ("two", "node config 'gpus' must be 'auto', an integer count, or a list of devices"),
        ({}, "node config 'gpus' must be 'auto', an integer count, or a list of devices"),
        (True, "node config 'gpus' must be 'auto', an integer count, or a list of devices"),
        ([0, -1], "node config 'gpus' entries must be device ordinals or UUID strings"),
        ([""], "node config 'gpus' entries must be device ordinals or UUID strings"),
        ([1.5], "node config 'gpus' entries must be device ordinals or UUID strings"),
    ],
)
def test_node_gpus_rejects(value, message):
    err = config_error(node_gpus, {"gpus": value})
    assert (err.path, err.message) == ("gpus", message)


# --- materialize_node -------------------------------------------------------------------------


def test_materialize_synthesizes_one_worker_per_device():
    node = node_of(metrics_base_port=9100)
    assert materialize_node(node, ["0", "1", "2"]) == ["0", "1", "2"]
    assert worker_names(node) == ["worker0", "worker1", "worker2"]
    validate_node(node)
    raw = worker_raw_config(node, "worker1")
    assert (raw["endpoints"]["port"], raw["endpoints"]["metrics_port"]) == (8081, 9101)
    assert raw["runtime"]["device_ordinal"] == 0


def test_materialize_cpu_node_uses_cpu_workers():
    node = node_of()
    assert materialize_node(node, [], cpu_workers=2) == [None, None]
    assert worker_names(node) == ["worker0", "worker1"]
    assert materialize_node(node_of(), []) == [None]
    err = config_error(materialize_node, node_of(), [], cpu_workers=0)
    assert err.message == "cannot materialize a node with no devices and cpu_workers < 1"


def test_materialize_passes_uuids_through():
    node = node_of()
    assert materialize_node(node, ["GPU-aaaa"]) == ["GPU-aaaa"]
    assert worker_names(node) == ["worker0"]


def test_materialize_explicit_workers_are_positional_and_extra_devices_unused():
    node = node_of(workers=[{"name": "a"}, {"name": "b"}])
    assert materialize_node(node, ["0", "1", "2"]) == ["0", "1"]
    assert worker_names(node) == ["a", "b"]


def test_materialize_consumes_gpu_keys():
    node = node_of(workers=[{"name": "a", "gpu": 1}, {"name": "b", "gpu": 0}])
    assert materialize_node(node, ["0", "1"]) == ["1", "0"]
    assert all("gpu" not in w for w in node["workers"])
    validate_node(node)
    assert worker_raw_config(node, "a")["runtime"]["device_ordinal"] == 0


@pytest.mark.parametrize(
    ("workers", "devices", "message"),
    [
        (
            [{"name": "a"}, {"name": "b"}],
            ["0"],
            "node worker 'b' needs device 1 but only 1 device(s) are visible",
        ),
        (
            [{"name": "a", "gpu": 2}],
            ["0", "1"],
            "node worker 'a' needs device 2 but only 2 device(s) are visible",
        ),
        (
            [{"name": "a", "gpu": 1}, {"name": "b"}],
            ["0", "1"],
            "node workers 'a' and 'b' are both assigned device '1'; set distinct 'gpu' keys",
        ),
        (
            [{"name": "a", "gpu": -1}],
            ["0", "1"],
            "node worker 'a' gpu must be a non-negative integer",
        ),
    ],
)
def test_materialize_errors(workers, devices, message):
    assert config_error(materialize_node, node_of(workers=workers), devices).message == message


def test_materialize_explicit_workers_on_a_cpu_node_keep_their_gpu_keys():
    node = node_of(workers=[{"name": "a", "gpu": 1}])
    assert materialize_node(node, []) == [None]
    assert node["workers"][0]["gpu"] == 1
