"""gateway.yml: schema, environment overrides, validation, loading, the example file, logging."""

from __future__ import annotations

import contextlib
import io
import json
import math
import pathlib
import re

import pytest
from ruamel.yaml import YAML

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config import (
    DEFAULT_GRPC_MSG_BYTES,
    LIMIT_FIELDS,
    EdgeLimits,
    TlsConfig,
)
from kserve_trio.gateway.config import (
    ENV_OVERRIDES,
    FILE_ENV,
    LPT_SCHEDULING_KEYS,
    NO_ENDPOINTS,
    PROBER_ENV,
    CompactionMode,
    FillMode,
    FillPolicy,
    GatewayConfig,
    GatewayGrpcConfig,
    ListenConfig,
    LoggingConfig,
    ProberConfig,
    SchedulingConfig,
    SchedulingMode,
    WorkBasis,
    WorkerClientConfig,
    WorkerTlsConfig,
    apply_gateway_env,
    build_gateway_config,
    config_warnings,
    configure_gateway_logging,
    gateway_config_to_raw,
    load_gateway_config,
    log_gateway_config,
    prober_from_env,
    schema_paths,
    validate_gateway_config,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "gateway.example.yaml"
W = "KSERVE_TRIO_GATEWAY_"
ONE = {W + "WORKERS": "127.0.0.1:9001"}


@contextlib.contextmanager
def raises(path: str, message: str):
    """A ConfigError at YAML path ``path`` whose message matches the regex ``message``."""
    with pytest.raises(ConfigError) as info:
        yield info
    assert info.value.path == path, str(info.value)
    assert re.search(message, info.value.message), info.value.message


def load(raw: dict | None = None, env: dict | None = None, **kw) -> GatewayConfig:
    """Build and validate from a raw dict plus environment (no file)."""
    merged, _ = apply_gateway_env(raw or {}, env if env is not None else {})
    prober, _ = prober_from_env(env or {})
    cfg = build_gateway_config(merged, prober)
    validate_gateway_config(cfg, **kw)
    return cfg


def ok(**raw) -> GatewayConfig:
    return load({"endpoints": ["127.0.0.1:9001"], **raw})


# --------------------------------------------------------------------------------------------
# defaults and loading


def test_environment_only_config_takes_the_defaults():
    loaded = load_gateway_config(env=ONE)
    cfg = loaded.config
    assert loaded.source is None
    assert cfg.endpoints == ("127.0.0.1:9001",)
    assert cfg.listen == ListenConfig("0.0.0.0:8001", "0.0.0.0:8002")
    assert cfg.listen.grpc_address == ("0.0.0.0", 8001)
    assert cfg.scheduling == SchedulingConfig(SchedulingMode.ROUND_ROBIN, None)
    assert cfg.scheduling.basis is WorkBasis.COMPUTE
    assert cfg.worker_client == WorkerClientConfig(60.0, 32, WorkerTlsConfig())
    assert not cfg.worker_client.tls.enabled
    assert cfg.grpc == GatewayGrpcConfig(DEFAULT_GRPC_MSG_BYTES, DEFAULT_GRPC_MSG_BYTES, 64)
    assert cfg.tls == TlsConfig() and not cfg.tls.enabled
    assert cfg.logging == LoggingConfig("info", "auto")
    assert cfg.prober == ProberConfig(0.0, 10.0, 3)
    assert loaded.applied == ((W + "WORKERS", "127.0.0.1:9001"),)
    assert loaded.warnings == ()


def test_no_endpoints_anywhere_says_where_to_set_them():
    with raises("endpoints", "^" + re.escape(NO_ENDPOINTS) + "$"):
        load_gateway_config(env={})
    assert "KSERVE_TRIO_GATEWAY_WORKERS" in NO_ENDPOINTS


def test_the_file_comes_from_the_argument_then_the_environment(tmp_path):
    a, b = tmp_path / "a.yml", tmp_path / "b.yml"
    a.write_text("endpoints: ['10.0.0.1:1']\n")
    b.write_text("endpoints: ['10.0.0.2:2']\n")
    by_env = load_gateway_config(env={FILE_ENV: str(b)})
    assert by_env.source == str(b) and by_env.config.endpoints == ("10.0.0.2:2",)
    by_arg = load_gateway_config(a, env={FILE_ENV: str(b)})
    assert by_arg.source == str(a) and by_arg.config.endpoints == ("10.0.0.1:1",)


def test_a_named_file_that_does_not_exist_is_an_error(tmp_path):
    missing = tmp_path / "nope.yml"
    with raises("", f"^gateway config file not found: {re.escape(str(missing))}$"):
        load_gateway_config(missing, env=ONE)
    with raises("", "^gateway config file not found"):
        load_gateway_config(env={**ONE, FILE_ENV: str(missing)})


def test_bad_yaml_and_a_non_mapping_root_are_errors(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("endpoints: [unclosed\n")
    with raises("", "is not valid YAML"):
        load_gateway_config(bad, env={})
    listy = tmp_path / "list.yml"
    listy.write_text("- a\n")
    with raises("", r"^gateway config root must be a mapping \(file "):
        load_gateway_config(listy, env={})


def test_precedence_is_defaults_file_environment_flags(tmp_path):
    f = tmp_path / "g.yml"
    f.write_text(
        "endpoints: ['10.0.0.1:1']\nlogging: {level: warning, format: console}\n"
        "listen: {grpc: '127.0.0.1:7001'}\n"
    )
    env = {W + "LOGGING_LEVEL": "error", W + "LISTEN_METRICS": "127.0.0.1:7002"}
    cfg = load_gateway_config(f, env=env, overrides={"logging": {"level": "debug", "format": None}})
    assert cfg.config.logging == LoggingConfig("debug", "console")  # flag > env > file
    assert cfg.config.listen == ListenConfig("127.0.0.1:7001", "127.0.0.1:7002")
    assert load_gateway_config(f, env=env).config.logging.level == "error"


def test_file_key_errors_are_reported_before_the_environment_is_merged(tmp_path):
    f = tmp_path / "g.yml"
    f.write_text("endpoints: ['10.0.0.1:1']\nlisten: {grcp: '1.2.3.4:5'}\n")
    with raises("listen.grcp", "unknown key; did you mean 'grpc'"):
        load_gateway_config(f, env=ONE)


# --------------------------------------------------------------------------------------------
# keys


def test_every_key_of_the_schema_is_a_leaf_the_builder_reads():
    raw = {
        "listen": {"grpc": "127.0.0.1:0", "metrics": "127.0.0.1:0"},
        "endpoints": ["a.test:1", "b.test:2"],
        "worker_metrics": ["a.test:11", "b.test:12"],
        "worker_names": ["a", "b"],
        "scheduling": {"mode": "LEAST_OUTSTANDING", "work_basis": " Items "},
        "worker_client": {
            "request_timeout_seconds": 5,
            "max_concurrent_streams": 4,
            "tls": {"ca_file": "ca", "cert_file": "c", "key_file": "k"},
        },
        "grpc": {
            "max_recv_msg_bytes": 10,
            "max_send_msg_bytes": 11,
            "max_concurrent_requests_per_worker": 0,
        },
        "tls": {"cert_file": "sc", "key_file": "sk", "client_ca_file": "ca"},
        "logging": {"level": "DEBUG", "format": "json"},
    }
    cfg = load(raw, check_files=False)
    assert cfg.scheduling == SchedulingConfig(SchedulingMode.LEAST_OUTSTANDING, WorkBasis.ITEMS)
    assert cfg.worker_client == WorkerClientConfig(5.0, 4, WorkerTlsConfig("ca", "c", "k"))
    assert cfg.grpc == GatewayGrpcConfig(10, 11, 0)
    assert cfg.tls == TlsConfig("sc", "sk", "ca")
    assert cfg.worker_names == ("a", "b") and cfg.worker_metrics == ("a.test:11", "b.test:12")
    assert gateway_config_to_raw(cfg)["scheduling"] == {
        "mode": "least_outstanding",
        "work_basis": "items",
    }
    assert build_gateway_config(gateway_config_to_raw(cfg)) == cfg  # the inverse


def test_to_raw_round_trips_the_defaults_and_leaves_work_basis_unset():
    cfg = ok()
    raw = gateway_config_to_raw(cfg)
    assert "work_basis" not in raw["scheduling"]
    assert build_gateway_config(raw) == cfg
    flat = set()

    def walk(d, prefix=""):
        for k, v in d.items():
            p = f"{prefix}.{k}" if prefix else k
            walk(v, p) if isinstance(v, dict) and v else flat.add(p)  # {}: a leaf's default

    walk(raw)
    lpt = {
        p for p in schema_paths() if p.split(".")[1:2] and p.split(".")[1] in LPT_SCHEDULING_KEYS
    }
    assert flat == set(schema_paths()) - {"scheduling.work_basis"} - lpt


def test_unknown_keys_name_their_path_and_suggest():
    with raises("worker_client.max_concurrent_stream", "did you mean 'max_concurrent_streams'"):
        ok(worker_client={"max_concurrent_stream": 3})
    with raises("endpoint", "unknown key; did you mean 'endpoints'"):
        load({"endpoint": ["a:1"]})


def test_metrics_endpoints_is_reported_as_renamed():
    with raises("metrics_endpoints", "renamed to 'worker_metrics'"):
        ok(metrics_endpoints=["a:1"])


@pytest.mark.parametrize("key", LPT_SCHEDULING_KEYS[:-1])
def test_lpt_packing_keys_are_rejected_under_the_other_modes(key):
    value = {"routing_policy": "fill_rr", "routing_fill_mode": "spread"}.get(key, 1)
    value = {"compaction_mode": "off", "forbid_memory_oversubscription": False}.get(key, value)
    value = {"default_replicas": 2, "compaction_interval": 2}.get(key, value)
    value = 0.5 if key in ("max_worker_share", "hysteresis") else value
    with raises(f"scheduling.{key}", r"configures scheduling mode lpt_packing .mode is 'round"):
        ok(scheduling={key: value})
    assert ok(scheduling={"mode": "lpt_packing", key: value}).scheduling.mode is (
        SchedulingMode.LPT_PACKING
    )


def test_enums_are_case_insensitive_and_checked():
    assert ok(scheduling={"mode": " Round_Robin"}).scheduling.mode is SchedulingMode.ROUND_ROBIN
    with raises("scheduling.mode", r"must be one of 'round_robin', 'least_outstanding'"):
        ok(scheduling={"mode": "random"})
    with raises("scheduling.work_basis", r"must be one of 'compute', 'items', 'requests'"):
        ok(scheduling={"mode": "least_outstanding", "work_basis": "bytes"})


def test_work_basis_is_only_accepted_where_it_means_something():
    with raises("scheduling.work_basis", "least_outstanding and lpt_packing only .mode is 'round"):
        ok(scheduling={"work_basis": "items"})
    cfg = ok(scheduling={"mode": "least_outstanding"})
    assert cfg.scheduling.work_basis is None and cfg.scheduling.basis is WorkBasis.COMPUTE


@pytest.mark.parametrize(
    ("raw", "path", "message"),
    [
        ({"endpoints": "a:1"}, "endpoints", "must be a list"),
        ({"endpoints": ["a:1", 5]}, "endpoints[1]", "must be a string"),
        ({"listen": "x"}, "listen", "must be a mapping"),
        ({"listen": {"grpc": 8001}}, "listen.grpc", "must be a string"),
        ({"worker_client": {"max_concurrent_streams": 1.5}}, "worker_client.max_concurrent_streams", "must be an integer"),
        ({"worker_client": {"request_timeout_seconds": "9"}}, "worker_client.request_timeout_seconds", "must be a number"),
        ({"grpc": {"max_recv_msg_bytes": True}}, "grpc.max_recv_msg_bytes", "must be an integer"),
        ({"tls": {"cert_file": 1}}, "tls.cert_file", "must be a string"),
        ({"worker_client": {"tls": {"ca_file": []}}}, "worker_client.tls.ca_file", "must be a string"),
        ({"logging": {"level": 10}}, "logging.level", "must be a string"),
        ({"scheduling": {"mode": 1}}, "scheduling.mode", "must be a string"),
    ],
)  # fmt: skip
def test_values_are_type_checked(raw, path, message):
    with raises(path, message):
        load({"endpoints": ["a:1"], **raw})


# --------------------------------------------------------------------------------------------
# addresses and lists


def test_endpoints_are_stripped_and_repeats_dropped_in_order():
    cfg = load({"endpoints": [" b.test:2", "a.test:1 ", "B.TEST:2", "a.test:1"]})
    assert cfg.endpoints == ("b.test:2", "a.test:1")


def test_a_repeated_endpoint_is_ambiguous_with_aligned_lists():
    with raises("endpoints[2]", r"repeats endpoints\[0\] \('a:1'\)"):
        load({"endpoints": ["a:1", "b:1", "a:1"], "worker_names": ["x", "y", "z"]})
    with raises("endpoints[1]", r"repeats endpoints\[0\]"):
        validate_gateway_config(GatewayConfig(endpoints=("a:1", "a:1")))  # code-built


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("a", "expected 'host:port'"),
        ("a:", "port must be a decimal number"),
        (":80", "expected 'host:port'"),
        ("a:0", r"port must be in 1\.\.65535, got 0"),
        ("a:70000", r"port must be in 1\.\.65535"),
        ("grpc://a:1", "without a scheme"),
        ("::1:80", "must be in brackets"),
        ("[zz]:80", "is not an IPv6 address"),
        ("a b:1", "is not a host name"),
        ("a:\uff11", "decimal"),  # a fullwidth digit
    ],
)
def test_bad_endpoints_name_their_index(entry, message):
    with raises("endpoints[1]", message):
        load({"endpoints": ["ok.test:1", entry]})


