"""ServerConfig: defaults, YAML schema, environment overrides, precedence, validation."""

from __future__ import annotations

import dataclasses
import io
import textwrap
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config import (
    DEFAULT_GRPC_MSG_BYTES,
    ENV_OVERRIDES,
    LIMIT_FIELDS,
    EndpointsConfig,
    FrozenMap,
    GrpcConfig,
    MetaConfig,
    ModelControlMode,
    ModelSchedConfig,
    NumericsMode,
    ResidencyMode,
    ResidencyState,
    RuntimeConfig,
    SchedulerConfig,
    SchedulingDiscipline,
    ServerConfig,
    TlsConfig,
    apply_env_overrides,
    build_config,
    config_to_raw,
    deep_merge,
    log_config,
    validate_config,
)
from kserve_trio.core.process.node import load_server_config
from tests.test_import_graph import import_graph


def yaml_raw(text: str) -> Any:
    return YAML(typ="safe").load(io.StringIO(textwrap.dedent(text)))


def raises(path: str, message: str):
    """Context: a ConfigError with exactly this path and message."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(ConfigError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            swallowed = self.ctx.__exit__(*exc)
            assert self.info.value.path == path
            assert self.info.value.message == message
            return swallowed

    return _Check()


# --- defaults ---------------------------------------------------------------------------------


def test_every_default_is_the_documented_one():
    cfg = ServerConfig()
    assert cfg.model_dirs == ("models",)
    assert cfg.cache_dir == ""
    assert cfg.models_include == ()
    assert cfg.model_control_mode is ModelControlMode.DYNAMIC
    assert cfg.model_poll_seconds == 15.0 and isinstance(cfg.model_poll_seconds, float)
    assert cfg.worker_name == ""
    assert cfg.runtime == RuntimeConfig(
        backend="cpu",
        device_ordinal=0,
        mem_fraction=0.9,
        preallocate=True,
        allow_cpu_fallback=True,
        shared_host_weights=False,
        shared_host_weights_mode=0o666,
        weight_cache_fraction=1.0,
        weight_cache_wiggle_fraction=0.1,
        autotune=True,
        autotune_cache=None,
        autotune_cache_dir="",
        numerics=NumericsMode.AUTO,
        cpu_device_memory_bytes=0,
    )
    sc = cfg.scheduler
    assert sc.discipline is SchedulingDiscipline.FAIR
    assert (sc.ema_halflife_seconds, sc.recency_penalty_cap, sc.coalescing_discount) == (
        30.0,
        0.25,
        0.1,
    )
    assert (sc.cost_ema_alpha, sc.max_queue_depth, sc.dispatch_timeout_seconds) == (0.2, 1024, 30.0)
    assert sc.compaction_interval == 0
    assert dict(sc.models) == {}
    assert cfg.endpoints == EndpointsConfig("127.0.0.1", 8001, 0, 64)
    assert cfg.endpoints.client_shared_memory is True
    assert cfg.endpoints.client_shared_memory_prefixes == ()
    assert cfg.grpc == GrpcConfig(512 << 20, 512 << 20) == GrpcConfig()
    assert DEFAULT_GRPC_MSG_BYTES == 536870912
    assert cfg.meta == MetaConfig(1 << 30, 16) and cfg.meta.pool_enabled
    assert cfg.residency_mode is ResidencyMode.SELF_MANAGED
    assert cfg.model_sched("anything") == ModelSchedConfig(1.0, None, None)


def test_yaml_code_env_and_cli_paths_share_one_set_of_defaults(tmp_path):
    code = ServerConfig()
    assert build_config({}) == code
    assert build_config(yaml_raw("{}")) == code
    # empty blocks (all children commented out) parse as null and mean "all defaults"
    assert build_config(yaml_raw("runtime:\nscheduler:\nendpoints:\ngrpc:\nmeta:\n")) == code
    # no node file, empty environment, no flags
    cfg, applied = load_server_config(env={}, check_dirs=False)
    assert cfg == code and applied == []
    # the node path: only the node-derived keys differ from the code defaults
    node = tmp_path / "node.yaml"
    node.write_text(f"model_repo: {tmp_path}\nbase_port: 8001\nworkers:\n  - name: solo\n")
    from_node, applied = load_server_config(node, env={})
    assert applied == []
    assert dataclasses.replace(from_node, model_dirs=("models",), worker_name="") == code


def test_dataclasses_are_frozen_and_hashable():
    cfg = build_config({"scheduler": {"models": {"m": {"weight": 2.0}}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_dir = "x"  # type: ignore[misc]
    assert isinstance(cfg.scheduler.models, FrozenMap)
    assert hash(cfg) == hash(build_config({"scheduler": {"models": {"m": {"weight": 2.0}}}}))
    assert cfg.scheduler.models == {"m": ModelSchedConfig(weight=2.0)}
    with pytest.raises(TypeError):
        cfg.scheduler.models["n"] = ModelSchedConfig()  # type: ignore[index]


def test_code_built_configs_accept_plain_values():
    cfg = ServerConfig(
        model_dirs=["a", "b"],  # type: ignore[arg-type]
        model_control_mode="EXPLICIT",  # type: ignore[arg-type]
        runtime=RuntimeConfig(backend="GPU", numerics="f32"),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(discipline="edf", models={"m": ModelSchedConfig(residency=3)}),  # type: ignore[arg-type]
    )
    assert cfg.model_dirs == ("a", "b")
    assert ServerConfig(model_dirs="solo").model_dirs == ("solo",)  # type: ignore[arg-type]
    assert cfg.model_control_mode is ModelControlMode.EXPLICIT
    assert cfg.residency_mode is ResidencyMode.EXTERNALLY_MANAGED
    assert cfg.runtime.backend == "cuda" and cfg.runtime.numerics is NumericsMode.F32
    assert cfg.scheduler.discipline is SchedulingDiscipline.EDF
    assert cfg.model_sched("m").residency is ResidencyState.PINNED_DEVICE
    with raises("runtime.numerics", "must be one of 'auto', 'f32', 'tf32' (got 'fast')"):
        RuntimeConfig(numerics="fast")  # type: ignore[arg-type]


def test_residency_state_numbers_match_the_control_proto():
    assert [s.value for s in ResidencyState] == [1, 2, 3]
    from kserve_trio.proto import reactant_control as rc

    wire = {m.name: m.value for m in rc.Residency}
    assert {s.name: s.value for s in ResidencyState} == {
        name: value for name, value in wire.items() if name != "RESIDENCY_UNSPECIFIED"
    }


# --- YAML parsing -----------------------------------------------------------------------------


def test_full_yaml_block_parses_into_typed_fields():
    cfg = build_config(
        yaml_raw(
            """
            model_dirs: [/a, /b]
            cache_dir: /cache
            models_include: [m1]
            model_control_mode: Static
            model_poll_seconds: 2
            runtime:
              backend: gpu
              device_ordinal: 1
              mem_fraction: 0.5
              preallocate: false
              allow_cpu_fallback: false
              shared_host_weights: true
              shared_host_weights_mode: "660"
              weight_cache_fraction: 0.6
              weight_cache_wiggle_fraction: 0.05
              autotune: false
              autotune_cache: true
              autotune_cache_dir: /at
              numerics: TF32
              cpu_device_memory_bytes: 4096
            scheduler:
              discipline: FIFO
              ema_halflife_seconds: 45
              recency_penalty_cap: 0.3
              coalescing_discount: 0.2
              cost_ema_alpha: 0.15
              max_queue_depth: 256
              dispatch_timeout_seconds: 0
              compaction_interval: 100
              models:
                resnet: {weight: 2.0, max_batch_size: 8}
                yolo: {residency: pinned_system}
                spine: {pin_to_gpu: true}
                bare:
            endpoints: {host: 0.0.0.0, port: 0, metrics_port: 9100, max_concurrent_requests: 0}
            grpc: {max_recv_msg_bytes: 1024, max_send_msg_bytes: 2048}
            meta: {fanout_bytes: 0, fanout_slots: 4}
            """
        )
    )
    assert cfg.model_dirs == ("/a", "/b") and cfg.cache_dir == "/cache"
    assert cfg.models_include == ("m1",)
    assert cfg.model_control_mode is ModelControlMode.STATIC
    assert cfg.model_poll_seconds == 2.0 and isinstance(cfg.model_poll_seconds, float)
    rt = cfg.runtime
    assert (rt.backend, rt.device_ordinal, rt.mem_fraction) == ("cuda", 1, 0.5)
    assert (rt.preallocate, rt.allow_cpu_fallback, rt.shared_host_weights) == (False, False, True)
    assert rt.shared_host_weights_mode == 0o660
    assert (rt.weight_cache_fraction, rt.weight_cache_wiggle_fraction) == (0.6, 0.05)
    assert (rt.autotune, rt.autotune_cache, rt.autotune_cache_dir) == (False, True, "/at")
    assert rt.numerics is NumericsMode.TF32 and rt.cpu_device_memory_bytes == 4096
    sc = cfg.scheduler
    assert sc.discipline is SchedulingDiscipline.FIFO
    assert sc.ema_halflife_seconds == 45.0 and isinstance(sc.ema_halflife_seconds, float)
    assert (sc.recency_penalty_cap, sc.coalescing_discount, sc.cost_ema_alpha) == (0.3, 0.2, 0.15)
    assert (sc.max_queue_depth, sc.dispatch_timeout_seconds, sc.compaction_interval) == (
        256,
        0.0,
        100,
    )
    assert sc.models == {
        "resnet": ModelSchedConfig(2.0, None, 8),
        "yolo": ModelSchedConfig(1.0, ResidencyState.PINNED_SYSTEM, None),
        "spine": ModelSchedConfig(1.0, ResidencyState.PINNED_DEVICE, None),
        "bare": ModelSchedConfig(),
    }
    assert cfg.endpoints == EndpointsConfig("0.0.0.0", 0, 9100, 0)
    assert cfg.grpc == GrpcConfig(1024, 2048)
    assert cfg.meta == MetaConfig(0, 4) and not cfg.meta.pool_enabled


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("unpinned", ResidencyState.UNPINNED),
        ("system", ResidencyState.PINNED_SYSTEM),
        ("pinned_system", ResidencyState.PINNED_SYSTEM),
        (" Device ", ResidencyState.PINNED_DEVICE),
        ("pinned_device", ResidencyState.PINNED_DEVICE),
    ],
)
def test_residency_words(text, state):
    cfg = build_config({"scheduler": {"models": {"m": {"residency": text}}}})
    assert cfg.model_sched("m").residency is state


def test_pin_to_gpu_alias_and_contradiction():
    alias = build_config({"scheduler": {"models": {"m": {"pin_to_gpu": True}}}})
    assert alias.model_sched("m").residency is ResidencyState.PINNED_DEVICE
    off = build_config({"scheduler": {"models": {"m": {"pin_to_gpu": False}}}})
    assert off.model_sched("m").residency is None
    same = build_config(
        {"scheduler": {"models": {"m": {"pin_to_gpu": True, "residency": "device"}}}}
    )
    assert same.model_sched("m").residency is ResidencyState.PINNED_DEVICE
    with raises(
        "scheduler.models.m", "pin_to_gpu: true contradicts the model's residency; set only one"
    ):
        build_config({"scheduler": {"models": {"m": {"pin_to_gpu": True, "residency": "system"}}}})


@pytest.mark.parametrize(
    ("raw", "path", "message"),
    [
        (
            {"model_control_mode": "bogus"},
            "model_control_mode",
            "must be one of 'static', 'dynamic', 'explicit' (got 'bogus')",
        ),
        (
            {"runtime": {"backend": "tpu"}},
            "runtime.backend",
            "must be 'cpu' or 'cuda' ('gpu' is an alias) (got 'tpu')",
        ),
        (
            {"runtime": {"numerics": "fast"}},
            "runtime.numerics",
            "must be one of 'auto', 'f32', 'tf32' (got 'fast')",
        ),
        (
            {"scheduler": {"discipline": "lifo"}},
            "scheduler.discipline",
            "must be one of 'fair', 'fifo', 'edf' (got 'lifo')",
        ),
        (
            {"scheduler": {"models": {"m": {"residency": "gpu"}}}},
            "scheduler.models.m.residency",
            "must be 'unpinned', 'system' or 'device' (got 'gpu')",
        ),
        (
            {"runtime": {"shared_host_weights_mode": "999"}},
            "runtime.shared_host_weights_mode",
            'must be an octal permission string like "666" or "660" (got \'999\')',
        ),
        (
            {"runtime": {"shared_host_weights_mode": "1777"}},
            "runtime.shared_host_weights_mode",
            'must be an octal permission string like "666" or "660" (got \'1777\')',
        ),
    ],
)
def test_bad_enum_words_are_rejected_with_their_choices(raw, path, message):
    with raises(path, message):
        build_config(raw)


@pytest.mark.parametrize(
    ("raw", "path", "kind", "got"),
    [
        (
            {"scheduler": {"max_queue_depth": "10"}},
            "scheduler.max_queue_depth",
            "an integer",
            "'10'",
        ),
        ({"scheduler": {"max_queue_depth": 1.5}}, "scheduler.max_queue_depth", "an integer", "1.5"),
        ({"endpoints": {"port": True}}, "endpoints.port", "an integer", "True"),
        ({"runtime": {"mem_fraction": "half"}}, "runtime.mem_fraction", "a number", "'half'"),
        ({"runtime": {"mem_fraction": False}}, "runtime.mem_fraction", "a number", "False"),
        ({"model_poll_seconds": None}, "model_poll_seconds", "a number", "None"),
        ({"runtime": {"preallocate": "yes"}}, "runtime.preallocate", "a boolean", "'yes'"),
        ({"runtime": {"autotune_cache": 1}}, "runtime.autotune_cache", "a boolean", "1"),
        ({"endpoints": {"host": 127}}, "endpoints.host", "a string", "127"),
        ({"cache_dir": ["x"]}, "cache_dir", "a string", "['x']"),
        ({"model_control_mode": 3}, "model_control_mode", "a string", "3"),
        ({"model_dirs": "models"}, "model_dirs", "a list", "'models'"),
        ({"models_include": {"a": 1}}, "models_include", "a list", "{'a': 1}"),
        ({"model_dirs": ["a", 2]}, "model_dirs[1]", "a string", "2"),
        (
            {"scheduler": {"models": {"m": {"weight": "heavy"}}}},
            "scheduler.models.m.weight",
            "a number",
            "'heavy'",
        ),
        (
            {"scheduler": {"models": {"m": {"max_batch_size": 2.0}}}},
            "scheduler.models.m.max_batch_size",
            "an integer",
            "2.0",
        ),
        (
            {"scheduler": {"models": {"m": {"pin_to_gpu": "on"}}}},
            "scheduler.models.m.pin_to_gpu",
            "a boolean",
            "'on'",
        ),
    ],
)
def test_type_errors_name_the_key_and_the_expected_type(raw, path, kind, got):
    with raises(path, f"config '{path}' must be {kind} (got {got})"):
        build_config(raw)


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"runtime": "cpu"}, "runtime"),
        ({"scheduler": {"models": ["m"]}}, "scheduler.models"),
        ({"scheduler": {"models": {"m": 3}}}, "scheduler.models.m"),
        ({"grpc": 5}, "grpc"),
    ],
)
def test_non_mapping_blocks_are_rejected(raw, path):
    with raises(path, f"config '{path}' must be a mapping"):
        build_config(raw)


def test_shared_host_weights_mode_must_be_quoted():
    path = "runtime.shared_host_weights_mode"
    with raises(
        path, f"config '{path}' must be a string (quote the octal bits, e.g. \"660\"; got 660)"
    ):
        build_config(yaml_raw("runtime: {shared_host_weights_mode: 660}"))


@pytest.mark.parametrize(
    ("raw", "path", "message"),
    [
        ({"modle_dirs": ["x"]}, "modle_dirs", "unknown key; did you mean 'model_dirs'?"),
        ({"scheduler": {"modles": {}}}, "scheduler.modles", "unknown key; did you mean 'models'?"),
        (
            {"scheduler": {"models": {"m": {"wieght": 2}}}},
            "scheduler.models.m.wieght",
            "unknown key; did you mean 'weight'?",
        ),
        (
            {"endpoints": {"tls": {"cert": "x"}}},
            "endpoints.tls.cert",
            "unknown key; did you mean 'cert_file'?",
        ),
        ({"endpoints": {"ssl": {}}}, "endpoints.ssl", None),
        ({"logging": {"level": "info"}}, "logging", None),
        ({"runtime": {"meta_concurrency": 2}}, "runtime.meta_concurrency", None),
    ],
)
def test_unknown_keys_are_rejected_with_their_path(raw, path, message):
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    assert info.value.path == path
    assert info.value.message.startswith(message or "unknown key")
    assert "(known: " in info.value.message
    assert str(info.value).startswith(f"{path}: unknown key")


def test_unknown_key_without_a_close_match_lists_the_known_keys_of_its_block():
    with pytest.raises(ConfigError) as info:
        build_config({"grpc": {"max_msg": 1}})
    assert info.value.message == (
        "unknown key (known: max_recv_msg_bytes, max_send_msg_bytes, compress_responses)"
    )


def test_removed_keys_fail_with_migration_messages():
    with pytest.raises(ConfigError) as info:
        build_config(yaml_raw("batch_policy:\n  max_batch_size: 8\n"))
    assert info.value.path == "batch_policy"
    assert info.value.message == (
        "the 'batch_policy' config has been removed; set a per-model cap via "
        "scheduler.models.<name>.max_batch_size (the batch axis comes from the model manifest)"
    )
    with pytest.raises(ConfigError) as info:
        build_config({"runtime": {"residency_mode": "externally_managed"}})
    assert info.value.path == "runtime.residency_mode"
    assert info.value.message == (
        "runtime.residency_mode has been removed; use the top-level model_control_mode instead "
        "('explicit' replaces 'externally_managed'; 'static'/'dynamic' are self-managed)"
    )


def test_optional_fields_accept_null_as_unset():
    cfg = build_config(
        yaml_raw(
            """
            runtime: {autotune_cache: null}
            scheduler: {models: {m: {residency: null, max_batch_size: null}}}
            """
        )
    )
    assert cfg.runtime.autotune_cache is None
    assert cfg.model_sched("m") == ModelSchedConfig()


def test_root_must_be_a_mapping():
    with raises("", "config root must be a mapping (got list)"):
        build_config([])  # type: ignore[arg-type]


def test_explicit_mode_derives_externally_managed_residency():
    assert (
        build_config({"model_control_mode": "explicit"}).residency_mode
        is ResidencyMode.EXTERNALLY_MANAGED
    )
    assert (
        build_config({"model_control_mode": "static"}).residency_mode is ResidencyMode.SELF_MANAGED
    )
    assert (
        build_config({"model_control_mode": "dynamic"}).residency_mode is ResidencyMode.SELF_MANAGED
    )


def test_config_to_raw_round_trips_through_build_config():
    cfg = build_config(
        {
            "model_dirs": ["/m"],
            "models_include": ["a"],
            "model_control_mode": "explicit",
            "runtime": {
                "shared_host_weights_mode": "640",
                "numerics": "f32",
                "autotune_cache": False,
            },
            "scheduler": {
                "discipline": "edf",
                "models": {"a": {"residency": "device", "max_batch_size": 4}},
            },
            "endpoints": {"port": 9000},
            "meta": {"fanout_slots": 2},
        }
    )
    raw = config_to_raw(cfg)
    assert raw["runtime"]["shared_host_weights_mode"] == "640"
    assert raw["scheduler"]["models"]["a"] == {
        "weight": 1.0,
        "residency": "pinned_device",
        "max_batch_size": 4,
    }
    assert build_config(raw) == cfg
    assert build_config(config_to_raw(ServerConfig())) == ServerConfig()


# --- environment overrides --------------------------------------------------------------------

ENV_CASES = [
    ("INFERENCE_SERVER_CACHE_DIR", "/jaxcache", lambda c: c.cache_dir, "/jaxcache"),
    ("INFERENCE_SERVER_MODEL_POLL_SECONDS", "2.5", lambda c: c.model_poll_seconds, 2.5),
    (
        "INFERENCE_SERVER_MODEL_CONTROL_MODE",
        "explicit",
        lambda c: c.model_control_mode,
        ModelControlMode.EXPLICIT,
    ),
    ("INFERENCE_SERVER_MODEL_DIRS", "/a::/b:", lambda c: c.model_dirs, ("/a", "/b")),
    ("INFERENCE_SERVER_MODELS_INCLUDE", "x:y", lambda c: c.models_include, ("x", "y")),
    ("INFERENCE_SERVER_SERVE_WITHOUT_HOOKS", "yes", lambda c: c.serve_without_hooks, True),
    ("INFERENCE_SERVER_RUNTIME_BACKEND", "cuda", lambda c: c.runtime.backend, "cuda"),
    ("INFERENCE_SERVER_RUNTIME_DEVICE_ORDINAL", "3", lambda c: c.runtime.device_ordinal, 3),
    ("INFERENCE_SERVER_RUNTIME_MEM_FRACTION", "0.5", lambda c: c.runtime.mem_fraction, 0.5),
    ("INFERENCE_SERVER_RUNTIME_PREALLOCATE", "false", lambda c: c.runtime.preallocate, False),
    (
        "INFERENCE_SERVER_RUNTIME_ALLOW_CPU_FALLBACK",
        "no",
        lambda c: c.runtime.allow_cpu_fallback,
        False,
    ),
    (
        "INFERENCE_SERVER_RUNTIME_WEIGHT_CACHE_FRACTION",
        "0.75",
        lambda c: c.runtime.weight_cache_fraction,
        0.75,
    ),
    (
        "INFERENCE_SERVER_RUNTIME_WEIGHT_CACHE_WIGGLE_FRACTION",
        "0.2",
        lambda c: c.runtime.weight_cache_wiggle_fraction,
        0.2,
    ),
    ("INFERENCE_SERVER_RUNTIME_AUTOTUNE", "0", lambda c: c.runtime.autotune, False),
    ("INFERENCE_SERVER_RUNTIME_AUTOTUNE_CACHE", "on", lambda c: c.runtime.autotune_cache, True),
    (
        "INFERENCE_SERVER_RUNTIME_AUTOTUNE_CACHE_DIR",
        "/at",
        lambda c: c.runtime.autotune_cache_dir,
        "/at",
    ),
    ("INFERENCE_SERVER_RUNTIME_NUMERICS", "f32", lambda c: c.runtime.numerics, NumericsMode.F32),
    (
        "INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS",
        "1",
        lambda c: c.runtime.shared_host_weights,
        True,
    ),
    (
        "INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS_MODE",
        "660",
        lambda c: c.runtime.shared_host_weights_mode,
        0o660,
    ),
    (
        "INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES",
        "1048576",
        lambda c: c.runtime.cpu_device_memory_bytes,
        1 << 20,
    ),
    (
        "INFERENCE_SERVER_SCHEDULER_DISCIPLINE",
        "edf",
        lambda c: c.scheduler.discipline,
        SchedulingDiscipline.EDF,
    ),
    (
        "INFERENCE_SERVER_SCHEDULER_EMA_HALFLIFE_SECONDS",
        "60",
        lambda c: c.scheduler.ema_halflife_seconds,
        60.0,
    ),
    (
        "INFERENCE_SERVER_SCHEDULER_RECENCY_PENALTY_CAP",
        "0.5",
        lambda c: c.scheduler.recency_penalty_cap,
        0.5,
    ),
    (
        "INFERENCE_SERVER_SCHEDULER_COALESCING_DISCOUNT",
        "0.3",
        lambda c: c.scheduler.coalescing_discount,
        0.3,
    ),
    ("INFERENCE_SERVER_SCHEDULER_COST_EMA_ALPHA", "0.4", lambda c: c.scheduler.cost_ema_alpha, 0.4),
    ("INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH", "7", lambda c: c.scheduler.max_queue_depth, 7),
    (
        "INFERENCE_SERVER_SCHEDULER_DISPATCH_TIMEOUT_SECONDS",
        "0",
        lambda c: c.scheduler.dispatch_timeout_seconds,
        0.0,
    ),
    (
        "INFERENCE_SERVER_SCHEDULER_COMPACTION_INTERVAL",
        "50",
        lambda c: c.scheduler.compaction_interval,
        50,
    ),
    ("INFERENCE_SERVER_ENDPOINTS_HOST", "0.0.0.0", lambda c: c.endpoints.host, "0.0.0.0"),
    ("INFERENCE_SERVER_ENDPOINTS_PORT", "12345", lambda c: c.endpoints.port, 12345),
    ("INFERENCE_SERVER_ENDPOINTS_METRICS_PORT", "9300", lambda c: c.endpoints.metrics_port, 9300),
    ("INFERENCE_SERVER_ENDPOINTS_HTTP_PORT", "8000", lambda c: c.endpoints.http_port, 8000),
    ("INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP", "trio", lambda c: c.endpoints.event_loop, "trio"),
    ("INFERENCE_SERVER_ENDPOINTS_HTTP2_ENGINE", "h2", lambda c: c.endpoints.http2_engine, "h2"),
    (
        "INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES",
        "3",
        lambda c: c.endpoints.frontend_processes,
        3,
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_FRONTEND_LIVENESS_INTERVAL_SECONDS",
        "0.25",
        lambda c: c.endpoints.frontend_liveness_interval_seconds,
        0.25,
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_FRONTEND_LIVENESS_MISSES",
        "5",
        lambda c: c.endpoints.frontend_liveness_misses,
        5,
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_CLIENT_SHARED_MEMORY",
        "off",
        lambda c: c.endpoints.client_shared_memory,
        False,
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_CLIENT_SHARED_MEMORY_PREFIXES",
        "triton_:/shm-kserve_trio_client-",
        lambda c: c.endpoints.client_shared_memory_prefixes,
        ("triton_", "/shm-kserve_trio_client-"),
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_RESTRICTED_PROTOCOLS",
        "model-repository,logging:admin-key=s; control:ops=t",
        lambda c: c.endpoints.restricted_protocols,
        ("model-repository,logging:admin-key=s", "control:ops=t"),
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_MAX_CONCURRENT_REQUESTS",
        "5",
        lambda c: c.endpoints.max_concurrent_requests,
        5,
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE",
        "/tls/cert.pem",
        lambda c: c.endpoints.tls.cert_file,
        "/tls/cert.pem",
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE",
        "/tls/key.pem",
        lambda c: c.endpoints.tls.key_file,
        "/tls/key.pem",
    ),
    (
        "INFERENCE_SERVER_ENDPOINTS_TLS_CLIENT_CA_FILE",
        "/tls/ca.pem",
        lambda c: c.endpoints.tls.client_ca_file,
        "/tls/ca.pem",
    ),
    ("INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES", "4096", lambda c: c.grpc.max_recv_msg_bytes, 4096),
    ("INFERENCE_SERVER_GRPC_MAX_SEND_MSG_BYTES", "8192", lambda c: c.grpc.max_send_msg_bytes, 8192),
    ("INFERENCE_SERVER_GRPC_COMPRESS_RESPONSES", "yes", lambda c: c.grpc.compress_responses, True),
    ("KSERVE_TRIO_FANOUT_BYTES", "65536", lambda c: c.meta.fanout_bytes, 65536),
    ("KSERVE_TRIO_FANOUT_SLOTS", "0", lambda c: c.meta.fanout_slots, 0),
    *(
        (
            f"INFERENCE_SERVER_LIMITS_{f.name.upper()}",
            "7",
            lambda c, name=f.name: getattr(c.limits, name),
            7,
        )
        for f in LIMIT_FIELDS
    ),
    ("INFERENCE_SERVER_TRACING_LEVEL", "TIMESTAMPS", lambda c: c.tracing.level, "timestamps"),
    (
        "INFERENCE_SERVER_TRACING_ENDPOINT",
        "http://otel:4318/v1/traces",
        lambda c: c.tracing.endpoint,
        "http://otel:4318/v1/traces",
    ),
    ("INFERENCE_SERVER_TRACING_SERVICE_NAME", "w0", lambda c: c.tracing.service_name, "w0"),
    ("INFERENCE_SERVER_TRACING_RATE", "10", lambda c: c.tracing.rate, 10),
    ("INFERENCE_SERVER_TRACING_COUNT", "5", lambda c: c.tracing.count, 5),
    (
        "INFERENCE_SERVER_TRACING_RESOURCE",
        "deployment.environment=prod, team=ml%20infra",
        lambda c: dict(c.tracing.resource),
        {"deployment.environment": "prod", "team": "ml infra"},
    ),
    ("INFERENCE_SERVER_TRACING_MAX_QUEUE_SIZE", "64", lambda c: c.tracing.max_queue_size, 64),
    (
        "INFERENCE_SERVER_TRACING_MAX_EXPORT_BATCH_SIZE",
        "32",
        lambda c: c.tracing.max_export_batch_size,
        32,
    ),
    (
        "INFERENCE_SERVER_TRACING_SCHEDULE_DELAY_SECONDS",
        "0.5",
        lambda c: c.tracing.schedule_delay_seconds,
        0.5,
    ),
    (
        "INFERENCE_SERVER_TRACING_EXPORT_TIMEOUT_SECONDS",
        "2",
        lambda c: c.tracing.export_timeout_seconds,
        2.0,
    ),
]


@pytest.mark.parametrize(
    ("var", "value", "get", "expected"), ENV_CASES, ids=[c[0] for c in ENV_CASES]
)
def test_every_env_override_sets_its_field(var, value, get, expected):
    raw, applied = apply_env_overrides({}, {var: value})
    assert applied == [(var, value)]
    cfg = build_config(raw)
    assert get(cfg) == expected
    assert get(ServerConfig()) != expected  # the override really changed something


def test_env_table_is_exactly_the_documented_one():
    assert set(ENV_OVERRIDES) == {c[0] for c in ENV_CASES}


@pytest.mark.parametrize("word", ["1", "true", "TRUE", " Yes ", "on", "On\n"])
def test_env_bool_true_words(word):
    raw, _ = apply_env_overrides({}, {"INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS": word})
    assert build_config(raw).runtime.shared_host_weights is True


@pytest.mark.parametrize("word", ["0", "false", "False", " NO ", "off"])
def test_env_bool_false_words(word):
    raw, _ = apply_env_overrides({}, {"INFERENCE_SERVER_RUNTIME_PREALLOCATE": word})
    assert build_config(raw).runtime.preallocate is False


@pytest.mark.parametrize("word", ["", "maybe", "2", "enabled"])
def test_env_bool_other_words_are_errors(word):
    var = "INFERENCE_SERVER_RUNTIME_AUTOTUNE"
    with raises(
        "runtime.autotune",
        f"environment override {var} has invalid boolean value {word!r} "
        "(expected 1|true|yes|on or 0|false|no|off)",
    ):
        apply_env_overrides({}, {var: word})


@pytest.mark.parametrize(
    ("var", "value", "path", "kind"),
    [
        ("INFERENCE_SERVER_ENDPOINTS_PORT", "80.5", "endpoints.port", "integer"),
        (
            "INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH",
            "lots",
            "scheduler.max_queue_depth",
            "integer",
        ),
        ("KSERVE_TRIO_FANOUT_SLOTS", "", "meta.fanout_slots", "integer"),
        ("INFERENCE_SERVER_RUNTIME_MEM_FRACTION", "most", "runtime.mem_fraction", "number"),
    ],
)
def test_env_number_parse_failures_name_the_variable(var, value, path, kind):
    with raises(path, f"environment override {var} has invalid {kind} value {value!r}"):
        apply_env_overrides({}, {var: value})


def test_env_migration_and_unknown_variables_fail():
    with raises(
        "",
        "environment override INFERENCE_SERVER_BATCH_POLICY_MAX_BATCH_SIZE: the 'batch_policy' "
        "config has been removed; set a per-model cap via scheduler.models.<name>.max_batch_size "
        "(the batch axis comes from the model manifest)",
    ):
        apply_env_overrides({}, {"INFERENCE_SERVER_BATCH_POLICY_MAX_BATCH_SIZE": "8"})
    with pytest.raises(ConfigError) as info:
        apply_env_overrides({}, {"INFERENCE_SERVER_RUNTIME_RESIDENCY_MODE": "externally_managed"})
    assert info.value.message.startswith(
        "environment override INFERENCE_SERVER_RUNTIME_RESIDENCY_MODE: runtime.residency_mode has "
        "been removed; use the top-level model_control_mode instead"
    )
    with raises(
        "",
        "KSERVE_TRIO_META_CONCURRENCY is not supported: a meta model runs on the device thread as "
        "one scheduled unit, so there is no meta concurrency gate to size",
    ):
        apply_env_overrides({}, {"KSERVE_TRIO_META_CONCURRENCY": "2"})
    with raises(
        "",
        "unknown environment override INFERENCE_SERVER_ENDPOINT_PORT; did you mean "
        "INFERENCE_SERVER_ENDPOINTS_PORT?",
    ):
        apply_env_overrides({}, {"INFERENCE_SERVER_ENDPOINT_PORT": "1"})


def test_env_ignores_unrelated_variables_and_does_not_mutate_its_input():
    raw = {"endpoints": {"host": "h"}, "model_dirs": ["x"]}
    out, applied = apply_env_overrides(
        raw,
        {
            "PATH": "/bin",
            "KSERVE_TRIO_GATEWAY_WORKERS": "a",
            "INFERENCE_SERVER_ENDPOINTS_PORT": "9",
        },
    )
    assert applied == [("INFERENCE_SERVER_ENDPOINTS_PORT", "9")]
    assert out == {"endpoints": {"host": "h", "port": 9}, "model_dirs": ["x"]}
    assert raw == {"endpoints": {"host": "h"}, "model_dirs": ["x"]}
    assert out["model_dirs"] is not raw["model_dirs"]


def test_env_refuses_to_overwrite_a_non_mapping_block():
    with raises("runtime", "config 'runtime' must be a mapping"):
        apply_env_overrides({"runtime": "cpu"}, {"INFERENCE_SERVER_RUNTIME_BACKEND": "cuda"})


def test_deep_merge_merges_mappings_and_replaces_the_rest():
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    over = {"a": {"c": [2], "e": {"f": 1}}, "d": {"g": 2}}
    merged = deep_merge(base, over)
    assert merged == {"a": {"b": 1, "c": [2], "e": {"f": 1}}, "d": {"g": 2}}
    merged["a"]["b"] = 99
    assert base["a"]["b"] == 1


# --- precedence -------------------------------------------------------------------------------


def _node_file(tmp_path: Path, body: str = "") -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(
        f"model_repo: {tmp_path}\nbase_port: 7000\n"
        + textwrap.dedent(body)
        + "workers:\n  - name: w0\n  - name: w1\n"
    )
    return path


def test_precedence_defaults_node_env_flags(tmp_path):
    node = _node_file(
        tmp_path,
        "global:\n  scheduler: {max_queue_depth: 10, cost_ema_alpha: 0.5}\n  cache_dir: /n\n",
    )
    env = {"INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH": "20", "INFERENCE_SERVER_CACHE_DIR": "/e"}
    flags = {"scheduler": {"max_queue_depth": 30}, "endpoints": {"host": None}}

    cfg, _ = load_server_config(node, "w1", env={})
    assert (cfg.scheduler.max_queue_depth, cfg.cache_dir, cfg.scheduler.cost_ema_alpha) == (
        10,
        "/n",
        0.5,
    )
    assert cfg.scheduler.recency_penalty_cap == 0.25  # default survives
    assert (cfg.endpoints.port, cfg.worker_name) == (7001, "w1")

    cfg, applied = load_server_config(node, "w1", env=env)
    assert (cfg.scheduler.max_queue_depth, cfg.cache_dir, cfg.scheduler.cost_ema_alpha) == (
        20,
        "/e",
        0.5,
    )
    assert applied == [
        ("INFERENCE_SERVER_CACHE_DIR", "/e"),
        ("INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH", "20"),
    ]

    cfg, _ = load_server_config(node, "w1", env=env, overrides=flags)
    assert (cfg.scheduler.max_queue_depth, cfg.cache_dir, cfg.scheduler.cost_ema_alpha) == (
        30,
        "/e",
        0.5,
    )
    assert cfg.endpoints.host == "127.0.0.1"  # a None flag is "not given"


def test_precedence_without_a_node_file(tmp_path):
    env = {"INFERENCE_SERVER_ENDPOINTS_PORT": "9001", "INFERENCE_SERVER_MODEL_DIRS": str(tmp_path)}
    cfg, applied = load_server_config(env=env)
    assert (cfg.endpoints.port, cfg.model_dirs) == (9001, (str(tmp_path),))
    assert len(applied) == 2
    cfg, _ = load_server_config(
        env=env, overrides={"endpoints": {"port": 9002}, "model_dirs": [str(tmp_path)]}
    )
    assert cfg.endpoints.port == 9002
    cfg, applied = load_server_config(env={"KSERVE_TRIO_WORKER_NAME": ""}, check_dirs=False)
    assert cfg.worker_name == "" and applied == []
    cfg, applied = load_server_config(env={"KSERVE_TRIO_WORKER_NAME": "solo"}, check_dirs=False)
    assert cfg.worker_name == "solo" and applied == [("KSERVE_TRIO_WORKER_NAME", "solo")]
    cfg, applied = load_server_config(
        worker="named", env={"KSERVE_TRIO_WORKER_NAME": "solo"}, check_dirs=False
    )
    assert cfg.worker_name == "named" and applied == []


def test_worker_is_chosen_by_argument_then_env(tmp_path):
    node = _node_file(tmp_path)
    cfg, applied = load_server_config(node, env={"KSERVE_TRIO_WORKER_NAME": "w1"})
    assert cfg.worker_name == "w1" and cfg.endpoints.port == 7001
    assert applied == [("KSERVE_TRIO_WORKER_NAME", "w1")]
    cfg, applied = load_server_config(node, "w0", env={"KSERVE_TRIO_WORKER_NAME": "w1"})
    assert cfg.worker_name == "w0" and applied == []
    with raises(
        "",
        "node has 2 workers; specify which to serve (name it, or set KSERVE_TRIO_WORKER_NAME; have: w0, w1)",
    ):
        load_server_config(node, env={})


def test_load_server_config_validates(tmp_path):
    with raises("model_dirs", f"model directory does not exist: {tmp_path / 'nope'}"):
        load_server_config(env={}, overrides={"model_dirs": [str(tmp_path / "nope")]})
    with raises("endpoints.port", "must be in 0..65535 (0 = ephemeral) (got 70000)"):
        load_server_config(env={"INFERENCE_SERVER_ENDPOINTS_PORT": "70000"}, check_dirs=False)
    with raises(
        "scheduler.modles",
        "unknown key; did you mean 'models'? (known: discipline, ema_halflife_seconds, "
        "recency_penalty_cap, coalescing_discount, cost_ema_alpha, max_queue_depth, "
        "dispatch_timeout_seconds, compaction_interval, models)",
    ):
        load_server_config(env={}, overrides={"scheduler": {"modles": {}}}, check_dirs=False)


# --- validation -------------------------------------------------------------------------------


def _with(**changes: Any) -> ServerConfig:
    """ServerConfig() with dotted-path replacements, e.g. ``_with(**{"endpoints.port": 1})``."""
    cfg = ServerConfig(model_dirs=("/",))
    for dotted, value in changes.items():
        head, _, leaf = dotted.rpartition(".")
        if head:
            sub = dataclasses.replace(getattr(cfg, head), **{leaf: value})
            cfg = dataclasses.replace(cfg, **{head: sub})
        else:
            cfg = dataclasses.replace(cfg, **{leaf: value})
    return cfg


VALIDATION_CASES = [
    ({"model_dirs": ()}, "model_dirs", "at least one model directory is required"),
    ({"model_poll_seconds": -1.0}, "model_poll_seconds", "must be >= 0 (got -1.0)"),
    (
        {"model_poll_seconds": 0.0},
        "model_poll_seconds",
        "model_control_mode 'dynamic' requires model_poll_seconds > 0",
    ),
    ({"endpoints.port": -1}, "endpoints.port", "must be in 0..65535 (0 = ephemeral) (got -1)"),
    (
        {"endpoints.port": 65536},
        "endpoints.port",
        "must be in 0..65535 (0 = ephemeral) (got 65536)",
    ),
    (
        {"endpoints.metrics_port": 70000},
        "endpoints.metrics_port",
        "must be in 0..65535 (0 = off) (got 70000)",
    ),
    (
        {"endpoints.metrics_port": 8001},
        "endpoints.metrics_port",
        "must differ from endpoints.port (8001)",
    ),
    (
        {"endpoints.max_concurrent_requests": -1},
        "endpoints.max_concurrent_requests",
        "must be >= 0 (0 = uncapped) (got -1)",
    ),
    ({"grpc.max_recv_msg_bytes": 0}, "grpc.max_recv_msg_bytes", "must be positive (got 0)"),
    ({"grpc.max_send_msg_bytes": -5}, "grpc.max_send_msg_bytes", "must be positive (got -5)"),
    (
        {"scheduler.ema_halflife_seconds": 0.0},
        "scheduler.ema_halflife_seconds",
        "must be positive (got 0.0)",
    ),
    (
        {"scheduler.recency_penalty_cap": 0.0},
        "scheduler.recency_penalty_cap",
        "must be in (0, 1] (got 0.0)",
    ),
    (
        {"scheduler.recency_penalty_cap": 1.5},
        "scheduler.recency_penalty_cap",
        "must be in (0, 1] (got 1.5)",
    ),
    (
        {"scheduler.coalescing_discount": 1.0},
        "scheduler.coalescing_discount",
        "must be in [0, 1) (got 1.0)",
    ),
    (
        {"scheduler.coalescing_discount": -0.1},
        "scheduler.coalescing_discount",
        "must be in [0, 1) (got -0.1)",
    ),
    ({"scheduler.cost_ema_alpha": 0.0}, "scheduler.cost_ema_alpha", "must be in (0, 1] (got 0.0)"),
    (
        {"scheduler.cost_ema_alpha": float("nan")},
        "scheduler.cost_ema_alpha",
        "must be in (0, 1] (got nan)",
    ),
    ({"scheduler.max_queue_depth": 0}, "scheduler.max_queue_depth", "must be positive (got 0)"),
    (
        {"scheduler.dispatch_timeout_seconds": -1.0},
        "scheduler.dispatch_timeout_seconds",
        "must be >= 0 (0 = off) (got -1.0)",
    ),
    (
        {"scheduler.compaction_interval": -1},
        "scheduler.compaction_interval",
        "must be >= 0 (0 = off) (got -1)",
    ),
    (
        {"scheduler.models": {"m": ModelSchedConfig(weight=0.0)}},
        "scheduler.models.m.weight",
        "must be positive (got 0.0)",
    ),
    (
        {"scheduler.models": {"m": ModelSchedConfig(max_batch_size=0)}},
        "scheduler.models.m.max_batch_size",
        "must be >= 1 (got 0)",
    ),
    ({"runtime.device_ordinal": -1}, "runtime.device_ordinal", "must be >= 0 (got -1)"),
    ({"runtime.mem_fraction": 0.0}, "runtime.mem_fraction", "must be in (0, 1] (got 0.0)"),
    ({"runtime.mem_fraction": 1.1}, "runtime.mem_fraction", "must be in (0, 1] (got 1.1)"),
    (
        {"runtime.weight_cache_fraction": 1.5},
        "runtime.weight_cache_fraction",
        "must be in [0, 1] (0 = cache off) (got 1.5)",
    ),
    (
        {"runtime.weight_cache_wiggle_fraction": 1.0},
        "runtime.weight_cache_wiggle_fraction",
        "must be in [0, 1) (got 1.0)",
    ),
    (
        {"runtime.shared_host_weights_mode": 0o1777},
        "runtime.shared_host_weights_mode",
        "must be in 0..0o777 (got 1023)",
    ),
    (
        {"runtime.cpu_device_memory_bytes": -1},
        "runtime.cpu_device_memory_bytes",
        "must be >= 0 (0 = none) (got -1)",
    ),
    (
        {"runtime.numerics": NumericsMode.TF32},
        "runtime.numerics",
        "'tf32' requires a CUDA backend; the CPU backend cannot run TF32",
    ),
    (
        {"endpoints.client_shared_memory_prefixes": ("ok-", "/")},
        "endpoints.client_shared_memory_prefixes",
        "entry '/' is empty (leave the list empty to allow every key)",
    ),
    (
        {"endpoints.client_shared_memory_prefixes": ("a/b",)},
        "endpoints.client_shared_memory_prefixes",
        "entry 'a/b' may contain '/' only as its first character",
    ),
    (
        {"endpoints.client_shared_memory_prefixes": ("/kst-w-",)},
        "endpoints.client_shared_memory_prefixes",
        "entry '/kst-w-' starts with 'kst-': keys starting with 'kst-' name the server's own "
        "shared memory (its node's shared host weights and their lock files) and are never "
        "registered",
    ),
    (
        {
            "endpoints.client_shared_memory": False,
            "endpoints.client_shared_memory_prefixes": ("triton_",),
        },
        "endpoints.client_shared_memory_prefixes",
        "has no effect with endpoints.client_shared_memory: false (clients register nothing); "
        "remove it or turn client shared memory on",
    ),
]


@pytest.mark.parametrize(
    ("changes", "path", "message"),
    VALIDATION_CASES,
    ids=[c[1] + ":" + str(i) for i, c in enumerate(VALIDATION_CASES)],
)
def test_every_validation_rule(changes, path, message):
    cfg = _with(**changes)
    with raises(path, message):
        validate_config(cfg, check_dirs=False)


def test_validation_accepts_the_boundaries():
    ok = [
        {"endpoints.port": 0},
        {"endpoints.port": 65535, "endpoints.metrics_port": 65534},
        {"endpoints.metrics_port": 0, "endpoints.port": 0},
        {"endpoints.max_concurrent_requests": 0},
        {"scheduler.recency_penalty_cap": 1.0, "scheduler.cost_ema_alpha": 1.0},
        {"scheduler.coalescing_discount": 0.0, "scheduler.dispatch_timeout_seconds": 0.0},
        {"runtime.mem_fraction": 1.0, "runtime.weight_cache_fraction": 0.0},
        {"runtime.weight_cache_fraction": 1.0, "runtime.weight_cache_wiggle_fraction": 0.0},
        {"model_control_mode": ModelControlMode.STATIC, "model_poll_seconds": 0.0},
        {"runtime.numerics": NumericsMode.TF32, "runtime.backend": "cuda"},
        {"scheduler.models": {"m": ModelSchedConfig(weight=0.01, max_batch_size=1)}},
        {"endpoints.client_shared_memory": False},
        {"endpoints.client_shared_memory_prefixes": ("/triton_", "k", "kst")},
    ]
    for changes in ok:
        validate_config(_with(**changes), check_dirs=False)


def test_model_dirs_must_exist_unless_told_not_to_check(tmp_path):
    cfg = ServerConfig(model_dirs=(str(tmp_path), str(tmp_path / "missing")))
    with raises("model_dirs", f"model directory does not exist: {tmp_path / 'missing'}"):
        validate_config(cfg)
    validate_config(cfg, check_dirs=False)
    validate_config(ServerConfig(model_dirs=(str(tmp_path),)))


class _RecordingLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def test_log_config_reports_the_effective_config_and_the_env_overrides():
    cfg, applied = load_server_config(
        env={"INFERENCE_SERVER_ENDPOINTS_PORT": "9005"}, worker="w", check_dirs=False
    )
    log = _RecordingLog()
    log_config(cfg, applied, log)
    assert log.events == [
        ("config_effective", {"worker": "w", "config": config_to_raw(cfg)}),
        (
            "config_overridden_by_environment",
            {"worker": "w", "overrides": ["INFERENCE_SERVER_ENDPOINTS_PORT=9005"]},
        ),
    ]
    quiet = _RecordingLog()
    log_config(ServerConfig(), [], quiet)
    assert [event for event, _ in quiet.events] == ["config_effective"]


# --- endpoints.tls ----------------------------------------------------------------------------


def _tls_files(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("cert_file", "key_file", "client_ca_file"):
        path = tmp_path / f"{name}.pem"
        path.write_text("-----BEGIN CERTIFICATE-----\n")
        files[name] = str(path)
    return files


def test_tls_is_off_by_default():
    tls = ServerConfig().endpoints.tls
    assert tls == TlsConfig("", "", "")
    assert not tls.enabled and not tls.mutual


def test_tls_block_is_read_from_yaml(tmp_path):
    files = _tls_files(tmp_path)
    cfg = build_config(
        yaml_raw(
            f"""
            endpoints:
              port: 0
              tls:
                cert_file: {files["cert_file"]}
                key_file: {files["key_file"]}
                client_ca_file: {files["client_ca_file"]}
            """
        )
    )
    assert cfg.endpoints.tls == TlsConfig(
        files["cert_file"], files["key_file"], files["client_ca_file"]
    )
    assert cfg.endpoints.tls.enabled and cfg.endpoints.tls.mutual
    validate_config(dataclasses.replace(cfg, model_dirs=(str(tmp_path),)))
    assert build_config(yaml_raw("endpoints:\n  tls:\n")).endpoints.tls == TlsConfig()


def test_tls_values_are_type_checked():
    with raises(
        "endpoints.tls.cert_file", "config 'endpoints.tls.cert_file' must be a string (got 5)"
    ):
        build_config({"endpoints": {"tls": {"cert_file": 5}}})
    with raises("endpoints.tls", "config 'endpoints.tls' must be a mapping"):
        build_config({"endpoints": {"tls": "on"}})


@pytest.mark.parametrize(
    ("var", "field"),
    [
        ("INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE", "cert_file"),
        ("INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE", "key_file"),
        ("INFERENCE_SERVER_ENDPOINTS_TLS_CLIENT_CA_FILE", "client_ca_file"),
    ],
)
def test_tls_env_overrides_set_their_field(var, field):
    assert ENV_OVERRIDES[var] == f"endpoints.tls.{field}"
    raw, applied = apply_env_overrides({"endpoints": {"port": 1}}, {var: "/etc/x.pem"})
    assert applied == [(var, "/etc/x.pem")]
    assert getattr(build_config(raw).endpoints.tls, field) == "/etc/x.pem"
    assert build_config(raw).endpoints.port == 1


def test_tls_env_overrides_load_end_to_end(tmp_path):
    files = _tls_files(tmp_path)
    env = {
        "INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE": files["cert_file"],
        "INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE": files["key_file"],
    }
    cfg, applied = load_server_config(env=env, overrides={"model_dirs": [str(tmp_path)]})
    assert cfg.endpoints.tls == TlsConfig(files["cert_file"], files["key_file"], "")
    assert sorted(applied) == sorted(env.items())


@pytest.mark.parametrize(
    ("tls", "path", "message"),
    [
        (
            {"cert_file": "c"},
            "endpoints.tls.key_file",
            "must be set together with cert_file",
        ),
        (
            {"key_file": "k"},
            "endpoints.tls.cert_file",
            "must be set together with key_file",
        ),
        (
            {"client_ca_file": "ca"},
            "endpoints.tls.client_ca_file",
            "requires cert_file and key_file (mutual TLS is TLS plus client certificates)",
        ),
    ],
)
def test_tls_validation_rules(tls, path, message):
    cfg = _with(**{"endpoints.tls": TlsConfig(**tls)})
    with raises(path, message):
        validate_config(cfg, check_dirs=False)


@pytest.mark.parametrize("missing", ["cert_file", "key_file", "client_ca_file"])
def test_tls_files_must_exist(tmp_path, missing):
    files = _tls_files(tmp_path)
    files[missing] = str(tmp_path / "absent.pem")
    cfg = _with(**{"endpoints.tls": TlsConfig(**files), "model_dirs": (str(tmp_path),)})
    with raises(f"endpoints.tls.{missing}", f"file does not exist: {tmp_path / 'absent.pem'}"):
        validate_config(cfg)
    validate_config(cfg, check_dirs=False)  # checked away from the serving host: not looked up


def test_tls_round_trips_through_config_to_raw(tmp_path):
    cfg = _with(**{"endpoints.tls": TlsConfig("/c.pem", "/k.pem", "/ca.pem")})
    raw = config_to_raw(cfg)
    assert raw["endpoints"]["tls"] == {
        "cert_file": "/c.pem",
        "key_file": "/k.pem",
        "client_ca_file": "/ca.pem",
    }
    assert build_config(raw) == cfg


def test_the_config_package_states_its_public_surface_once():
    import kserve_trio.core.process.config as config

    assert sorted(config.__all__) == sorted(
        [
            "BATCH_POLICY_REMOVED",
            "DEFAULT_GRPC_MSG_BYTES",
            "ENV_OVERRIDES",
            "ENV_PREFIX",
            "RESIDENCY_MODE_REMOVED",
            "SCHEMA",
            "WORKER_NAME_ENV",
            "EdgeLimits",
            "LIMIT_FIELDS",
            "LIVENESS_INTERVAL_SECONDS",
            "LIVENESS_MISSES",
            "MAX_FRAME_BYTES",
            "WINDOW_BYTES",
            "limits_env_rows",
            "validate_limits",
            "TracingConfig",
            "TRACE_LEVELS",
            "TRACING_FIELDS",
            "TRACING_READERS",
            "add_tracing_flags",
            "tracing_env_rows",
            "tracing_overrides",
            "tracing_to_raw",
            "validate_tracing",
            "EndpointsConfig",
            "FrozenMap",
            "GrpcConfig",
            "MetaConfig",
            "ModelControlMode",
            "ModelSchedConfig",
            "NumericsMode",
            "ResidencyMode",
            "ResidencyState",
            "RuntimeConfig",
            "SchedulerConfig",
            "SchedulingDiscipline",
            "ServerConfig",
            "TlsConfig",
            "apply_env_overrides",
            "apply_env_table",
            "as_bool",
            "as_float",
            "as_int",
            "as_str",
            "as_str_list",
            "build_config",
            "check_keys",
            "config_to_raw",
            "deep_merge",
            "load_yaml_mapping",
            "merge_given",
            "log_config",
            "parse_enum",
            "parse_env_bool",
            "parse_env_value",
            "read_block",
            "set_path",
            "unknown_env_override",
            "validate_config",
            "validate_shm_policy",
            "validate_tls",
        ]
    )
    for name in config.__all__:
        assert getattr(config, name) is not None


def test_the_config_package_sits_below_the_node_file_layer():
    """The node file builds on the config package, never the other way round: nothing the config
    package's modules import, directly or through other modules, is ``core.process.node``. (The
    process domain's face loads both, so the import graph says it, not ``sys.modules``.)"""
    graph = import_graph()
    config = "kserve_trio.core.process.config"
    seen: set[str] = set()
    todo = [m for m in graph if m == config or m.startswith(config + ".")]
    assert len(todo) > 3
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    assert "kserve_trio.core.memory.shm_names" in seen  # the walk follows imports
    assert "kserve_trio.core.process.node" not in seen


