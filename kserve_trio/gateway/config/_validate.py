"""Range and consistency checks of a built ``GatewayConfig``, and the warnings of a valid one."""

from __future__ import annotations

import math
import os
from typing import Any

from kserve_trio.core.config import validate_tls
from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import parse_level
from kserve_trio.gateway.addresses import parse_host_port
from kserve_trio.gateway.config._env import PROBER_ENV_NAME
from kserve_trio.gateway.config._types import (
    LOG_FORMATS,
    NO_ENDPOINTS,
    GatewayConfig,
    SchedulingMode,
    WorkerTlsConfig,
)


def validate_gateway_config(cfg: GatewayConfig, *, check_files: bool = True) -> None:
    """Range and consistency checks, the same for YAML-, environment- and code-built configs.

    Each rule names the path it checks; comparisons are written as the valid range so a NaN
    fails too. ``check_files`` also requires every named TLS file to exist (off for a config
    checked away from the host that will serve it).
    """
    _validate_addresses(cfg)
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
    sched = cfg.scheduling
    if sched.work_basis is not None and sched.mode is not SchedulingMode.LEAST_OUTSTANDING:
        raise ConfigError(
            f"applies to scheduling mode least_outstanding only (mode is '{sched.mode.value}')",
            "scheduling.work_basis",
        )
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
    for key, items in (("worker_metrics", cfg.worker_metrics), ("worker_names", cfg.worker_names)):
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
    cap = cfg.grpc.max_concurrent_requests_per_worker
    streams = cfg.worker_client.max_concurrent_streams
    if 0 < cap <= streams:
        out.append(
            f"grpc.max_concurrent_requests_per_worker ({cap}) is not above "
            f"worker_client.max_concurrent_streams ({streams}): requests are shed before the "
            "per-worker stream bound is reached, so none ever waits at the gateway for a slot"
        )
    return out