def test_ipv6_and_ephemeral_listen_ports_are_accepted():
    cfg = load({"endpoints": ["[::1]:9001"], "listen": {"grpc": "[::]:0", "metrics": "[::]:0"}})
    assert cfg.listen.grpc_address == ("::", 0)
    with raises("listen.metrics", r"must differ from listen.grpc"):
        ok(listen={"grpc": "0.0.0.0:8001", "metrics": "0.0.0.0:8001"})
    with raises("listen.grpc", "expected 'host:port'"):
        ok(listen={"grpc": "8001"})


def test_aligned_lists_need_one_entry_per_endpoint():
    with raises("worker_names", r"one entry per endpoints entry, index-aligned \(got 1 for 2"):
        load({"endpoints": ["a:1", "b:1"], "worker_names": ["x"]})
    with raises("worker_metrics", r"\(got 3 for 2 endpoints\)"):
        load({"endpoints": ["a:1", "b:1"], "worker_metrics": ["a:2", "b:2", "c:2"]})
    with raises("worker_metrics[1]", "expected 'host:port'"):
        load({"endpoints": ["a:1", "b:1"], "worker_metrics": ["a:2", "nope"]})


def test_worker_names_are_unique_words():
    with raises("worker_names[1]", r"repeats worker_names\[0\] \('x'\)"):
        load({"endpoints": ["a:1", "b:1"], "worker_names": ["x", "x"]})
    with raises("worker_names[0]", "non-empty name without whitespace"):
        load({"endpoints": ["a:1"], "worker_names": ["gpu 0"]})


