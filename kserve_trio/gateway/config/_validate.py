"""Range and consistency checks of a built ``GatewayConfig``, and the warnings of a valid one."""

from __future__ import annotations

import math
import os
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import parse_level
from kserve_trio.core.process import (
    parse_header,
    parse_restrictions,
    validate_limits,
    validate_shm_policy,
    validate_tls,
    validate_tracing,
)
from kserve_trio.gateway.addresses import parse_host_port
from kserve_trio.gateway.config._env import PROBER_ENV_NAME
from kserve_trio.gateway.config._schema import LPT_SCHEDULING_KEYS, lpt_key_error
from kserve_trio.gateway.config._types import (
    LOG_FORMATS,
    MAX_PROCESSES,
    NO_ENDPOINTS,
    FillMode,
    GatewayConfig,
    SchedulingConfig,
    SchedulingMode,
    WorkerTlsConfig,
)

INFLIGHT_WARNING = (
    "fill mode 'inflight' parks a closed loop of fewer clients than the fill quantum on one "
    "replica; 'run' (the default) shares such a load evenly"
)


def validate_gateway_config(cfg: GatewayConfig, *, check_files: bool = True) -> None:
    """Range and consistency checks, the same for YAML-, environment- and code-built configs.

    Each rule names the path it checks; comparisons are written as the valid range so a NaN
    fails too. ``check_files`` also requires every named TLS file to exist (off for a config
    checked away from the host that will serve it).
    """
    _validate_addresses(cfg)
    validate_limits(cfg.limits)
    validate_tracing(cfg.tracing)
    parse_restrictions(cfg.restricted_protocols)
    validate_shm_policy(cfg.shm_policy)
    for i, header in enumerate(cfg.worker_client.headers):
        parse_header(header, f"worker_client.headers[{i}]")
    wc, grpc, pr = cfg.worker_client, cfg.grpc, cfg.prober
    rules: list[tuple[str, bool, str, Any]] = [
        (
            "worker_client.request_timeout_seconds",
            0 < wc.request_timeout_seconds < math.inf,
            "must be a positive number of seconds",
            wc.request_timeout_seconds,
        ),
        (
            "worker_client.max_concurrent_streams",
            wc.max_concurrent_streams > 0,
            "must be positive",
            wc.max_concurrent_streams,
        ),
        ("grpc.max_recv_msg_bytes", grpc.max_recv_msg_bytes > 0, "must be positive", None),
        ("grpc.max_send_msg_bytes", grpc.max_send_msg_bytes > 0, "must be positive", None),
        (
            "grpc.max_concurrent_requests_per_worker",
            grpc.max_concurrent_requests_per_worker >= 0,
            "must be >= 0 (0 = uncapped)",
            grpc.max_concurrent_requests_per_worker,
        ),
        (
            "grpc.max_queued_requests_per_worker",
            grpc.max_queued_requests_per_worker >= 0,
            "must be >= 0 (0 = no queue: shed at the cap)",
            grpc.max_queued_requests_per_worker,
        ),
        (
            "processes",
            1 <= cfg.processes <= MAX_PROCESSES,
            f"must be between 1 and {MAX_PROCESSES}",
            cfg.processes,
        ),
        (
            "process_liveness_interval_seconds",
            0 < cfg.process_liveness_interval_seconds < math.inf,
            "must be a positive number of seconds",
            cfg.process_liveness_interval_seconds,
        ),
        (
            "process_liveness_misses",
            cfg.process_liveness_misses >= 0,
            "must be >= 0 (0 = never kill an unresponsive process)",
            cfg.process_liveness_misses,
        ),
        (
            PROBER_ENV_NAME["startup_wait_seconds"],
            pr.startup_wait_seconds >= 0,
            "must be >= 0 seconds, or inf/forever/-1",
            pr.startup_wait_seconds,
        ),
        (
            PROBER_ENV_NAME["health_interval_seconds"],
            0 < pr.health_interval_seconds < math.inf,
            "must be a positive number of seconds",
            pr.health_interval_seconds,
        ),
        (
            PROBER_ENV_NAME["wedge_exit_rounds"],
            pr.wedge_exit_rounds >= 0,
            "must be >= 0 (0 = never exit)",
            pr.wedge_exit_rounds,
        ),
    ]
    for path, ok, rule, value in rules:
        if not ok:
            got = value if value is not None else _value_at(cfg, path)
            raise ConfigError(f"{rule} (got {got})", path)
    validate_scheduling(cfg.scheduling)
    hosts = pr.hosts_file
    if hosts and check_files and not os.path.isfile(hosts):
        raise ConfigError(f"file does not exist: {hosts}", PROBER_ENV_NAME["hosts_file"])
    validate_tls(cfg.tls, check_files=check_files, prefix="tls")
    _validate_worker_tls(wc.tls, check_files=check_files)
    try:
        parse_level(cfg.logging.level)
    except (ValueError, AttributeError):
        raise ConfigError(
            f"must be one of debug, info, warning, error, critical (got {cfg.logging.level!r})",
            "logging.level",
        ) from None
    if cfg.logging.format not in LOG_FORMATS:
        raise ConfigError(
            f"must be one of {', '.join(LOG_FORMATS)} (got {cfg.logging.format!r})",
            "logging.format",
        )