@pytest.mark.parametrize(
    ("block", "path"),
    [
        ({"level": "tensors"}, "tracing.level"),
        ({"rate": 0}, "tracing.rate"),
        ({"count": -2}, "tracing.count"),
        ({"resource": ["a=b"]}, "tracing.resource"),
        ({"max_queue_size": 0}, "tracing.max_queue_size"),
        ({"max_queue_size": 8, "max_export_batch_size": 9}, "tracing.max_export_batch_size"),
        ({"schedule_delay_seconds": 0}, "tracing.schedule_delay_seconds"),
        ({"endpoint": "otel:4318"}, "tracing.endpoint"),
    ],
)
def test_a_tracing_value_out_of_range_names_its_key(block, path):
    with pytest.raises(ConfigError) as info:
        validate_config(build_config({"tracing": block}), check_dirs=False)
    assert info.value.path == path


def test_tracing_is_off_unless_configured_and_yaml_off_reads_as_off():
    assert ServerConfig().tracing.on is False
    assert build_config({"tracing": {"level": "timestamps"}}).tracing.on is True
    assert build_config({"tracing": {"level": False}}).tracing.level == "off"  # YAML `off`
    cfg = build_config({"tracing": {"resource": {"k8s.pod.name": "w-0", "replica": 2}}})
    assert dict(cfg.tracing.resource) == {"k8s.pod.name": "w-0", "replica": "2"}


def test_the_worker_cli_names_the_tracing_flags_and_maps_them_to_the_block():
    import argparse

    from kserve_trio.worker.cli import configure_parser, overrides_from_args

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    text = parser.format_help()
    for flag in ("--trace-level", "--trace-rate", "--trace-count", "--trace-endpoint"):
        assert flag in text
    assert "INFERENCE_SERVER_TRACING_RATE" in text
    args = parser.parse_args(
        ["--trace-level", "timestamps", "--trace-rate", "7", "--trace-endpoint", "http://c/v1"]
    )
    assert overrides_from_args(args)["tracing"] == {
        "level": "timestamps",
        "rate": 7,
        "endpoint": "http://c/v1",
    }
    assert "tracing" not in overrides_from_args(parser.parse_args([]))