# --------------------------------------------------------------------------------------------
# ranges


@pytest.mark.parametrize(
    ("raw", "path", "message"),
    [
        ({"worker_client": {"request_timeout_seconds": 0}}, "worker_client.request_timeout_seconds", r"positive number of seconds \(got 0"),
        ({"worker_client": {"request_timeout_seconds": float("nan")}}, "worker_client.request_timeout_seconds", "positive"),
        ({"worker_client": {"request_timeout_seconds": float("inf")}}, "worker_client.request_timeout_seconds", "positive"),
        ({"worker_client": {"max_concurrent_streams": 0}}, "worker_client.max_concurrent_streams", r"must be positive \(got 0\)"),
        ({"grpc": {"max_recv_msg_bytes": 0}}, "grpc.max_recv_msg_bytes", "must be positive"),
        ({"grpc": {"max_send_msg_bytes": -1}}, "grpc.max_send_msg_bytes", r"must be positive \(got -1\)"),
        ({"grpc": {"max_concurrent_requests_per_worker": -1}}, "grpc.max_concurrent_requests_per_worker", r">= 0 \(0 = uncapped\)"),
        ({"grpc": {"max_queued_requests_per_worker": -1}}, "grpc.max_queued_requests_per_worker", r">= 0 \(0 = no queue"),
        ({"logging": {"level": "loud"}}, "logging.level", "must be one of debug, info"),
        ({"logging": {"format": "xml"}}, "logging.format", "must be one of auto, json, console"),
    ],
)  # fmt: skip
def test_ranges_are_checked(raw, path, message):
    with raises(path, message):
        ok(**raw)