_WORK_BASIS_MODES = (SchedulingMode.LEAST_OUTSTANDING, SchedulingMode.LPT_PACKING)


def validate_scheduling(sched: SchedulingConfig) -> None:
    """The ``scheduling:`` rules (also what SetSchedulingPolicy checks a change against).

    1. ``work_basis`` applies to least_outstanding and lpt_packing only; every key of
       ``LPT_SCHEDULING_KEYS`` set away from its default applies to lpt_packing only.
    2. Ranges: ``rebalance_compute_seconds`` > 0, ``first_rebalance_compute_seconds`` >= 0,
       ``max_worker_share`` in (0, 1], ``hysteresis`` in [0, 1),
       ``ema_halflife_compute_seconds`` >= 0, ``default_replicas`` positive or all,
       ``routing_fill_factor`` > 0, ``compaction_interval`` >= 0; every number finite.
    """
    lpt = sched.mode is SchedulingMode.LPT_PACKING
    if sched.work_basis is not None and sched.mode not in _WORK_BASIS_MODES:
        raise ConfigError(
            "applies to scheduling modes least_outstanding and lpt_packing only "
            f"(mode is '{sched.mode.value}')",
            "scheduling.work_basis",
        )
    if not lpt:
        default = SchedulingConfig()
        for key in LPT_SCHEDULING_KEYS:
            if getattr(sched, key) != getattr(default, key):
                raise lpt_key_error(key, sched.mode)
        return
    inf = math.inf
    rules: list[tuple[str, bool, str]] = [
        ("rebalance_compute_seconds", 0 < sched.rebalance_compute_seconds < inf, "must be > 0"),
        (
            "first_rebalance_compute_seconds",
            0 <= sched.first_rebalance_compute_seconds < inf,
            "must be >= 0 (0 = use rebalance_compute_seconds)",
        ),
        ("max_worker_share", 0 < sched.max_worker_share <= 1, "must be in (0, 1]"),
        ("hysteresis", 0 <= sched.hysteresis < 1, "must be in [0, 1)"),
        (
            "ema_halflife_compute_seconds",
            0 <= sched.ema_halflife_compute_seconds < inf,
            "must be >= 0 (0 = track rebalance_compute_seconds)",
        ),
        (
            "default_replicas",
            sched.default_replicas == -1 or sched.default_replicas > 0,
            "must be a positive integer or 'all'",
        ),
        ("routing_fill_factor", 0 < sched.routing_fill_factor < inf, "must be > 0"),
        ("compaction_interval", sched.compaction_interval >= 0, "must be >= 0 (0 = never)"),
    ]
    for key, ok, rule in rules:
        if not ok:
            value = getattr(sched, key)
            shown = "all" if key == "default_replicas" and value == -1 else value
            raise ConfigError(f"{rule} (got {shown})", f"scheduling.{key}")
    for name, model in sched.models.items():
        path = f"scheduling.models.{name}"
        if model.replicas is not None and not (model.replicas == -1 or model.replicas > 0):
            raise ConfigError(
                f"must be a positive integer or 'all' (got {model.replicas})", f"{path}.replicas"
            )
        if not 0 <= model.fill_factor < inf:
            raise ConfigError(f"must be > 0 (got {model.fill_factor})", f"{path}.fill_factor")
        if model.fill_mode is not None and not isinstance(model.fill_mode, FillMode):
            raise ConfigError(f"must be a fill mode (got {model.fill_mode!r})", f"{path}.fill_mode")


def _value_at(cfg: GatewayConfig, path: str) -> Any:
    value: Any = cfg
    for key in path.split("."):
        value = getattr(value, key)
    return value