def test_the_admission_cap_not_above_the_stream_bound_warns():
    assert config_warnings(ok()) == []
    cfg = ok(grpc={"max_concurrent_requests_per_worker": 32})
    (warning,) = config_warnings(cfg)
    assert "max_concurrent_requests_per_worker (32) is not above" in warning
    assert config_warnings(ok(grpc={"max_concurrent_requests_per_worker": 0})) == []  # uncapped


# --------------------------------------------------------------------------------------------
# TLS blocks


def test_public_tls_block_rules_name_the_gateway_paths(tmp_path):
    with raises("tls.key_file", "must be set together with cert_file"):
        ok(tls={"cert_file": "c"})
    with raises("tls.client_ca_file", "requires cert_file and key_file"):
        ok(tls={"client_ca_file": "ca"})
    with raises("tls.cert_file", "file does not exist: "):
        ok(tls={"cert_file": str(tmp_path / "c"), "key_file": str(tmp_path / "k")})


def test_worker_tls_block_rules(tmp_path):
    with raises("worker_client.tls.cert_file", "must be set together with key_file"):
        ok(worker_client={"tls": {"key_file": "k"}})
    with raises("worker_client.tls.ca_file", "file does not exist"):
        ok(worker_client={"tls": {"ca_file": str(tmp_path / "ca.pem")}})
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert ok(worker_client={"tls": {"ca_file": str(ca)}}).worker_client.tls.enabled