def _validate_addresses(cfg: GatewayConfig) -> None:
    listen = [("listen.grpc", cfg.listen.grpc), ("listen.metrics", cfg.listen.metrics)]
    if cfg.listen.http:
        listen.append(("listen.http", cfg.listen.http))
    for path, text in listen:
        try:
            parse_host_port(text, allow_port_zero=True)
        except ValueError as exc:
            raise ConfigError(str(exc), path) from None
    grpc_addr, metrics_addr = cfg.listen.grpc_address, cfg.listen.metrics_address
    if grpc_addr[1] != 0 and grpc_addr == metrics_addr:
        raise ConfigError(f"must differ from listen.grpc ({cfg.listen.grpc})", "listen.metrics")
    http_addr = cfg.listen.http_address
    if http_addr is not None and http_addr[1] != 0 and http_addr in (grpc_addr, metrics_addr):
        raise ConfigError(
            f"must differ from listen.grpc ({cfg.listen.grpc}) and listen.metrics "
            f"({cfg.listen.metrics})",
            "listen.http",
        )
    if not cfg.endpoints:
        raise ConfigError(NO_ENDPOINTS, "endpoints")
    seen: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(cfg.endpoints):
        try:
            host, port = parse_host_port(entry)
        except ValueError as exc:
            raise ConfigError(str(exc), f"endpoints[{i}]") from None
        key = (host.lower(), port)
        if key in seen:
            raise ConfigError(f"repeats endpoints[{seen[key]}] ('{entry}')", f"endpoints[{i}]")
        seen[key] = i
    n = len(cfg.endpoints)
    aligned = (
        ("worker_metrics", cfg.worker_metrics),
        ("worker_names", cfg.worker_names),
        ("worker_http_endpoints", cfg.worker_http_endpoints),
    )
    for key, items in aligned:
        if items and len(items) != n:
            raise ConfigError(
                f"must have one entry per endpoints entry, index-aligned "
                f"(got {len(items)} for {n} endpoints)",
                key,
            )
    for i, entry in enumerate(cfg.worker_metrics):
        try:
            parse_host_port(entry)
        except ValueError as exc:
            raise ConfigError(str(exc), f"worker_metrics[{i}]") from None
    _validate_http_endpoints(cfg)
    names: dict[str, int] = {}
    for i, name in enumerate(cfg.worker_names):
        if not name or any(c.isspace() for c in name):
            raise ConfigError(
                f"must be a non-empty name without whitespace (got {name!r})", f"worker_names[{i}]"
            )
        if name in names:
            raise ConfigError(
                f"repeats worker_names[{names[name]}] ('{name}')", f"worker_names[{i}]"
            )
        names[name] = i


def _validate_http_endpoints(cfg: GatewayConfig) -> None:
    """Each REST address parses, differs from its own gRPC endpoint, and is listed once."""
    seen: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(cfg.worker_http_endpoints):
        path = f"worker_http_endpoints[{i}]"
        try:
            host, port = parse_host_port(entry)
        except ValueError as exc:
            raise ConfigError(str(exc), path) from None
        key = (host.lower(), port)
        grpc_host, grpc_port = parse_host_port(cfg.endpoints[i])
        if key == (grpc_host.lower(), grpc_port):
            raise ConfigError(
                f"is endpoints[{i}] itself ('{entry}'); a worker's REST port differs from its "
                "gRPC port",
                path,
            )
        if key in seen:
            raise ConfigError(f"repeats worker_http_endpoints[{seen[key]}] ('{entry}')", path)
        seen[key] = i


def _validate_worker_tls(tls: WorkerTlsConfig, *, check_files: bool) -> None:
    prefix = "worker_client.tls"
    if bool(tls.cert_file) != bool(tls.key_file):
        missing = "key_file" if tls.cert_file else "cert_file"
        present = "cert_file" if tls.cert_file else "key_file"
        raise ConfigError(f"must be set together with {present}", f"{prefix}.{missing}")
    for name in ("ca_file", "cert_file", "key_file") if check_files else ():
        path = getattr(tls, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"file does not exist: {path}", f"{prefix}.{name}")


def config_warnings(cfg: GatewayConfig) -> list[str]:
    """What is valid but probably not meant (logged at start-up)."""
    out = []
    sched = cfg.scheduling
    if sched.mode is SchedulingMode.LPT_PACKING:
        modes = [sched.routing_fill_mode, *(m.fill_mode for m in sched.models.values())]
        if FillMode.INFLIGHT in modes:
            out.append(INFLIGHT_WARNING)
    cap = cfg.grpc.max_concurrent_requests_per_worker
    streams = cfg.worker_client.max_concurrent_streams
    if 0 < cap <= streams:
        out.append(
            f"grpc.max_concurrent_requests_per_worker ({cap}) is not above "
            f"worker_client.max_concurrent_streams ({streams}): requests are shed before the "
            "per-worker stream bound is reached, so none ever waits at the gateway for a slot"
        )
    return out