# --------------------------------------------------------------------------------------------
# environment


def _typed_sample(path: str) -> tuple[str, object]:
    """A valid environment text for ``path`` and the value it must produce."""
    samples = {
        "listen.grpc": ("127.0.0.1:7001", "127.0.0.1:7001"),
        "listen.metrics": ("127.0.0.1:7002", "127.0.0.1:7002"),
        "listen.http": ("127.0.0.1:7000", "127.0.0.1:7000"),
        "endpoints": (" a.test:1, b.test:2,, ", ("a.test:1", "b.test:2")),
        "worker_metrics": ("a.test:11,b.test:12", ("a.test:11", "b.test:12")),
        "worker_names": ("x, y", ("x", "y")),
        "worker_http_endpoints": ("a.test:21, b.test:22", ("a.test:21", "b.test:22")),
        "scheduling.mode": ("least_outstanding", SchedulingMode.LEAST_OUTSTANDING),
        "scheduling.work_basis": ("requests", WorkBasis.REQUESTS),
        "scheduling.rebalance_compute_seconds": ("120", 120.0),
        "scheduling.first_rebalance_compute_seconds": ("0", 0.0),
        "scheduling.max_worker_share": ("0.5", 0.5),
        "scheduling.hysteresis": ("0.1", 0.1),
        "scheduling.ema_halflife_compute_seconds": ("30", 30.0),
        "scheduling.forbid_memory_oversubscription": ("false", False),
        "scheduling.default_replicas": ("All", -1),
        "scheduling.routing_fill_factor": ("2", 2.0),
        "scheduling.routing_policy": ("FILL_RR", FillPolicy.FILL_RR),
        "scheduling.routing_fill_mode": ("spread", FillMode.SPREAD),
        "scheduling.compaction_mode": ("scheduled", CompactionMode.SCHEDULED),
        "scheduling.compaction_interval": ("3", 3),
        "worker_client.request_timeout_seconds": ("2.5", 2.5),
        "worker_client.max_concurrent_streams": ("7", 7),
        "grpc.max_recv_msg_bytes": ("1000", 1000),
        "grpc.max_send_msg_bytes": ("2000", 2000),
        "grpc.max_concurrent_requests_per_worker": ("9", 9),
        "grpc.max_queued_requests_per_worker": ("5", 5),
        "logging.level": ("warning", "warning"),
        "logging.format": ("json", "json"),
        "event_loop": ("trio", "trio"),
        "http2_engine": ("h2", "h2"),
        "processes": ("2", 2),
        "process_liveness_interval_seconds": ("0.25", 0.25),
        "process_liveness_misses": ("5", 5),
        "worker_client.headers": ("admin-key=s; ops=t", ("admin-key=s", "ops=t")),
        "restricted_protocols": (
            "model-repository,logging:admin-key=s; control:ops=t",
            ("model-repository,logging:admin-key=s", "control:ops=t"),
        ),
        "client_shared_memory": ("no", False),
        "tracing.level": ("timestamps", "timestamps"),
        "tracing.endpoint": ("https://otel.test/v1/traces", "https://otel.test/v1/traces"),
        "tracing.service_name": ("gw", "gw"),
        "tracing.rate": ("4", 4),
        "tracing.count": ("9", 9),
        "tracing.resource": ("team=ml", {"team": "ml"}),
        "tracing.max_queue_size": ("600", 600),
        "tracing.max_export_batch_size": ("8", 8),
        "tracing.schedule_delay_seconds": ("0.25", 0.25),
        "tracing.export_timeout_seconds": ("3", 3.0),
        "client_shared_memory_prefixes": ("triton_, /app-", ("triton_", "/app-")),
        **{
            f"limits.{f.name}": (
                str(2 * getattr(EdgeLimits(), f.name)),
                2 * getattr(EdgeLimits(), f.name),
            )
            for f in LIMIT_FIELDS
        },
    }
    return samples.get(path, ("/some/file.pem", "/some/file.pem"))


def _get(cfg: GatewayConfig, path: str):
    value = cfg
    for key in path.split("."):
        value = getattr(value, key)
    return value


def test_every_yaml_key_has_an_environment_override():
    per_model = {p for p in schema_paths() if p.startswith("scheduling.models.")}
    assert sorted(ENV_OVERRIDES.values()) == sorted(set(schema_paths()) - per_model)
    for var, path in ENV_OVERRIDES.items():
        assert var.startswith(W)
        if path not in ("endpoints", "worker_metrics", "worker_names"):
            assert var == W + path.replace(".", "_").upper()


@pytest.mark.parametrize("var", sorted(ENV_OVERRIDES))
def test_each_environment_override_sets_its_key(var):
    path = ENV_OVERRIDES[var]
    text, expected = _typed_sample(path)
    env = {var: text}
    if path != "endpoints":
        env[W + "WORKERS"] = "a.test:1,b.test:2"
    if path == "scheduling.work_basis":
        env[W + "SCHEDULING_MODE"] = "least_outstanding"
    if path.split(".")[-1] in LPT_SCHEDULING_KEYS:
        env[W + "SCHEDULING_MODE"] = "lpt_packing"
    if path.startswith(("tls.", "worker_client.tls.")):  # a TLS block is set as a whole
        block = path.rsplit(".", 1)[0]
        for other, other_path in ENV_OVERRIDES.items():
            if other_path.rsplit(".", 1)[0] == block:
                env.setdefault(other, "/other/file.pem")
    raw, applied = apply_gateway_env({"endpoints": ["z.test:9"]}, env)
    assert (var, text) in applied
    cfg = build_gateway_config(raw)
    validate_gateway_config(cfg, check_files=False)
    assert _get(cfg, path) == expected


def test_list_overrides_replace_the_yaml_list_and_the_input_is_not_modified():
    raw = {"endpoints": ["a:1", "b:1"], "listen": {"grpc": "1.2.3.4:1"}}
    out, applied = apply_gateway_env(raw, {W + "WORKERS": "c:1"})
    assert out["endpoints"] == ["c:1"] and applied == [(W + "WORKERS", "c:1")]
    assert raw == {"endpoints": ["a:1", "b:1"], "listen": {"grpc": "1.2.3.4:1"}}


def test_malformed_numbers_in_the_environment_name_the_variable():
    with raises(
        "worker_client.max_concurrent_streams",
        "KSERVE_TRIO_GATEWAY_WORKER_CLIENT_MAX_CONCURRENT_STREAMS has invalid integer value 'x'",
    ):
        load(env={**ONE, W + "WORKER_CLIENT_MAX_CONCURRENT_STREAMS": "x"})
    with raises("worker_client.request_timeout_seconds", "invalid number value"):
        load(env={**ONE, W + "WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS": "soon"})  # fmt: skip


def test_unknown_gateway_variables_fail_with_a_hint_and_others_are_ignored():
    with raises("", r"^unknown environment override KSERVE_TRIO_GATEWAY_WORKER; did you mean"):
        load(env={**ONE, W + "WORKER": "a:1"})
    cfg = load(env={**ONE, "PATH": "/bin", "KSERVE_TRIO_CLIENT_TRANSPORT": "h2", FILE_ENV: ""})
    assert cfg.endpoints == ("127.0.0.1:9001",)


@pytest.mark.parametrize(
    ("text", "expected"), [("0", 0.0), ("2.5", 2.5), ("inf", math.inf), (" Forever ", math.inf), ("-1", math.inf)]
)  # fmt: skip
def test_startup_wait_takes_seconds_or_forever(text, expected):
    cfg = load(env={**ONE, W + "STARTUP_WAIT_SECONDS": text})
    assert cfg.prober.startup_wait_seconds == expected


def test_prober_knobs_from_the_environment_and_their_ranges():
    env = {**ONE, W + "HEALTH_INTERVAL_SECONDS": "0.5", W + "WEDGE_EXIT_ROUNDS": "0"}
    loaded = load_gateway_config(env=env)
    assert loaded.config.prober == ProberConfig(0.0, 0.5, 0)
    assert (W + "WEDGE_EXIT_ROUNDS", "0") in loaded.applied
    cases = [
        ("STARTUP_WAIT_SECONDS", "-2", "must be >= 0 seconds, or inf/forever/-1"),
        ("STARTUP_WAIT_SECONDS", "nan", "must be >= 0 seconds"),
        ("HEALTH_INTERVAL_SECONDS", "0", "must be a positive number of seconds"),
        ("WEDGE_EXIT_ROUNDS", "-1", r"must be >= 0 \(0 = never exit\)"),
    ]
    for name, text, message in cases:
        with raises(W + name, message):
            load(env={**ONE, W + name: text})
    with raises(W + "WEDGE_EXIT_ROUNDS", "invalid integer value '1.5'"):
        load(env={**ONE, W + "WEDGE_EXIT_ROUNDS": "1.5"})
    assert set(PROBER_ENV) == {W + n for n in ("STARTUP_WAIT_SECONDS", "HEALTH_INTERVAL_SECONDS", "WEDGE_EXIT_ROUNDS", "HOSTS_FILE")}  # fmt: skip


def test_the_hosts_file_knob_names_an_existing_file(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 workers.test\n")
    assert load(env={**ONE, W + "HOSTS_FILE": f" {hosts} "}).prober.hosts_file == str(hosts)
    with raises(W + "HOSTS_FILE", "file does not exist"):
        load(env={**ONE, W + "HOSTS_FILE": str(tmp_path / "missing")})


# --------------------------------------------------------------------------------------------
# the example file


def _yaml_paths(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in d.items():
        path = f"{prefix}.{key}" if prefix else key
        # an empty mapping (``tracing.resource: {}``) is a key with its default value
        out |= _yaml_paths(value, path) if isinstance(value, dict) and value else {path}
    return out


def test_the_example_file_loads_and_validates():
    loaded = load_gateway_config(EXAMPLE, env={}, check_files=False)
    cfg = loaded.config
    assert cfg.endpoints == ("worker-0.example:8001", "worker-1.example:8001")
    assert cfg.worker_names == ("gpu0", "gpu1")
    assert cfg.scheduling == SchedulingConfig(SchedulingMode.LEAST_OUTSTANDING, WorkBasis.COMPUTE)
    assert loaded.warnings == ()


def test_the_example_lists_every_key_the_loader_accepts_and_only_those():
    """The lpt_packing keys are valid only in that mode: config/gateway.lpt_packing.yaml
    lists them (tests/gateway/test_config_lpt.py)."""
    raw = YAML(typ="safe").load(EXAMPLE.read_text())
    lpt = {
        p for p in schema_paths() if p.split(".")[1:2] and p.split(".")[1] in LPT_SCHEDULING_KEYS
    }
    assert _yaml_paths(raw) == set(schema_paths()) - lpt
    text = EXAMPLE.read_text()
    for var in PROBER_ENV:
        assert var in text  # the environment-only knobs are documented there too


def test_the_example_shows_the_defaults_where_it_does_not_say_otherwise():
    raw = YAML(typ="safe").load(EXAMPLE.read_text())
    defaults = gateway_config_to_raw(GatewayConfig())
    differs = {
        p
        for p in _yaml_paths(raw)
        if p not in ("scheduling.work_basis",) and _dig(raw, p) != _dig(defaults, p)
    }
    assert differs == {
        "endpoints",
        "worker_metrics",
        "worker_names",
        "worker_http_endpoints",
        "scheduling.mode",
    }


def _dig(d: dict, path: str):
    for key in path.split("."):
        d = d[key]
    return d


# --------------------------------------------------------------------------------------------
# logging


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_logging_settings_are_applied_and_the_effective_config_is_logged():
    from kserve_trio.core.logging import configure_logging, get_logger

    stream = io.StringIO()
    try:
        configure_gateway_logging(LoggingConfig(level="info", format="json"), stream=stream)
        loaded = load_gateway_config(
            env={**ONE, W + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": "8"}
        )
        log_gateway_config(loaded, get_logger("gateway.test"))
        get_logger("gateway.test").debug("hidden_at_info")
        events = _lines(stream)
        names = [e["event"] for e in events]
        assert names == ["config_effective", "config_overridden_by_environment", "config_warning"]
        assert events[0]["source"] == "environment"
        assert events[0]["config"]["endpoints"] == ["127.0.0.1:9001"]
        assert events[0]["prober"]["wedge_exit_rounds"] == 3
        assert W + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER=8" in events[1]["overrides"]
        assert events[2]["level"] == "warning"

        debug = io.StringIO()
        configure_gateway_logging(LoggingConfig(level="debug", format="console"), stream=debug)
        get_logger("gateway.test").debug("shown_at_debug", k=1)
        assert "shown_at_debug" in debug.getvalue() and not debug.getvalue().startswith("{")
    finally:
        configure_logging("auto", "warning")
